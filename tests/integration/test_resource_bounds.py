"""No submitter may hurt the farm or another submitter (issue 14): a model that compiles to a
huge blob fails its own job and stores nothing; a model file corrupted in storage is removed by
the worker that finds it, reported missing and replaced with verified bytes; a flood of uploads
is turned away with Retry-After, and the client waits its turn. Real workers, API, PostgreSQL,
Redis and SeaweedFS."""

from __future__ import annotations

import hashlib
import os
import threading
import time

import httpx

from farm.client import FarmClient
from farm.core.hashing import model_files, sha256_file
from farm.server.db.models import Blob
from farm.server.jobs.sandbox import blob_limit_message
from farm.server.storage import blob_storage_key, model_storage_key
from farm.server.tokens import create_token
from tests import models
from tests.integration.served import ApiServer
from tests.integration.test_compile_child import broadcast_net


def unfinished_uploads(store) -> list[str]:
    listed = store.client.list_multipart_uploads(Bucket=store.bucket, Prefix=store.settings.prefix)
    return [upload["Key"] for upload in listed.get("Uploads", [])]


def test_a_model_that_compiles_to_a_huge_blob_fails_its_job_and_stores_nothing(served, tmp_path):
    # About 2 KB of IR whose constant becomes 240 MiB at compile time (the case: it
    # passed 4 x the model's bytes + 256 MiB): past the default limit, FARM_MAX_BLOB_RATIO (4)
    # x the model's bytes + FARM_BLOB_BYTES_OVER_MODEL (64 MiB).
    xml = models.save_ir(broadcast_net(60 * 2**20), tmp_path / "m" / "bc.xml")
    model_bytes = sum(path.stat().st_size for path in model_files(xml).values())
    assert model_bytes < 4096
    limit = 4 * model_bytes + 64 * 2**20
    served.start_worker("w1")
    submitted = served.farm_json("submit", str(xml), "-d", "CPU")

    job = served.wait_job(submitted["job"]["id"], timeout=180)
    assert job.state == "failed" and job.attempts == 1
    assert job.error == blob_limit_message(limit)
    assert f"size limit of {limit} bytes" in job.error and "FARM_MAX_BLOB_BYTES" in job.error
    log = served.farm_json("logs", str(job.id))["log"]
    assert f"failed: {blob_limit_message(limit)}" in log
    assert served.count(Blob) == 0
    assert not served.store.exists(blob_storage_key(job.cache_key))
    assert unfinished_uploads(served.store) == []  # not a byte of it went out
    assert served.workers["w1"].poll() is None


def test_a_model_file_corrupt_in_storage_is_reported_missing_and_replaced(served, api, tmp_path):
    xml = models.save_ir(models.conv_net(seed=14), tmp_path / "m" / "conv.xml")
    files = model_files(xml)
    digests = {role: sha256_file(path) for role, path in files.items()}
    # `farm submit` uploads the model and queues its job; no worker runs yet.
    first = served.farm_json("submit", str(xml), "-d", "CPU")
    assert first["job"]["state"] == "queued"
    # Someone with write access to the bucket flips one byte of the weights.
    store, key = served.store, served.store._key(model_storage_key(digests["bin"]))
    genuine = files["bin"].read_bytes()
    tampered = bytes([genuine[0] ^ 0xFF]) + genuine[1:]
    store.client.delete_object(Bucket=store.bucket, Key=key)
    store.client.put_object(
        Bucket=store.bucket, Key=key, Body=tampered, Metadata={"sha256": digests["bin"]}
    )
    client = FarmClient(api.url, api.tokens["submit"])
    assert client.missing(sorted(digests.values())) == []  # the farm cannot tell yet

    served.start_worker("w1")
    failed = served.wait_job(first["job"]["id"])
    assert failed.state == "failed" and failed.attempts == 1
    assert failed.error == (
        f"model file models/{digests['bin']} (the model's bin) was corrupt in storage (its "
        f"bytes have sha256 {hashlib.sha256(tampered).hexdigest()}); it was removed: submit "
        "the model again to upload it"
    )

    # The farm now reports the file missing, takes the genuine bytes, and compiles.
    assert client.missing(sorted(digests.values())) == [digests["bin"]]
    assert client.upload(digests["bin"], files["bin"]) == {"sha256": digests["bin"], "stored": True}
    assert client.missing(sorted(digests.values())) == []
    client.close()
    again = served.farm_json("submit", str(xml), "-d", "CPU", "--wait")
    assert again["job"]["state"] == "succeeded" and again["job"]["id"] != failed.id
    assert store.stat(model_storage_key(digests["bin"])).size == len(genuine)
    with store.open_read(model_storage_key(digests["bin"])) as body:
        assert hashlib.sha256(body.read()).hexdigest() == digests["bin"]
    assert [blob.job_id for blob in served.blobs()] == [again["job"]["id"]]


