"""A blob's part digests: hashed in any chunks, signed bound to the blob, and taken by an edge
only when a trusted key signed exactly them (else it checks the whole file)."""

from __future__ import annotations

import hashlib
import os

import pytest

from farm.core.signing import MIN_PART_BYTES, Manifest, Parts, Signer, TrustedKeys
from farm.server.blobs.parts import PartHasher, digest_parts

PART = MIN_PART_BYTES


def blob_bytes(size: int) -> bytes:
    return os.urandom(size)


def expected_parts(data: bytes, part_bytes: int) -> tuple[str, ...]:
    return tuple(
        hashlib.sha256(data[at : at + part_bytes]).hexdigest()
        for at in range(0, len(data), part_bytes)
    )


def manifest_of(data: bytes) -> Manifest:
    return Manifest(
        cache_key="a" * 64,
        sha256=hashlib.sha256(data).hexdigest(),
        size_bytes=len(data),
        payload_offset=0,
        target="CPU",
        toolchain={"openvino": "2026.4.1"},
        weightless=False,
        model={"xml": "b" * 64},
    )


@pytest.mark.parametrize("chunk", [4096, 1_000_003, PART - 1, PART, PART + 7, 10 * PART])
def test_parts_come_out_the_same_whatever_the_chunks(chunk):
    data = blob_bytes(2 * PART + 12345)
    hasher = PartHasher(PART)
    for at in range(0, len(data), chunk):
        hasher.update(data[at : at + chunk])
    parts = hasher.parts(hashlib.sha256(data).hexdigest())
    assert parts == Parts(PART, expected_parts(data, PART))
    assert len(parts.sha256s) == 3  # the last one short


def test_nothing_is_offered_for_other_bytes_or_a_single_part():
    data = blob_bytes(2 * PART)
    hasher = PartHasher(PART)
    hasher.update(data)
    assert hasher.parts("0" * 64) is None  # not the blob recorded
    single = PartHasher(PART)
    single.update(data[:PART])
    assert single.parts(hashlib.sha256(data[:PART]).hexdigest()) is None  # one connection will do


def test_a_file_is_hashed_into_parts_in_one_pass(tmp_path):
    data = blob_bytes(3 * PART + 1)
    path = tmp_path / "blob"
    path.write_bytes(data)
    parts = digest_parts(path, hashlib.sha256(data).hexdigest(), PART)
    assert parts == Parts(PART, expected_parts(data, PART))
    assert digest_parts(path, "f" * 64, PART) is None


def record_with(data: bytes, signer: Signer, parts: Parts, **changes) -> dict:
    manifest = manifest_of(data)
    signature = signer.sign_parts(manifest.cache_key, manifest.sha256, len(data), parts)
    return {
        "part_bytes": parts.part_bytes,
        "part_sha256s": list(parts.sha256s),
        "parts_signature": signature,
        "signing_key_id": signer.key_id,
        **changes,
    }


def test_an_edge_takes_the_parts_a_trusted_key_bound_to_the_blob():
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    signer = Signer(Ed25519PrivateKey.generate())
    trusted = TrustedKeys({}).with_key(signer.public_key)
    data = blob_bytes(2 * PART + 1)
    manifest = manifest_of(data)
    parts = Parts(PART, expected_parts(data, PART))
    record = record_with(data, signer, parts)
    assert trusted.verified_parts(record, manifest) == parts

    swapped = list(parts.sha256s)
    swapped[1] = "0" * 64
    # Each of these makes the edge check the whole file instead: never trusted, never fatal.
    refused = {
        "a digest changed": {**record, "part_sha256s": swapped},
        "parts of another size": {**record, "part_bytes": PART * 2},
        "no signature": {**record, "parts_signature": None},
        "too few digests": {**record, "part_sha256s": swapped[:2]},
        "not hex": {**record, "part_sha256s": ["x" * 64] * 3},
        "parts too small": {**record, "part_bytes": PART - 1},
        "no parts": {"signing_key_id": signer.key_id},
    }
    for why, changed in refused.items():
        assert trusted.verified_parts(changed, manifest) is None, why

    other = manifest_of(blob_bytes(2 * PART + 1))  # another blob's manifest, same size
    assert trusted.verified_parts(record, other) is None
    stranger = Signer(Ed25519PrivateKey.generate())
    assert TrustedKeys({}).with_key(stranger.public_key).verified_parts(record, manifest) is None
