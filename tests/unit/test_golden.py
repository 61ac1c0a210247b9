"""Golden vectors: the bytes other machines depend on, pinned so they never drift unnoticed.

Each vector is computed through the public function a worker or an edge calls (`key_for` on
model files read from disk, `Signer`, `read_header`), never rebuilt by hand, so a bug that
changes what those functions produce fails here even when every other test changes with it:
- a cache key is what an edge asks for; a different key for the same model, spec and toolchain
  is a miss for every blob already compiled (or, worse, a hit on another target's blob);
- a signature is checked by edges of another version during a rolling upgrade; a signer and a
  verifier changed together pass every round-trip test and still reject every blob signed
  before;
- a payload offset is where an edge imports from; it is signed in every manifest.
A failure names the version constant to bump. Bumping it is a decision for every fleet: the
old form must keep working (or be migrated) wherever blobs of that version exist.
"""

from __future__ import annotations

import base64
import tracemalloc
import zipfile
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from farm.core import blobformat, hashing, signing, sources, stages
from farm.core.errors import BlobFormatError, SignatureError
from farm.core.identity import ModelRef, key_for
from farm.core.signing import Manifest, Signer, TrustedKeys
from farm.core.spec import CompileSpec, Toolchain

# --- cache keys ------------------------------------------------------------------------------

KEY_VERSION = 1
"""The `hashing.CACHE_KEY_VERSION` these vectors were computed for."""
BUMP_KEY = (
    "a changed cache key re-keys every blob in every fleet (edges miss every blob already "
    "compiled, or hit another target's): if this change is intended, bump "
    "farm.core.hashing.CACHE_KEY_VERSION and recompute these vectors"
)

XML = b'<?xml version="1.0"?>\n<net name="golden" version="11"><layers/></net>\n'
WEIGHTS = bytes(range(256)) * 16
ONNX = b"\x08\x07\x12\x06golden"
RR = "meta=1.0;ov=2026.4.1;isa=Intel AVX-512 with Intel DL Boost"
TOOLCHAIN = Toolchain(
    "2026.4.1",
    openvino_build="2026.4.1-22982-e213a147257-releases/2026/4",
    npu_compiler="7.4.0",
    runtime_requirements=RR,
)
"""Every field set: only `key_part(target)` of it may reach the key, never the build or the
NPU compiler (an edge with another build of the same release must hit)."""

FILE_DIGESTS = {
    "xml": "1d1e8adf307f93611d529a98c74c9ab649a7d916d4bd324d9f212f950e87e285",
    "bin": "c8f5d0341d54d951a71b136e6e2afcb14d11ed8489a7ae126a8fee0df6ecf193",
    "onnx": "b4ebcf6fece4e183eeaea471bbbd2fde36ee6cca0442fa77579b6be53e5610f3",
}

SPECS = {
    "CPU": CompileSpec.create("CPU", performance_hint="throughput", batch=2, layout=["NCHW"]),
    "NPU.3720": CompileSpec.create("3720", tiles=2, performance_hint="latency"),
    "NPU.4000": CompileSpec.create(
        "4000", tiles=6, compiler_params="optimization-level=2 performance-hint-override=latency"
    ),
    "NPU.5010": CompileSpec.create("5010", weightless=True, shapes=["input_ids[1,128]"]),
    "NPU.5020": CompileSpec.create("5020", config=["NPU_TURBO=yes"]),
}
"""One spec per target; every platform, so a key that forgets the platform fails."""

