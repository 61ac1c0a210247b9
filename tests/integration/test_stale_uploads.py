"""The reconciler aborts multipart uploads left idle, never one still receiving parts, however
long ago it began (SeaweedFS: an 80 MiB upload at 1 MiB/s used to get NoSuchUpload at its end
when it outlived FARM_MAX_RUN_SECONDS)."""

from __future__ import annotations

import time
from datetime import timedelta

from farm.core.config import Settings
from farm.server.context import FarmContext
from farm.server.jobs.reconcile import reconcile

IDLE = 4
"""Seconds the uploads wait; S3 times are whole seconds, so the threshold is half of it."""


def begin(store, name: str) -> tuple[str, str]:
    key = store._key(f"models/{name}")
    return key, store.client.create_multipart_upload(Bucket=store.bucket, Key=key)["UploadId"]


def send_part(store, upload: tuple[str, str], number: int) -> None:
    key, upload_id = upload
    store.client.upload_part(
        Bucket=store.bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=b"p" * 1024
    )


def unfinished(store) -> set[str]:
    listed = store.client.list_multipart_uploads(Bucket=store.bucket, Prefix=store.settings.prefix)
    return {upload["UploadId"] for upload in listed.get("Uploads", [])}


def test_an_upload_still_receiving_parts_survives_however_long_ago_it_began(s3_store):
    active, idle, empty = (begin(s3_store, name) for name in ("active", "idle", "empty"))
    send_part(s3_store, active, 1)
    send_part(s3_store, idle, 1)
    time.sleep(IDLE)
    send_part(s3_store, active, 2)  # began IDLE s ago, and its last part is from just now

    aborted = s3_store.abort_stale_uploads(timedelta(seconds=IDLE / 2))

    assert sorted(aborted) == sorted([idle[0], empty[0]])
    assert unfinished(s3_store) == {active[1]}
    assert s3_store.abort_stale_uploads(timedelta(seconds=IDLE / 2)) == []
    s3_store.client.abort_multipart_upload(
        Bucket=s3_store.bucket, Key=active[0], UploadId=active[1]
    )


def test_the_reconciler_judges_uploads_by_their_own_setting_not_the_run_limit(s3_store, tmp_path):
    farm = FarmContext.open(Settings(home=tmp_path / "farm"))
    upload = begin(s3_store, "slow")
    send_part(s3_store, upload, 1)
    time.sleep(IDLE)
    send_part(s3_store, upload, 2)
    # Past FARM_MAX_RUN_SECONDS since it began, well within FARM_STALE_UPLOAD_SECONDS of its
    # last part: it goes on.
    short_runs = Settings(home=tmp_path / "farm", max_run_seconds=1, stale_upload_seconds=IDLE // 2)
    with farm.session() as session:
        assert reconcile(session, s3_store, short_runs, None).aborted_uploads == []
    assert unfinished(s3_store) == {upload[1]}
    time.sleep(IDLE)  # then it goes idle: aborted, however long a compile may run
    long_runs = Settings(
        home=tmp_path / "farm", max_run_seconds=3600, stale_upload_seconds=IDLE // 2
    )
    with farm.session() as session:
        assert reconcile(session, s3_store, long_runs, None).aborted_uploads == [upload[0]]
    assert unfinished(s3_store) == set()
    farm.sessions.kw["bind"].dispose()
