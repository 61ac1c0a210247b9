"""Signed blobs: workers sign each blob's manifest (and, for older edges, (cache key, sha256))
with Ed25519; edges refuse a blob that is unsigned, signed by a key they do not trust, whose
signature belongs to another manifest, or that carries only a v1 signature; keys rotate by
trusting several; `farm keys` creates and shows them."""

from __future__ import annotations

import sqlite3

import pytest

from farm.core.signing import Manifest, SignatureError, Signer, TrustedKeys, create_key_pair
from tests.integration.test_edge import edge_farm, ok_json, run_farm  # noqa: F401

KEY, SHA = "a" * 64, "b" * 64


def test_a_signature_binds_the_cache_key_and_the_bytes(tmp_path):
    public, key_id = create_key_pair(tmp_path / "k.pem")
    signer = Signer.from_file(tmp_path / "k.pem")
    assert signer.key_id == key_id
    signature = signer.sign(KEY, SHA)
    trusted = TrustedKeys.from_files([public])
    trusted.verify(KEY, SHA, key_id, signature)
    with pytest.raises(SignatureError, match="invalid signature"):
        trusted.verify("c" * 64, SHA, key_id, signature)  # moved to another blob
    with pytest.raises(SignatureError, match="invalid signature"):
        trusted.verify(KEY, "d" * 64, key_id, signature)  # other bytes
    with pytest.raises(SignatureError, match="not signed"):
        trusted.verify(KEY, SHA, None, None)
    with pytest.raises(SignatureError, match="does not trust"):
        TrustedKeys.from_files([]).verify(KEY, SHA, key_id, signature)
    assert (tmp_path / "k.pem").stat().st_mode & 0o777 == 0o600
    with pytest.raises(FileExistsError):
        create_key_pair(tmp_path / "k.pem")  # never overwritten


def assert_refused(result, message: str) -> None:
    """The edge refused the blob for exactly this reason: exit 8 (untrusted), that one-line
    error."""
    assert result.returncode == 8, result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.rstrip("\n").endswith(f": {message}"), result.stderr


def set_blob(edge_farm, **columns) -> None:  # noqa: F811
    assignments = ", ".join(f"{name} = ?" for name in columns)
    with sqlite3.connect(edge_farm.home / "farm.db") as connection:
        connection.execute(f"UPDATE blobs SET {assignments}", tuple(columns.values()))


def test_the_edge_refuses_unsigned_untrusted_and_forged_blobs(edge_farm):  # noqa: F811
    env = edge_farm.edge_env()
    key = edge_farm.key
    (signature, manifest_signature, key_id), *_ = edge_farm.sql(
        "SELECT signature, manifest_signature, signing_key_id FROM blobs"
    )
    untrusting = {**env, "FARM_TRUSTED_KEYS": ""}
    refused = run_farm(untrusting, "pull", key)
    assert_refused(
        refused,
        f"blob {key} is signed by key {key_id}, which this machine does not trust "
        "(trusted: none; FARM_TRUSTED_KEYS)",
    )

    set_blob(edge_farm, signature=None, manifest_signature=None, signing_key_id=None)
    unsigned = run_farm(env, "pull", key)
    assert_refused(unsigned, f"blob {key} is not signed; refusing to import it")
    allowed = ok_json({**env, "FARM_ALLOW_UNSIGNED": "1"}, "pull", edge_farm.key)
    assert allowed["downloaded"] is True

    # A genuine signature of the trusted key, over another manifest.
    other = Manifest(KEY, SHA, 1, 0, "CPU", {"openvino": "2026.4.1"}, False, {"onnx": SHA})
    forgery = Signer.from_file(edge_farm.home / "keys" / "signing.pem").sign_manifest(other)
    set_blob(edge_farm, signature=signature, manifest_signature=forgery, signing_key_id=key_id)
    forged = run_farm(env, "pull", key)
    assert_refused(forged, f"blob {key} has an invalid signature from key {key_id}; refusing it")
    # Only the v1 signature (a record stripped of its manifest signature): never accepted.
    set_blob(edge_farm, signature=signature, manifest_signature=None, signing_key_id=key_id)
    v1_only = run_farm(env, "pull", key)
    assert_refused(
        v1_only,
        f"blob {key} carries only a v1 signature, over its cache key and sha256, which leaves "
        "its target, toolchain, size and model digests unsigned; refusing it. The farm's "
        "operator signs its manifest with `farm keys resign`",
    )
    set_blob(
        edge_farm, signature=signature, manifest_signature=manifest_signature, signing_key_id=key_id
    )
    assert ok_json(env, "pull", edge_farm.key)["signing_key_id"] == key_id
    for result in (refused, unsigned, forged, v1_only):
        assert "Traceback" not in result.stderr


def test_keys_rotate_and_farm_keys_creates_and_shows_them(edge_farm, tmp_path):  # noqa: F811
    old_public = edge_farm.home / "keys" / "signing.pem.pub"
    new_key = tmp_path / "rotated" / "signing.pem"
    created = ok_json(edge_farm.farm_env, "keys", "create", "--path", str(new_key))
    assert created["public_key"] == f"{new_key}.pub"
    again = run_farm(edge_farm.farm_env, "keys", "create", "--path", str(new_key))
    assert again.returncode == 2 and "never overwritten" in again.stderr

    # Blobs compiled from now on are signed with the new key; edges trust both during rotation.
    rotated = {**edge_farm.farm_env, "FARM_SIGNING_KEY": str(new_key)}
    xml = edge_farm.xml.with_name("conv.xml")
    new_blob = ok_json(rotated, "submit", str(xml), "-d", "CPU", "--shape", "x[1,3,32,32]")
    (signer_id,) = edge_farm.sql(
        "SELECT signing_key_id FROM blobs WHERE cache_key = ?", new_blob["cache_key"]
    )[0]
    assert signer_id == created["key_id"]

    both = {**edge_farm.edge_env(), "FARM_TRUSTED_KEYS": f"{old_public},{new_key}.pub"}
    assert ok_json(both, "pull", edge_farm.key)["downloaded"] is True
    assert ok_json(both, "pull", new_blob["cache_key"])["downloaded"] is True
    only_old = {**edge_farm.edge_env(), "FARM_CACHE_DIR": str(tmp_path / "other-cache")}
    (old_id,) = edge_farm.sql(
        "SELECT signing_key_id FROM blobs WHERE cache_key = ?", edge_farm.key
    )[0]
    assert_refused(
        run_farm(only_old, "pull", new_blob["cache_key"]),
        f"blob {new_blob['cache_key']} is signed by key {created['key_id']}, which this machine "
        f"does not trust (trusted: {old_id}; FARM_TRUSTED_KEYS)",
    )

    shown = ok_json({**rotated, "FARM_TRUSTED_KEYS": f"{new_key}.pub"}, "keys", "show")
    assert shown["signing_key"]["key_id"] == created["key_id"]
    assert shown["trusted_keys"] == {created["key_id"]: f"{new_key}.pub"}
