"""The core's refusals, word for word: a record, a key file, a signature or a model path that
is refused says which and why, because that one line is all an operator at an edge sees."""

from __future__ import annotations

import base64
import os

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from farm.core import hashing
from farm.core.errors import (
    IntegrityMismatch,
    KeyFileError,
    ModelFileError,
    SignatureError,
    SpecError,
)
from farm.core.hashing import sha256_file
from farm.core.identity import ModelRef
from farm.core.signing import (
    Manifest,
    Signer,
    TrustedKeys,
    create_key_pair,
    key_id,
    public_key_path,
)
from farm.core.spec import CompileSpec, Toolchain

KEY = "a" * 64
RECORD = {
    "cache_key": KEY,
    "sha256": "1" * 64,
    "size_bytes": 10,
    "payload_offset": 0,  # a plain export_model() blob: the payload starts at byte 0
    "target": "CPU",
    "toolchain": {"openvino": "2026.4.1", "npu_compiler": None},
    "weightless": False,
    "model": {"xml": "2" * 64, "bin": "3" * 64},
}
SIGNER = Signer(Ed25519PrivateKey.from_private_bytes(bytes(range(32))))
SIGNER_ID = SIGNER.key_id


# --- manifests -------------------------------------------------------------------------------


def test_a_record_at_the_limits_is_a_manifest():
    manifest = Manifest.from_record({**RECORD, "size_bytes": 0, "extra": "ignored"})
    assert manifest.fields() == {**RECORD, "size_bytes": 0}


def test_a_record_lacking_a_field_names_it():
    record = {key: value for key, value in RECORD.items() if key != "size_bytes"}
    with pytest.raises(IntegrityMismatch) as raised:
        Manifest.from_record(record)
    assert str(raised.value) == f"the farm's record of blob {KEY} lacks 'size_bytes'"


def test_a_malformed_record_names_every_bad_field_in_order():
    bad = {
        "cache_key": "A" * 70,
        "sha256": "1" * 63,
        "size_bytes": -1,
        "payload_offset": True,
        "target": None,
        "toolchain": {"openvino": 2026},
        "weightless": "no",
        "model": {"xml": None},  # a model digest is never null, unlike a toolchain field
    }
    with pytest.raises(IntegrityMismatch) as raised:
        Manifest.from_record(bad)
    assert str(raised.value) == (
        f"the farm's record of blob {'A' * 64} is malformed (cache_key, sha256, size_bytes, "
        "payload_offset, target, toolchain, weightless, model); refusing it"
    )


# --- key files -------------------------------------------------------------------------------


def test_a_new_key_pair_lands_in_new_folders_private_to_its_owner(tmp_path):
    private = tmp_path / "a" / "b" / "signing.pem"
    public, created_id = create_key_pair(private)
    assert public == public_key_path(private) == tmp_path / "a" / "b" / "signing.pem.pub"
    assert private.stat().st_mode & 0o777 == 0o600
    assert created_id == Signer.from_file(private).key_id
    assert list(TrustedKeys.from_files([public]).keys) == [created_id]


