"""A blob stored in S3 gets part digests after its job succeeds: hashed from the bytes the
worker stored, signed by its key, answered by the API beside the manifest, and re-signed (and
hashed again from the stored object) by `farm keys resign`. Real PostgreSQL, SeaweedFS and API;
the farm compiles embedded, as a one-host farm on those services does."""

from __future__ import annotations

import fcntl
import hashlib
import os

import httpx
import pytest
from sqlalchemy import create_engine, text

from farm.core.signing import Manifest, Parts, TrustedKeys, create_key_pair
from farm.server.db.session import upgrade_database
from tests import models
from tests.integration.served import ApiServer
from tests.integration.test_edge import ok_json, run_farm
from tests.integration.test_gc import s3_env

PART = 1 << 20


@pytest.fixture
def s3_farm(tmp_path, postgres_url, s3_store):
    """A farm on PostgreSQL and S3 whose blobs are hashed in 1 MiB parts, one 16 MB blob in
    it, and its API."""
    key = tmp_path / "keys" / "signing.pem"
    public, _ = create_key_pair(key)
    env = {
        "FARM_HOME": str(tmp_path / "home"),
        **s3_env(postgres_url, s3_store),
        "FARM_SIGNING_KEY": str(key),
        "FARM_TRUSTED_KEYS": str(public),
        "FARM_BLOB_PART_BYTES": str(PART),
    }
    upgrade_database(postgres_url)
    xml = models.save_ir(models.large_net(16), tmp_path / "model" / "big.xml")
    submitted = ok_json(env, "submit", str(xml), "-d", "CPU")
    assert submitted["job"]["state"] == "succeeded"
    token = ok_json(env, "token", "create", "--name", "edge", "--role", "pull")["token"]
    api = ApiServer(env, tmp_path / "api.log").start()
    yield env, api, token, submitted["cache_key"], public, xml
    api.stop()


def resolved(api, token: str, key: str) -> dict:
    with httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {token}"}) as client:
        response = client.get(f"/v1/blobs/{key}")
        assert response.status_code == 200, response.text
        return response.json()


def stored_parts(s3_store, key: str, tmp_path) -> tuple[str, ...]:
    stored = tmp_path / "stored.blob"
    s3_store.get_file(f"blobs/{key}.blob", stored)
    data = stored.read_bytes()
    return tuple(
        hashlib.sha256(data[at : at + PART]).hexdigest() for at in range(0, len(data), PART)
    )


def test_a_blob_in_s3_gets_signed_part_digests_of_its_stored_bytes(s3_farm, s3_store, tmp_path):
    env, api, token, key, public, _ = s3_farm
    record = resolved(api, token, key)
    expected = stored_parts(s3_store, key, tmp_path)
    assert len(expected) == -(-record["size_bytes"] // PART) > 2
    assert record["part_bytes"] == PART and tuple(record["part_sha256s"]) == expected
    manifest = Manifest.from_record(record)
    trusted = TrustedKeys.from_files([public])
    assert trusted.verified_parts(record, manifest) == Parts(PART, expected)

    # A new key: resign hashes the stored object's parts again and signs them with it.
    new_key = tmp_path / "new" / "signing.pem"
    new_public, new_id = create_key_pair(new_key)
    operator = {**env, "FARM_SIGNING_KEY": str(new_key)}
    result = run_farm(operator, "keys", "resign", "--json")
    assert result.returncode == 0, result.stderr
    again = resolved(api, token, key)
    assert (
        again["signing_key_id"] == new_id and again["parts_signature"] != record["parts_signature"]
    )
    assert TrustedKeys.from_files([new_public]).verified_parts(again, manifest) == Parts(
        PART, expected
    )
    assert trusted.verified_parts(again, manifest) is None  # the old key no longer vouches


def edge_env(api, token: str, public, tmp_path) -> dict[str, str]:
    return {
        "FARM_API_URL": api.url,
        "FARM_TOKEN": token,
        "FARM_TRUSTED_KEYS": str(public),
        "FARM_CACHE_DIR": str(tmp_path / "edge-cache"),
        "FARM_HOME": str(tmp_path / "edge-home"),
    }


def corrupt_part(s3_store, key: str, part: int, tmp_path) -> None:
    stored = tmp_path / "to-corrupt.blob"
    s3_store.get_file(f"blobs/{key}.blob", stored)
    data = bytearray(stored.read_bytes())
    data[part * PART + 100] ^= 0xFF
    stored.write_bytes(bytes(data))
    s3_store.delete(f"blobs/{key}.blob")
    s3_store.put_file(f"blobs/{key}.blob", stored)


def test_an_edge_downloads_the_signed_parts_and_refuses_a_part_that_differs(
    s3_farm, s3_store, postgres_url, tmp_path
):
    _env, api, token, key, public, _xml = s3_farm
    edge = edge_env(api, token, public, tmp_path)
    out = tmp_path / "pulled.blob"
    pulled = ok_json(edge, "pull", key, "-o", str(out), "--format", "cache-entry")
    assert pulled["downloaded"] is True
    stored = tmp_path / "stored.blob"
    s3_store.get_file(f"blobs/{key}.blob", stored)
    assert out.read_bytes() == stored.read_bytes()

    # Bytes changed in storage: the part that holds them is refused, by name, and nothing of
    # the download is kept (another edge, with an empty cache).
    corrupt_part(s3_store, key, 5, tmp_path)
    other = edge_env(api, token, public, tmp_path / "other")
    refused = run_farm(other, "pull", key, "--import")
    assert refused.returncode == 5, refused.stderr
    assert "part 5" in refused.stderr and "not imported" in refused.stderr
    cache = tmp_path / "other" / "edge-cache" / "blobs"
    assert list(cache.glob("*.blob")) == [] and list((cache / "partial").iterdir()) == []

    # Parts no trusted key vouches for: the edge takes one stream and checks the whole file.
    engine = create_engine(postgres_url)
    with engine.begin() as connection:
        connection.execute(
            text("UPDATE blobs SET parts_signature = :forged WHERE cache_key = :key"),
            {"forged": "A" * 88, "key": key},
        )
    engine.dispose()
    refused = run_farm(other, "pull", key, "--import")
    assert refused.returncode == 5, refused.stderr
    assert "part" not in refused.stderr and "sha256" in refused.stderr


def test_a_second_pull_of_the_same_blob_takes_the_one_stream_while_the_parts_are_locked(
    s3_farm, s3_store, tmp_path
):
    _env, api, token, key, public, _xml = s3_farm
    edge = edge_env(api, token, public, tmp_path)
    partial = tmp_path / "edge-cache" / "blobs" / "partial"
    partial.mkdir(parents=True, mode=0o700)
    # Another process is downloading this blob's parts: it holds their file's lock.
    held = os.open(partial / f"{key}.parts", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(held, fcntl.LOCK_EX)
    try:
        out = tmp_path / "pulled.blob"
        pulled = ok_json(edge, "pull", key, "-o", str(out), "--format", "cache-entry")
        assert (partial / f"{key}.parts").exists()  # left to its owner, never written
        assert os.fstat(held).st_size == 0
    finally:
        os.close(held)
    assert pulled["downloaded"] is True
    stored = tmp_path / "stored.blob"
    s3_store.get_file(f"blobs/{key}.blob", stored)
    assert out.read_bytes() == stored.read_bytes()