GOLDEN_KEYS = {
    ("ir", "CPU"): "cb4003b5b604666d7bbcf1e9bd469bf648466cc734cb017841f370cc74ed55a6",
    ("ir", "NPU.3720"): "f3bf80beabd69612d402503eac1a059ab5aaecbbb6341660682d90a4eb43b0cd",
    ("ir", "NPU.4000"): "da52b62fc373afa23dce4d6664682817e0985dd05655df7ae2a1d9731d2e856a",
    ("ir", "NPU.5010"): "49f18d748e2298bc2ec89d0f3999728253b9417cd05882f4ef04212a8ff9f939",
    ("ir", "NPU.5020"): "04c6ceb21846b6f1298af7a061d445e061684fc113d671c7a2923559d6ddaa2e",
    ("onnx", "CPU"): "1cbc220f1ac5ef7a67349560c0683678b3f64f4f5682b202b9118503c7e8da27",
    ("onnx", "NPU.4000"): "761354ad62e86b9e8665d77c0bd02fe471f812f37a3393b4ced4677d43b738f8",
}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """The model files, written from the bytes above: the key starts from files on disk."""
    folder = tmp_path_factory.mktemp("golden")
    (folder / "golden.xml").write_bytes(XML)
    (folder / "golden.bin").write_bytes(WEIGHTS)
    (folder / "golden.onnx").write_bytes(ONNX)
    return {"ir": folder / "golden.xml", "onnx": folder / "golden.onnx"}


def test_the_vectors_are_for_the_current_key_version():
    assert hashing.CACHE_KEY_VERSION == KEY_VERSION, (
        f"CACHE_KEY_VERSION is {hashing.CACHE_KEY_VERSION}; these vectors are for "
        f"{KEY_VERSION}: recompute them for the new version and set KEY_VERSION"
    )


def test_model_file_digests(models):
    identity = {
        **ModelRef.from_path(models["ir"]).identity,
        **ModelRef.from_path(models["onnx"]).identity,
    }
    assert identity == FILE_DIGESTS, f"the digest of a model file changed: {BUMP_KEY}"


@pytest.mark.parametrize(
    ("kind", "target"), list(GOLDEN_KEYS), ids=[f"{k}-{t}" for k, t in GOLDEN_KEYS]
)
def test_cache_key(models, kind, target):
    model = ModelRef.from_path(models[kind])
    key = key_for(model.identity, SPECS[target], TOOLCHAIN)
    assert key == GOLDEN_KEYS[kind, target], f"cache key of {kind} for {target}: {BUMP_KEY}"


def test_every_target_has_its_own_key(models):
    """The platform is part of the key: an edge never pulls a blob built for another NPU."""
    model = ModelRef.from_path(models["ir"])
    same_spec = {
        target: key_for(model.identity, CompileSpec.create(target), TOOLCHAIN)
        for target in ("CPU", "3720", "4000", "5010", "5020")
    }
    assert len(set(same_spec.values())) == 5, same_spec


def test_the_build_and_the_npu_compiler_are_not_in_the_key(models):
    """Edges run other builds of the same release: only `key_part(target)` is hashed."""
    model = ModelRef.from_path(models["ir"])
    other_build = Toolchain(TOOLCHAIN.openvino, "another-build", "0.0.1", RR)
    for spec in SPECS.values():
        assert key_for(model.identity, spec, other_build) == key_for(
            model.identity, spec, TOOLCHAIN
        )


# --- signatures ------------------------------------------------------------------------------

