"""`farm keys resign`: after a signing key is retired, or for blobs recorded before manifests
were signed, every stored blob that can be shown genuine is signed again with the current key,
and an edge that trusts only that key imports it; a blob whose stored bytes are corrupt, whose
row was edited, or whose old signature no trusted key verifies, is not signed and is named."""

from __future__ import annotations

import json
import sqlite3

import pytest

from farm.core.signing import Signer, TrustedKeys, create_key_pair
from farm.server.db.session import upgrade_database
from tests import models
from tests.conftest import S3_CREDENTIALS, S3_ENDPOINT_URL
from tests.integration.test_edge import edge_farm, ok_json, run_farm  # noqa: F401


def flip_a_byte(path) -> None:
    path.chmod(0o644)
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    path.write_bytes(bytes(data))


def set_row(farm, key: str, **columns) -> None:
    assignments = ", ".join(f"{name} = ?" for name in columns)
    with sqlite3.connect(farm.home / "farm.db") as connection:
        connection.execute(
            f"UPDATE blobs SET {assignments} WHERE cache_key = ?", (*columns.values(), key)
        )


def test_resign_after_retiring_a_key_lets_edges_trusting_only_the_new_key_import(
    edge_farm,  # noqa: F811
    tmp_path,
):
    key_a = edge_farm.key
    xml_b = models.save_ir(models.conv_net(seed=3), tmp_path / "b" / "b.xml")
    key_b = ok_json(edge_farm.farm_env, "submit", str(xml_b), "-d", "CPU")["cache_key"]
    old_public = edge_farm.home / "keys" / "signing.pem.pub"
    old_id = Signer.from_file(edge_farm.home / "keys" / "signing.pem").key_id
    flip_a_byte(edge_farm.home / "store" / "blobs" / f"{key_b}.blob")

    new_key = tmp_path / "new" / "signing.pem"
    new_id = ok_json(edge_farm.farm_env, "keys", "create", "--path", str(new_key))["key_id"]
    new_edge = {**edge_farm.edge_env(), "FARM_TRUSTED_KEYS": f"{new_key}.pub"}
    retired = run_farm(new_edge, "pull", key_a)
    assert retired.returncode == 8 and f"signed by key {old_id}" in retired.stderr

    operator = {
        **edge_farm.farm_env,
        "FARM_SIGNING_KEY": str(new_key),
        "FARM_TRUSTED_KEYS": str(old_public),  # the old signatures are checked first
    }
    result = run_farm(operator, "keys", "resign", "--json")
    assert result.returncode == 5, result.stderr
    report = json.loads(result.stdout)
    (failure,) = report.pop("failures")
    assert report == {"key_id": new_id, "resigned": 1, "skipped": 0, "failed": 1}
    assert failure["cache_key"] == key_b and failure["kind"] == "integrity"
    assert failure["reason"].startswith("it is corrupt in storage: blobs/")
    assert failure["reason"].endswith("not re-signed")

    rows = edge_farm.sql("SELECT cache_key, signing_key_id, sha256, signature FROM blobs")
    assert [row[:2] for row in rows] == [(key_a, new_id), (key_b, old_id)]
    # The v1 signature moved to the new key too, for edges older than manifests.
    cache_key, _, sha256, signature = rows[0]
    TrustedKeys.from_files([f"{new_key}.pub"]).verify(cache_key, sha256, new_id, signature)

    _api_signs_statuses_with(edge_farm, new_key)  # rotation step 3: the API's key too
    pulled = ok_json(new_edge, "pull", key_a, "--import")
    assert pulled["downloaded"] is True and pulled["import_seconds"] > 0
    corrupt = run_farm(new_edge, "pull", key_b)
    assert corrupt.returncode == 8 and f"signed by key {old_id}" in corrupt.stderr

    again = run_farm(operator, "keys", "resign")  # nothing new: cheap, and says so
    assert again.returncode == 5
    assert again.stdout.startswith(
        f"re-signed 0 blob(s) with key {new_id}; skipped 1 (already signed by it); failed 1"
    )
    assert f"{key_b}  it is corrupt in storage" in again.stderr
    assert again.stderr.splitlines()[-1] == (
        "farm: error: 1 blob(s) not re-signed (each named with its reason above)"
    )