def ec_key_files(tmp_path):
    private = ec.generate_private_key(ec.SECP256R1())
    private_path, public_path = tmp_path / "ec.pem", tmp_path / "ec.pem.pub"
    private_path.write_bytes(
        private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    public_path.write_bytes(
        private.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return private_path, public_path


def test_a_key_file_that_is_not_an_ed25519_key_is_refused_by_its_path(tmp_path):
    private, public = ec_key_files(tmp_path)
    with pytest.raises(KeyFileError) as raised:
        Signer.from_file(private)
    assert str(raised.value) == f"{private}: not an Ed25519 key"
    with pytest.raises(KeyFileError) as raised:
        TrustedKeys.from_files([public])
    assert str(raised.value) == f"{public}: not an Ed25519 key"


def test_an_unreadable_key_file_is_refused_by_its_path(tmp_path):
    missing = tmp_path / "missing.pem"
    with pytest.raises(
        KeyFileError, match=r"^(.*): not a readable Ed25519 private key: "
    ) as raised:
        Signer.from_file(missing)
    assert str(raised.value).startswith(f"{missing}: not a readable Ed25519 private key: ")
    with pytest.raises(KeyFileError) as raised:
        TrustedKeys.from_files([missing])
    assert str(raised.value).startswith(f"{missing}: not a readable Ed25519 public key: ")


# --- signatures ------------------------------------------------------------------------------

TRUSTED = TrustedKeys({SIGNER_ID: SIGNER.public_key})
MANIFEST = Manifest.from_record(RECORD)


def refused(check) -> str:
    with pytest.raises(SignatureError) as raised:
        check()
    return str(raised.value)


def test_a_signature_without_its_signer_or_a_signer_without_signature_is_unsigned():
    signature = SIGNER.sign(KEY, RECORD["sha256"])
    unsigned = f"blob {KEY} is not signed; refusing to import it"
    assert refused(lambda: TRUSTED.verify(KEY, RECORD["sha256"], None, signature)) == unsigned
    assert refused(lambda: TRUSTED.verify(KEY, RECORD["sha256"], SIGNER_ID, None)) == unsigned
    # A v1 signature with no signer named is unsigned too, not "v1 only".
    assert refused(lambda: TRUSTED.verify_manifest(MANIFEST, None, None, signature)) == unsigned
    assert refused(lambda: TRUSTED.verify_manifest(MANIFEST, SIGNER_ID, None)) == unsigned


def test_an_untrusted_signer_is_named_with_the_keys_this_machine_trusts():
    other = Ed25519PrivateKey.from_private_bytes(bytes(32)).public_key()
    both = TRUSTED.with_key(other)
    signature = SIGNER.sign_manifest(MANIFEST)
    assert refused(lambda: TrustedKeys({}).verify_manifest(MANIFEST, SIGNER_ID, signature)) == (
        f"blob {KEY} is signed by key {SIGNER_ID}, which this machine does not trust "
        "(trusted: none; FARM_TRUSTED_KEYS)"
    )
    assert refused(lambda: both.verify_manifest(MANIFEST, "0" * 16, signature)) == (
        f"blob {KEY} is signed by key {'0' * 16}, which this machine does not trust "
        f"(trusted: {', '.join(sorted([SIGNER_ID, key_id(other)]))}; FARM_TRUSTED_KEYS)"
    )


def test_a_signature_with_bytes_outside_base64_is_invalid_not_cleaned_up():
    signature = SIGNER.sign_manifest(MANIFEST)
    TRUSTED.verify_manifest(MANIFEST, SIGNER_ID, signature)
    for tampered in (signature[:8] + "*" + signature[8:], signature + "\n", "%%%"):
        assert refused(lambda s=tampered: TRUSTED.verify_manifest(MANIFEST, SIGNER_ID, s)) == (
            f"blob {KEY} has an invalid signature from key {SIGNER_ID}; refusing it"
        )
    assert len(base64.b64decode(signature, validate=True)) == 64


def test_a_non_text_signer_or_signature_is_malformed():
    assert refused(lambda: TRUSTED.verify_manifest(MANIFEST, SIGNER_ID, b"bytes")) == (
        f"blob {KEY} has a malformed signature; refusing it"
    )


# --- model files and specs -------------------------------------------------------------------


def test_a_missing_model_file_is_named_with_its_role(tmp_path):
    with pytest.raises(ModelFileError) as raised:
        hashing.model_files(tmp_path / "net.onnx")
    assert str(raised.value) == f"{tmp_path / 'net.onnx'}: model file does not exist"
    (tmp_path / "net.xml").write_text("<net/>")
    with pytest.raises(ModelFileError) as raised:
        hashing.model_files(tmp_path / "net.xml")
    assert str(raised.value) == f"{tmp_path / 'net.bin'}: its weights file does not exist"


def test_digesting_a_model_reports_every_byte_read(tmp_path):
    (tmp_path / "net.xml").write_bytes(b"x" * 1000)
    (tmp_path / "net.bin").write_bytes(os.urandom(3 * hashing.CHUNK_BYTES + 5))
    read: list[int] = []
    identity = hashing.model_identity(hashing.model_files(tmp_path / "net.xml"), read.append)
    assert sum(read) == 1000 + 3 * hashing.CHUNK_BYTES + 5
    assert identity == {
        "bin": hashing.sha256_file(tmp_path / "net.bin"),
        "xml": hashing.sha256_file(tmp_path / "net.xml"),
    }


def test_unknown_spec_fields_are_named_sorted():
    with pytest.raises(SpecError) as raised:
        CompileSpec.from_canonical("CPU", {**CompileSpec.create("CPU").canonical(), "z": 1, "a": 2})
    assert str(raised.value) == "unknown spec fields: a, z"


def test_a_toolchain_record_has_every_field():
    """What a blob's row and its manifest record of the toolchain (`Toolchain.as_dict`)."""
    assert Toolchain("2026.4.1", "build", "7.4.0", "rr").as_dict() == {
        "openvino": "2026.4.1",
        "openvino_build": "build",
        "npu_compiler": "7.4.0",
        "runtime_requirements": "rr",
    }


def test_only_a_v1_signature_is_refused_with_the_way_out():
    v1 = SIGNER.sign(KEY, RECORD["sha256"])
    assert refused(lambda: TRUSTED.verify_manifest(MANIFEST, SIGNER_ID, None, v1)) == (
        f"blob {KEY} carries only a v1 signature, over its cache key and sha256, which leaves "
        "its target, toolchain, size and model digests unsigned; refusing it. The farm's "
        "operator signs its manifest with `farm keys resign`"
    )
    assert refused(lambda: TRUSTED.verify(KEY, "2" * 64, SIGNER_ID, v1)) == (
        f"blob {KEY} has an invalid signature from key {SIGNER_ID}; refusing it"
    )


# --- model references ------------------------------------------------------------------------


def test_a_model_ref_reads_its_files_once_and_keeps_its_name(tmp_path):
    xml, weights = tmp_path / "net.xml", tmp_path / "net.bin"
    xml.write_bytes(b"<net/>")
    weights.write_bytes(b"w" * 100)
    read: list[int] = []
    ref = ModelRef.from_path(xml, read.append)
    assert (ref.files, ref.name, sum(read)) == ({"xml": xml, "bin": weights}, "net.xml", 106)
    assert ref.identity == {"bin": sha256_file(weights), "xml": sha256_file(xml)}


def test_a_file_name_that_is_not_utf8_keeps_its_readable_part(tmp_path):
    xml = tmp_path / os.fsdecode(b"caf\xe9.xml")
    xml.write_bytes(b"<net/>")
    xml.with_suffix(".bin").write_bytes(b"w")
    assert ModelRef.from_path(xml).name == "caf\ufffd.xml"