BUMP_SIGNATURE = (
    "signatures already stored would no longer verify (every edge of another version refuses "
    "every blob during a rolling upgrade): if this change is intended, bump "
    "farm.core.signing.MANIFEST_VERSION and MANIFEST_DOMAIN (or MESSAGE_VERSION for the v1 "
    "signature) and keep verifying the old form"
)
SEED = bytes(range(32))
"""A fixed Ed25519 private key: Ed25519 signatures are deterministic, so they can be pinned."""
GOLDEN_KEY_ID = "56475aa75463474c"
CACHE_KEY, SHA256 = "a" * 64, "1" * 64
GOLDEN_V1_MESSAGE = b"farm-blob-signature-v1\n" + CACHE_KEY.encode() + b"\n" + SHA256.encode()
GOLDEN_V1 = (
    "j+yNV1gguGlFaqSU0AZUN4D5x10DlEmWtPx/mUvz0cp0zpIvwDhVtzO9PdFo8lUbd6P6aftkZVMBUy45Q9hnBg=="
)
MANIFEST = Manifest(
    cache_key=CACHE_KEY,
    sha256=SHA256,
    size_bytes=12_288,
    payload_offset=4096,
    target="NPU.4000",
    toolchain={"openvino": "2026.4.1", "npu_compiler": "7.4.0", "runtime_requirements": None},
    weightless=True,
    model={"bin": "3" * 64, "xml": "2" * 64},
)
GOLDEN_MANIFEST_MESSAGE = (
    b"farm-blob-manifest-v2\n"
    b'{"cache_key":"' + CACHE_KEY.encode() + b'","model":{"bin":"' + b"3" * 64 + b'","xml":"'
    b"" + b"2" * 64 + b'"},"payload_offset":4096,"sha256":"' + SHA256.encode() + b'",'
    b'"size_bytes":12288,"target":"NPU.4000","toolchain":{"npu_compiler":"7.4.0",'
    b'"openvino":"2026.4.1","runtime_requirements":null},"v":2,"weightless":true}'
)
GOLDEN_V2 = (
    "RR/IEnW8GzF5LRC6QJ0ilWx85r59ML04ZXZihDIvazIDSPeVgOFcFum0vBtdxTy0aH0mN+97quEErglO54l0Cw=="
)


@pytest.fixture(scope="module")
def signer() -> Signer:
    return Signer(Ed25519PrivateKey.from_private_bytes(SEED))


def test_the_key_id(signer):
    assert signer.key_id == GOLDEN_KEY_ID, (
        "the key id of a fixed key changed: edges look the signer up by it in "
        f"FARM_TRUSTED_KEYS and would trust no stored signature; {BUMP_SIGNATURE}"
    )


def test_the_signed_messages(signer):
    assert signing.message(CACHE_KEY, SHA256) == GOLDEN_V1_MESSAGE, BUMP_SIGNATURE
    assert MANIFEST.message() == GOLDEN_MANIFEST_MESSAGE, BUMP_SIGNATURE


def test_the_signatures(signer):
    assert signer.sign(CACHE_KEY, SHA256) == GOLDEN_V1, f"v1 signature: {BUMP_SIGNATURE}"
    assert signer.sign_manifest(MANIFEST) == GOLDEN_V2, f"v2 signature: {BUMP_SIGNATURE}"


def test_the_stored_signatures_verify(signer):
    """What an edge of this version does with a signature made by any earlier worker."""
    trusted = TrustedKeys({GOLDEN_KEY_ID: signer.public_key})
    trusted.verify(CACHE_KEY, SHA256, GOLDEN_KEY_ID, GOLDEN_V1)
    trusted.verify_manifest(MANIFEST, GOLDEN_KEY_ID, GOLDEN_V2)
    # ...and only for what was signed: the other version's signature, another manifest.
    with pytest.raises(SignatureError, match="invalid signature"):
        trusted.verify_manifest(MANIFEST, GOLDEN_KEY_ID, GOLDEN_V1)
    moved = Manifest(**{**MANIFEST.fields(), "payload_offset": 0})
    with pytest.raises(SignatureError, match="invalid signature"):
        trusted.verify_manifest(moved, GOLDEN_KEY_ID, GOLDEN_V2)


def test_the_signature_is_base64_of_64_bytes(signer):
    assert len(base64.b64decode(GOLDEN_V2, validate=True)) == 64