def test_resign_signs_only_what_it_can_show_is_genuine(edge_farm, tmp_path):  # noqa: F811
    key = edge_farm.key
    farm_id = Signer.from_file(edge_farm.home / "keys" / "signing.pem").key_id
    edge = edge_farm.edge_env()

    # Recorded before manifests were signed: only the v1 signature. Edges refuse it; the farm's
    # own key (trusted by the farm) verifies the v1 signature and signs the manifest.
    (manifest_signature,) = edge_farm.sql("SELECT manifest_signature FROM blobs")[0]
    set_row(edge_farm, key, manifest_signature=None)
    v1_only = run_farm(edge, "pull", key)
    assert v1_only.returncode == 8 and "farm keys resign" in v1_only.stderr
    upgraded = ok_json(edge_farm.farm_env, "keys", "resign")
    assert upgraded == {
        "key_id": farm_id,
        "resigned": 1,
        "skipped": 0,
        "failed": 0,
        "failures": [],
    }
    assert edge_farm.sql("SELECT manifest_signature FROM blobs") == [(manifest_signature,)]
    assert ok_json(edge, "pull", key)["downloaded"] is True

    # A new key, and an operator who does not say to trust the old one: nothing is signed.
    new_key = tmp_path / "new" / "signing.pem"
    create_key_pair(new_key)
    operator = {**edge_farm.farm_env, "FARM_SIGNING_KEY": str(new_key)}
    untrusted = run_farm(operator, "keys", "resign", "--json")
    assert untrusted.returncode == 8
    (failure,) = json.loads(untrusted.stdout)["failures"]
    assert f"signed by key {farm_id}, which this machine does not trust" in failure["reason"]
    assert "pass --accept-unverified" in failure["reason"]

    # A row edited after it was recorded (another CPU's runtime requirements): its fields no
    # longer hash to its key, and it is not signed even when the operator vouches for it.
    (toolchain,) = edge_farm.sql("SELECT toolchain FROM blobs")[0]
    edited = {**json.loads(toolchain), "runtime_requirements": "isa=Intel AMX"}
    set_row(edge_farm, key, toolchain=json.dumps(edited))
    tampered = run_farm(operator, "keys", "resign", "--accept-unverified", "--json")
    assert tampered.returncode == 5
    (failure,) = json.loads(tampered.stdout)["failures"]
    assert "not to its cache key: the row was changed after it was recorded" in failure["reason"]
    assert edge_farm.sql("SELECT signing_key_id FROM blobs") == [(farm_id,)]

    set_row(edge_farm, key, toolchain=toolchain)
    vouched = ok_json(operator, "keys", "resign", "--accept-unverified")
    assert vouched["resigned"] == 1 and vouched["failed"] == 0
    new_edge = {**edge, "FARM_TRUSTED_KEYS": f"{new_key}.pub", "FARM_CACHE_DIR": str(tmp_path)}
    _api_signs_statuses_with(edge_farm, new_key)
    assert ok_json(new_edge, "pull", key, "--import")["downloaded"] is True


def _api_signs_statuses_with(farm, key) -> None:
    """Restart the farm's API on the new key: it signs blob statuses with FARM_SIGNING_KEY
    (SECURITY.md, key rotation); edges that trust only the new key need statuses it signed."""
    farm.api.stop()
    farm.api.env = {**farm.api.env, "FARM_SIGNING_KEY": str(key)}
    farm.api.start()


@pytest.mark.postgres
def test_resign_streams_blobs_from_s3_and_names_corrupt_and_missing_ones(
    tmp_path, postgres_url, s3_url, s3_store
):
    old_key, new_key = tmp_path / "old" / "signing.pem", tmp_path / "new" / "signing.pem"
    old_public, old_id = create_key_pair(old_key)
    _, new_id = create_key_pair(new_key)
    farm = {
        "FARM_HOME": str(tmp_path / "home"),
        "FARM_DATABASE_URL": postgres_url,
        "FARM_STORAGE_URL": s3_url,
        "FARM_S3_ENDPOINT_URL": S3_ENDPOINT_URL,
        "FARM_S3_ACCESS_KEY_ID": S3_CREDENTIALS["access_key_id"],
        "FARM_S3_SECRET_ACCESS_KEY": S3_CREDENTIALS["secret_access_key"],
        "FARM_SIGNING_KEY": str(old_key),
    }
    upgrade_database(postgres_url)
    keys = []
    for seed in (0, 3, 5):  # compiled here, stored in S3, recorded in PostgreSQL
        xml = models.save_ir(models.conv_net(seed=seed), tmp_path / f"m{seed}" / "m.xml")
        keys.append(ok_json(farm, "submit", str(xml), "-d", "CPU")["cache_key"])
    good, corrupt, missing = keys
    corrupted = tmp_path / "corrupt.blob"
    s3_store.get_file(f"blobs/{corrupt}.blob", corrupted)
    flip_a_byte(corrupted)
    s3_store.delete(f"blobs/{corrupt}.blob")
    s3_store.put_file(f"blobs/{corrupt}.blob", corrupted)
    s3_store.delete(f"blobs/{missing}.blob")

    operator = {**farm, "FARM_SIGNING_KEY": str(new_key), "FARM_TRUSTED_KEYS": str(old_public)}
    result = run_farm(operator, "keys", "resign", "--json")
    assert result.returncode == 5, result.stderr
    report = json.loads(result.stdout)
    failures = {f["cache_key"]: f for f in report.pop("failures")}
    assert report == {"key_id": new_id, "resigned": 1, "skipped": 0, "failed": 2}
    assert set(failures) == {corrupt, missing}
    assert failures[corrupt]["reason"].startswith("it is corrupt in storage")
    assert failures[corrupt]["kind"] == "integrity"
    assert failures[missing]["kind"] == "infrastructure"
    assert f"blobs/{missing}.blob" in failures[missing]["reason"]

    shown = ok_json(farm, "blobs")
    signers = {blob["cache_key"]: blob["signing_key_id"] for blob in shown}
    assert signers == {good: new_id, corrupt: old_id, missing: old_id}
