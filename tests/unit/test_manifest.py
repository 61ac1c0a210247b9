"""The signed manifest (farm/core/signing.py) and the edge cache's binding of a blob to it
(farm/core/filecache.py): every field an edge acts on is signed, and a cached file that changed
in any way is no longer bound to the manifest it was verified against."""

from __future__ import annotations

import dataclasses
import os
import shutil

import pytest

from farm.core.filecache import BlobCache
from farm.core.signing import (
    Manifest,
    SignatureError,
    Signer,
    TrustedKeys,
    create_key_pair,
)

A, B = "a" * 64, "b" * 64
MANIFEST = Manifest(
    cache_key=A,
    sha256="1" * 64,
    size_bytes=12_288,
    payload_offset=4096,
    target="CPU",
    toolchain={"openvino": "2026.4.1", "runtime_requirements": "isa=AVX2", "npu_compiler": None},
    weightless=False,
    model={"xml": "2" * 64, "bin": "3" * 64},
)
OTHER_VALUES = {
    "cache_key": B,
    "sha256": "4" * 64,
    "size_bytes": 12_289,
    "payload_offset": 0,
    "target": "NPU.4000",
    "toolchain": {**MANIFEST.toolchain, "runtime_requirements": "isa=AMX"},
    "weightless": True,
    "model": {**MANIFEST.model, "bin": "5" * 64},
}


@pytest.fixture
def keys(tmp_path) -> tuple[Signer, TrustedKeys]:
    public, _ = create_key_pair(tmp_path / "k.pem")
    return Signer.from_file(tmp_path / "k.pem"), TrustedKeys.from_files([public])


def test_the_manifest_is_canonical_json_of_every_field_an_edge_acts_on():
    assert set(OTHER_VALUES) == set(Manifest.FIELDS)
    assert MANIFEST.message() == (
        b'farm-blob-manifest-v2\n{"cache_key":"' + A.encode() + b'","model":{"bin":"'
        + b"3" * 64 + b'","xml":"' + b"2" * 64 + b'"},"payload_offset":4096,"sha256":"'
        + b"1" * 64 + b'","size_bytes":12288,"target":"CPU","toolchain":{"npu_compiler":null,'
        b'"openvino":"2026.4.1","runtime_requirements":"isa=AVX2"},"v":2,"weightless":false}'
    )  # fmt: skip
    record = {**MANIFEST.fields(), "spec": {}, "signature": None, "created_at": "x"}
    assert Manifest.from_record(record) == MANIFEST  # extra fields of a record are not signed


@pytest.mark.parametrize("name", Manifest.FIELDS)
def test_a_signature_covers_each_field(keys, name):
    signer, trusted = keys
    signature = signer.sign_manifest(MANIFEST)
    trusted.verify_manifest(MANIFEST, signer.key_id, signature)
    changed = dataclasses.replace(MANIFEST, **{name: OTHER_VALUES[name]})
    with pytest.raises(SignatureError, match="invalid signature"):
        trusted.verify_manifest(changed, signer.key_id, signature)


def test_v1_and_v2_signatures_are_never_interchangeable(keys):
    signer, trusted = keys
    v1 = signer.sign(MANIFEST.cache_key, MANIFEST.sha256)
    with pytest.raises(SignatureError, match="invalid signature"):
        trusted.verify_manifest(MANIFEST, signer.key_id, v1)
    with pytest.raises(SignatureError, match=r"only a v1 signature.*farm keys resign"):
        trusted.verify_manifest(MANIFEST, signer.key_id, None, legacy_signature=v1)
    with pytest.raises(SignatureError, match="invalid signature"):
        trusted.verify(A, MANIFEST.sha256, signer.key_id, signer.sign_manifest(MANIFEST))
    with pytest.raises(SignatureError, match="malformed signature"):
        trusted.verify_manifest(MANIFEST, signer.key_id, 12)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("cache_key", "../" + "a" * 61),
        ("size_bytes", "12288"),
        ("size_bytes", True),
        ("payload_offset", -1),
        ("weightless", "false"),
        ("toolchain", {"openvino": 2026}),
        ("model", {"bin": "not a digest"}),
    ],
)
def test_a_malformed_record_is_refused_not_half_read(name, value):
    from farm.core.errors import IntegrityMismatch

    with pytest.raises(IntegrityMismatch, match=f"malformed \\({name}\\)"):
        Manifest.from_record({**MANIFEST.fields(), name: value})


def blob(tmp_path, name: str, data: bytes):
    path = tmp_path / name
    path.write_bytes(data)
    return path


def test_a_cached_blob_stays_bound_to_its_manifest_only_while_unchanged(tmp_path):
    cache = BlobCache(tmp_path / "cache")
    kept = {"manifest": MANIFEST.document(), "signing_key_id": "k", "manifest_signature": "s"}
    path = cache.put(A, blob(tmp_path, "a", b"A" * 1000), kept)
    assert cache.manifest(A) == kept
    for _ in range(3):
        assert cache.get(A) == path  # marking it used (LRU) never unbinds it
    assert cache.manifest(A) == kept

    # One byte rewritten in place, the size unchanged: unbound (the agent hashes it again).
    path.chmod(0o644)
    with open(path, "r+b") as handle:
        handle.write(b"B")
    assert cache.manifest(A) is None
    cache.bind(A, kept)  # the agent re-verified it
    assert cache.manifest(A) == kept
    path.chmod(0o444)  # a chmod alone changes the ctime
    assert cache.manifest(A) is None

    cache.put(B, blob(tmp_path, "b", b"B" * 1000), {"manifest": {"cache_key": B}})
    cache.bind(A, kept)
    shutil.copyfile(cache.path(B), path)  # another key's blob copied under A's name
    assert cache.manifest(A) is None
    cache.bind(A, kept)
    os.unlink(path)
    os.link(cache.path(B), path)  # or linked there
    assert cache.manifest(A) is None


def test_eviction_takes_the_manifest_with_the_blob_and_counts_its_use(tmp_path):
    cache = BlobCache(tmp_path / "cache", max_bytes=250)
    for age, key in enumerate((A, B)):
        cache.put(key, blob(tmp_path, key, b"x" * 100), {"n": age})
        os.utime(cache.manifest_path(key), (1000 + age, 1000 + age))
    assert cache.get(A) is not None  # A is now the most recent, by its manifest's mtime
    c = "c" * 64
    cache.put(c, blob(tmp_path, "c", b"x" * 100), {"n": 2})
    assert sorted(entry.cache_key for entry in cache.entries()) == [A, c]
    assert not cache.manifest_path(B).exists()