REFERENCE_SHA256, REFERENCE_SIZE = "4" * 64, 1234
GOLDEN_REFERENCE_MESSAGE = (
    b"farm-blob-reference-v1\n"
    b'{"cache_key":"' + CACHE_KEY.encode() + b'","reference_sha256":"' + b"4" * 64 + b'",'
    b'"reference_size":1234,"sha256":"' + SHA256.encode() + b'"}'
)
GOLDEN_REFERENCE = (
    "eF3hWyTAVb7rSiXFj7l03oe19WlVuQ8OlSaO7fxyLhNkgPKwYVQVOGTTNXThfgn825nn00gA/K+6yTMv3V4OBQ=="
)
BUMP_REFERENCE = BUMP_SIGNATURE.replace(
    "farm.core.signing.MANIFEST_VERSION and MANIFEST_DOMAIN (or MESSAGE_VERSION for the v1 "
    "signature)",
    "farm.core.signing.REFERENCE_DOMAIN",
)


def test_the_reference_signature(signer):
    """The signature binding reference outputs to their blob: its own message and domain."""
    message = signing.reference_message(CACHE_KEY, SHA256, REFERENCE_SHA256, REFERENCE_SIZE)
    assert message == GOLDEN_REFERENCE_MESSAGE, BUMP_REFERENCE
    signature = signer.sign_reference(CACHE_KEY, SHA256, REFERENCE_SHA256, REFERENCE_SIZE)
    assert signature == GOLDEN_REFERENCE, BUMP_REFERENCE
    record = {
        "cache_key": CACHE_KEY,
        "sha256": SHA256,
        "reference_sha256": REFERENCE_SHA256,
        "reference_size_bytes": REFERENCE_SIZE,
        "reference_signature": GOLDEN_REFERENCE,
        "signing_key_id": GOLDEN_KEY_ID,
    }
    TrustedKeys({GOLDEN_KEY_ID: signer.public_key}).verify_reference(record)


def test_a_reference_refusal_names_the_blob_by_its_64_character_key(signer):
    record = {
        "cache_key": CACHE_KEY + "tail",
        "sha256": SHA256,
        "reference_sha256": REFERENCE_SHA256,
        "reference_size_bytes": REFERENCE_SIZE,
        "reference_signature": GOLDEN_REFERENCE,
        "signing_key_id": "0" * 16,
    }
    with pytest.raises(SignatureError) as raised:
        TrustedKeys({GOLDEN_KEY_ID: signer.public_key}).verify_reference(record)
    assert str(raised.value) == (
        f"blob {CACHE_KEY} is signed by key {'0' * 16}, which this machine does not trust "
        f"(trusted: {GOLDEN_KEY_ID}; FARM_TRUSTED_KEYS)"
    )


# --- the blob header -------------------------------------------------------------------------

BUMP_HEADER = (
    "the payload offset of a stored blob changed: it is signed in every manifest and edges "
    "import from it. blobformat reads OpenVINO's own cache-entry format (docs/openvino.md) and "
    "has no version of its own: it must keep reading every blob already stored; a farm "
    "format change needs farm.core.signing.MANIFEST_VERSION bumped"
)
NPU_HEADER = (
    b'<?xml version="1.0"?><compiled_blob ie_version="2026.4.1-22982-e213a147257-releases/2026/4"'
    b' file_info="6142509191626859559" runtime_info="{OV_VERSION:2026.4.1}"'
    b' header_size_alignment="4096"/>\n'
)
"""OpenVINO's cache-entry header as the NPU plugin writes it: padded to 4096 bytes."""
CPU_HEADER = NPU_HEADER.replace(b'"4096"', b'"0"')
PAYLOAD = b"NPU export payload"


def blob(tmp_path: Path, header: bytes, size: int, name: str = "x.blob") -> Path:
    """A blob of `size` bytes: the header, zero padding, then the payload."""
    path = tmp_path / name
    padding = size - len(header) - len(PAYLOAD)
    path.write_bytes(header + b"\0" * padding + PAYLOAD)
    return path


def test_an_aligned_header_puts_the_payload_at_the_alignment(tmp_path):
    header = blobformat.read_header(blob(tmp_path, NPU_HEADER, 4096 + len(PAYLOAD)))
    assert header.payload_offset == 4096, BUMP_HEADER
    assert header.attributes == {
        "ie_version": "2026.4.1-22982-e213a147257-releases/2026/4",
        "file_info": "6142509191626859559",
        "runtime_info": "{OV_VERSION:2026.4.1}",
        "header_size_alignment": "4096",
    }
    assert header.openvino_build == "2026.4.1-22982-e213a147257-releases/2026/4"