def test_uploads_past_the_bound_are_turned_away_and_the_client_waits_its_turn(served, tmp_path):
    # One token makes all three uploads: its own share (FARM_MAX_UPLOADS_PER_TOKEN) is not what
    # this test is about (tests/integration/test_limits.py is).
    env = {"FARM_MAX_CONCURRENT_UPLOADS": "2", "FARM_MAX_UPLOADS_PER_TOKEN": "0"}
    api = ApiServer({**served.env, **env}, tmp_path / "api.log")
    api.start()
    with served.sessions() as session:
        token = create_token(session, "uploader", "submit")
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/octet-stream"}
    blobs = [os.urandom(64 * 2**20) for _ in range(3)]
    digests = [hashlib.sha256(data).hexdigest() for data in blobs]
    release, started = threading.Event(), threading.Semaphore(0)
    answers: list[int] = []

    def slow_upload(data: bytes, sha256: str) -> None:
        def body():
            yield data[:1024]
            started.release()
            release.wait(60)
            yield data[1024:]

        with httpx.Client(timeout=120) as http:
            response = http.put(
                f"{api.url}/v1/models/{sha256}",
                content=body(),
                headers={**headers, "Content-Length": str(len(data))},
            )
        answers.append(response.status_code)

    try:
        holders = [
            threading.Thread(target=slow_upload, args=(blobs[i], digests[i])) for i in (0, 1)
        ]
        for thread in holders:
            thread.start()
        for _ in holders:
            assert started.acquire(timeout=30)
        time.sleep(0.5)  # both are in the route, holding the two slots

        turned_away = httpx.put(
            f"{api.url}/v1/models/{digests[2]}", content=blobs[2], headers=headers, timeout=30
        )
        assert turned_away.status_code == 503
        assert turned_away.headers["Retry-After"] == "1"
        assert turned_away.json() == {
            "code": "too_many_uploads",
            "message": "this API process is streaming 2 uploads, its limit "
            "(FARM_MAX_CONCURRENT_UPLOADS=2); retry after Retry-After",
        }
        assert not served.store.exists(model_storage_key(digests[2]))

        # The client waits for Retry-After and tries again; the slots free up meanwhile.
        path = tmp_path / "third"
        path.write_bytes(blobs[2])
        progress: list[int] = []

        def advance(count: int) -> None:
            progress.append(count)
            if count < 0:  # a try was turned away: the holders may finish now
                release.set()

        with FarmClient(api.url, token) as client:
            stored = client.upload(digests[2], path, advance)
        assert stored == {"sha256": digests[2], "stored": True}
        retries = [count for count in progress if count < 0]
        assert retries and sum(progress) == len(blobs[2])  # each try's count taken back
        # The API closes a turned-away upload's connection: the client stops sending.
        assert all(-count < len(blobs[2]) / 2 for count in retries)
        for thread in holders:
            thread.join(60)
        assert answers == [201, 201]
        for sha256 in digests:
            assert served.store.stat(model_storage_key(sha256)).sha256 == sha256
        turned_away_count = api.requests_logged(f'PUT /v1/models/{digests[2]} HTTP/1.1" 503')
        assert turned_away_count == 1 + len(retries)  # ours, then the client's own tries
    finally:
        release.set()
        api.stop()
