"""`farm gc`: blobs unpulled for N days leave the database and the store together, on SQLite with
a local store and on PostgreSQL with SeaweedFS; a store that fails halfway leaves only an
invisible object, which the next run deletes."""

from __future__ import annotations

import httpx
import pytest
from sqlalchemy import func, select

from farm.server.db.models import Blob, BlobDeletion, Pull
from tests import models
from tests.conftest import S3_CREDENTIALS, S3_ENDPOINT_URL
from tests.integration.admin_farm import AdminFarm, admin_farm, farm_cli


@pytest.fixture(params=["sqlite+local", "postgres+s3"])
def farm_env(request, tmp_path) -> dict[str, str]:
    if request.param == "sqlite+local":
        return {
            "FARM_DATABASE_URL": request.getfixturevalue("sqlite_url"),
            "FARM_STORAGE_URL": str(tmp_path / "store"),
        }
    return s3_env(request.getfixturevalue("postgres_url"), request.getfixturevalue("s3_store"))


def s3_env(database_url: str, store, secret: str = S3_CREDENTIALS["secret_access_key"]):
    return {
        "FARM_DATABASE_URL": database_url,
        "FARM_STORAGE_URL": f"s3://{store.bucket}/{store.settings.prefix}",
        "FARM_S3_ENDPOINT_URL": S3_ENDPOINT_URL,
        "FARM_S3_ACCESS_KEY_ID": S3_CREDENTIALS["access_key_id"],
        "FARM_S3_SECRET_ACCESS_KEY": secret,
    }


def stored_blob_keys(farm: AdminFarm) -> set[str]:
    """Cache keys of the blob objects in the store, listed from the store itself."""
    from farm.server.storage import open_store
    from farm.server.storage.s3 import S3Store

    store = open_store(farm.env["FARM_STORAGE_URL"], farm.settings)
    if isinstance(store, S3Store):
        prefix = f"{store.settings.prefix}blobs/"
        listed = store.client.list_objects_v2(Bucket=store.bucket, Prefix=prefix)
        names = [item["Key"].removeprefix(prefix) for item in listed.get("Contents", [])]
    else:
        names = [path.name for path in (store.root / "blobs").glob("*.blob")]
    return {name.removesuffix(".blob") for name in names}


def blob_rows(farm: AdminFarm) -> set[str]:
    with farm.sessions() as session:
        return set(session.scalars(select(Blob.cache_key)))


def deletions(farm: AdminFarm) -> list[tuple[str, str]]:
    with farm.sessions() as session:
        rows = session.execute(select(BlobDeletion.cache_key, BlobDeletion.state))
        return sorted(tuple(row) for row in rows)


def test_gc_deletes_unpulled_blobs_from_database_and_store(farm_env, tmp_path):
    with admin_farm(farm_env, tmp_path) as farm:
        results = farm.submit(
            models.conv_net(), "conv", "-d", "CPU", "--batch", "1,2", "--layout", "x:NCHW"
        )
        used, unused = (r["cache_key"] for r in results)
        assert farm.pull(used, "edge-1")["ok"]
        farm.age(Blob, Blob.cache_key.in_([used, unused]), 10)  # both old; only one pulled
        assert stored_blob_keys(farm) == blob_rows(farm) == {used, unused}

        dry = farm.gc("--unpulled-days", "7", "--dry-run")
        assert [b["cache_key"] for b in dry["blobs"]] == [unused] and dry["dry_run"]
        assert stored_blob_keys(farm) == blob_rows(farm) == {used, unused}
        assert deletions(farm) == []

        report = farm.gc("--unpulled-days", "7")
        assert [b["cache_key"] for b in report["blobs"]] == [unused]
        assert report["objects_deleted"] == 1 and report["errors"] == []
        assert stored_blob_keys(farm) == blob_rows(farm) == {used}
        assert deletions(farm) == [(unused, "deleted")]
        with farm.sessions() as session:
            assert session.scalar(select(func.count()).select_from(Pull)) == 1

        again = farm.gc("--unpulled-days", "7")
        assert again["blobs"] == [] and again["objects_deleted"] == 0


def test_a_store_failing_halfway_leaves_no_row_without_its_object(postgres_url, s3_store, tmp_path):
    with admin_farm(s3_env(postgres_url, s3_store), tmp_path) as farm:
        (result,) = farm.submit(models.conv_net(), "conv", "-d", "CPU")
        key = result["cache_key"]
        farm.age(Blob, Blob.cache_key == key, 30)

        # The store refuses the deletion (wrong secret): the row is gone, the object stays,
        # recorded as pending, and gc says so with exit code 5.
        broken = {**farm.env, "FARM_S3_SECRET_ACCESS_KEY": "wrong"}
        report = farm_cli(broken, "gc", "--unpulled-days", "7", expect=5)
        assert report["pending"] == [key] and f"blobs/{key}.blob" in report["errors"][0]
        assert blob_rows(farm) == set() and stored_blob_keys(farm) == {key}
        assert deletions(farm) == [(key, "pending")]
        headers = {"Authorization": f"Bearer {farm.tokens['pull']}"}
        assert httpx.get(f"{farm.api.url}/v1/blobs/{key}", headers=headers).status_code == 404

        listed = farm.gc("--unpulled-days", "7", "--dry-run")
        assert listed["blobs"] == [] and listed["pending"] == [key]

        finished = farm.gc("--unpulled-days", "7")
        assert finished["objects_deleted"] == 1 and finished["pending"] == []
        assert stored_blob_keys(farm) == blob_rows(farm) == set()
        assert deletions(farm) == [(key, "deleted")]