def test_an_unaligned_header_puts_the_payload_right_after_it(tmp_path):
    header = blobformat.read_header(blob(tmp_path, CPU_HEADER, len(CPU_HEADER) + len(PAYLOAD)))
    assert header.payload_offset == len(CPU_HEADER) == 189, BUMP_HEADER


def test_a_header_without_an_alignment_puts_the_payload_right_after_it():
    bare = CPU_HEADER.replace(b' header_size_alignment="0"', b"")
    assert blobformat.parse_header(bare, len(bare) + 1, "x").payload_offset == len(bare)


def test_an_alignment_the_header_already_ends_on_adds_no_padding():
    exact = CPU_HEADER.replace(b'"0"', b'"191"')  # 191 bytes long, aligned to 191
    assert len(exact) == 191
    assert blobformat.parse_header(exact, 192, "x").payload_offset == 191
    assert (
        blobformat.parse_header(exact.replace(b'"191"', b'"192"'), 193, "x").payload_offset == 192
    )


@pytest.mark.parametrize(
    ("header", "size"),
    [
        (NPU_HEADER, len(NPU_HEADER)),  # the header alone
        (NPU_HEADER, 4096),  # the header and its padding, nothing after
        (CPU_HEADER, len(CPU_HEADER)),
    ],
)
def test_a_header_without_a_payload_is_refused(header, size):
    with pytest.raises(BlobFormatError, match=rf"^x: blob has a header but no payload \({size} "):
        blobformat.parse_header(header + b"\0" * (size - len(header)), size, "x")


def test_a_blob_file_without_a_payload_is_refused_by_its_path(tmp_path):
    path = tmp_path / "cut.blob"
    path.write_bytes(NPU_HEADER + b"\0" * (4096 - len(NPU_HEADER)))
    with pytest.raises(BlobFormatError) as raised:
        blobformat.read_header(path)
    assert str(raised.value) == f"{path}: blob has a header but no payload (4096 bytes)"
    path.write_bytes(PAYLOAD)
    with pytest.raises(BlobFormatError) as raised:
        blobformat.read_header(path)
    assert str(raised.value) == f"{path}: not an OpenVINO compiled blob (no cache header)"


def test_one_byte_of_payload_is_enough():
    assert blobformat.parse_header(NPU_HEADER, 4097, "x").payload_offset == 4096


@pytest.mark.parametrize(
    "head",
    [
        b"",
        PAYLOAD,
        NPU_HEADER.replace(b"/>\n", b">\n"),
        NPU_HEADER.replace(b"compiled_blob", b"compiled_blobs"),
    ],
)
def test_what_is_not_a_cache_entry_is_refused(head):
    with pytest.raises(BlobFormatError, match=r"^x: not an OpenVINO compiled blob"):
        blobformat.parse_header(head + b"\n" + PAYLOAD, 100_000, "x")


def test_the_header_is_read_without_reading_the_blob(tmp_path):
    """An edge reads the header of a multi-gigabyte blob before mapping it: a bounded read."""
    path = tmp_path / "big.blob"
    with open(path, "wb") as sink:
        sink.write(NPU_HEADER)
        sink.truncate(1 << 30)  # sparse: 1 GiB on disk costs nothing
    tracemalloc.start()
    try:
        header = blobformat.read_header(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert header.payload_offset == 4096
    assert peak < 2 * blobformat.MAX_HEADER_BYTES, f"peak {peak} bytes reading a header"


# --- stages (docs/architecture.md §15) --------------------------------------------------------

STAGE_VERSION = 1
"""The `stages.STAGE_KEY_VERSION` these vectors were computed for."""
BUMP_STAGE = (
    "a changed stage key re-keys every converted model (every blob compiled from a source "
    "misses, and every recorded conversion is orphaned): if this change is intended, bump "
    "farm.core.stages.STAGE_KEY_VERSION and recompute these vectors"
)
TFLITE = b"\x1c\x00\x00\x00TFL3golden"
HF_CONFIG = b'{"architectures": ["BertForSequenceClassification"], "model_type": "bert"}\n'
HF_WEIGHTS = bytes(range(200))
GOLDEN_STAGES = {
    "tflite": "a5cbab236ef11854d90374c31bab389eb57afbab75f0da2904515b07f488c9b2",
    "huggingface": "a9ad9f188192f6198665c6efea9bc790ce52ae5a898e4a998b60d1e6c01328e5",
    "torchscript": "668fc175d9b4edca19c3352cd216862f0edc7968edfec1ebb3cf4e4b61e36ff3",
}
"""The convert stage of each source: tflite (no args but its format), a Hugging Face folder
(task from config.json), TorchScript with an example input."""
GOLDEN_STAGE_CACHE_KEYS = {
    ("tflite", "CPU"): "26b510ba8b72a7753515688a837865d51a41f41b9353845eaefbddef4159a6d0",
    ("huggingface", "NPU.4000"): "fc4bd346edc7c97631091062191a3daa9d0ad6a4fcc8f08ca499860b82fc5a70",
}


@pytest.fixture(scope="module")
def source_paths(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("golden-sources")
    (folder / "golden.tflite").write_bytes(TFLITE)
    hf = folder / "hf"
    hf.mkdir()
    (hf / "config.json").write_bytes(HF_CONFIG)
    (hf / "model.safetensors").write_bytes(HF_WEIGHTS)
    script = folder / "golden.pt"
    with zipfile.ZipFile(script, "w") as archive:  # the layout torch.jit.save writes
        for name in ("golden/code/__torch__.py", "golden/constants.pkl", "golden/data.pkl"):
            info = zipfile.ZipInfo(name, date_time=(2026, 1, 1, 0, 0, 0))
            archive.writestr(info, name.encode())
    return {"tflite": folder / "golden.tflite", "huggingface": hf, "torchscript": script}


def _source_key_parts(path: Path) -> tuple[ModelRef, sources.Source]:
    source = sources.detect(path)
    examples = ["x[1,3,8,8]:f32"] if source.format == "torchscript" else []
    ref = ModelRef.from_source(path).with_recipe(stages.recipe_for(source, examples))
    return ref, source


def test_the_stage_vectors_are_for_the_current_stage_version():
    assert stages.STAGE_KEY_VERSION == STAGE_VERSION, BUMP_STAGE


@pytest.mark.parametrize("kind", list(GOLDEN_STAGES))
def test_stage_key(source_paths, kind):
    ref, source = _source_key_parts(source_paths[kind])
    assert source.format == kind
    assert stages.stage_keys(ref.identity, ref.recipe) == [GOLDEN_STAGES[kind]], BUMP_STAGE


@pytest.mark.parametrize(
    ("kind", "target"),
    list(GOLDEN_STAGE_CACHE_KEYS),
    ids=[f"{k}-{t}" for k, t in GOLDEN_STAGE_CACHE_KEYS],
)
def test_cache_key_of_a_converted_source(source_paths, kind, target):
    ref, _ = _source_key_parts(source_paths[kind])
    key = key_for(ref.identity, SPECS[target], TOOLCHAIN, ref.recipe)
    assert ref.key_model == {"stage": GOLDEN_STAGES[kind]}
    assert key == GOLDEN_STAGE_CACHE_KEYS[kind, target], BUMP_STAGE


def test_ir_and_onnx_keys_have_no_stage(models):
    """No recipe: the key's model part is the identity, as before stages existed."""
    for path in models.values():
        ref = ModelRef.from_source(path)
        assert ref.key_model == ref.identity == ModelRef.from_path(path).identity
