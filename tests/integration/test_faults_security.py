"""Fault injection with real processes (issue 8): PostgreSQL stopped during a submit and during
a job's finish, S3 unreachable during an edge download, the worker's temporary disk full, the
API killed during an upload.

Each test breaks a service of its own (a private PostgreSQL cluster, a proxy in front of
SeaweedFS, a tiny disk, its own API process), never the shared ones, and ends with a census:
the exact number of rows in jobs / blobs / models / pulls and of objects in the store. What was
lost: nothing. What was duplicated: nothing in the database (a model file uploaded before the
fault stays stored once, content-addressed, and is not uploaded again).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlparse

import pytest
from sqlalchemy import select, update

from farm.client import ApiError, FarmClient
from farm.core.clock import now
from farm.core.identity import ModelRef
from farm.core.signing import load_signer
from farm.core.spec import CompileSpec
from farm.server.db.models import Blob, Job, Model, Pull
from farm.server.jobs.runner import run_job
from farm.server.storage import blob_storage_key, model_storage_key
from farm.server.tokens import create_token
from farm.toolchain import host_toolchain
from tests import models
from tests.conftest import S3_ENDPOINT_URL, service_missing
from tests.integration.faults import PrivatePostgres, PrivateRedis, TcpProxy, tiny_disk_command
from tests.integration.served import ApiServer, ServedFarm, wait_until
from tests.integration.served import send as send_job
from tests.integration.test_served import submit_direct


@pytest.fixture(scope="module")
def postgres_cluster():
    try:
        cluster = PrivatePostgres()
        cluster.start()
    except (RuntimeError, OSError, subprocess.CalledProcessError) as error:
        service_missing("a private PostgreSQL (initdb, pg_ctl)", error)
    yield cluster
    cluster.remove()


@pytest.fixture
def private_postgres(postgres_cluster):
    """The module's private cluster, running (a previous test may have left it stopped)."""
    if not (postgres_cluster.data / "postmaster.pid").exists():
        postgres_cluster.start()
    return postgres_cluster


@pytest.fixture
def broker(tmp_path):
    """A Redis of this test's own: the shared one's 15 database numbers are too few for test
    runs side by side, and a message sent to another run's workers is lost to this one."""
    redis = PrivateRedis(tmp_path)
    redis.start()
    yield redis.url
    redis.stop()


def census(farm: ServedFarm) -> dict[str, int]:
    """What the farm holds: rows per table, objects (and unfinished uploads) in the store."""
    store = farm.store
    prefix = store.settings.prefix
    pages = store.client.get_paginator("list_objects_v2").paginate(
        Bucket=store.bucket, Prefix=prefix
    )
    keys = [o["Key"].removeprefix(prefix) for page in pages for o in page.get("Contents", [])]
    uploads = store.client.list_multipart_uploads(Bucket=store.bucket, Prefix=prefix)
    return {
        "jobs": farm.count(Job),
        "blobs": farm.count(Blob),
        "models": farm.count(Model),
        "pulls": farm.count(Pull),
        "model objects": sum(k.startswith("models/") for k in keys),
        "blob objects": sum(k.startswith("blobs/") for k in keys),
        "unfinished uploads": len(uploads.get("Uploads", [])),
    }


def holding(**counts: int) -> dict[str, int]:
    zero = dict.fromkeys(("jobs", "blobs", "models", "pulls", "model objects", "blob objects"), 0)
    return {**zero, "unfinished uploads": 0, **{k.replace("_", " "): v for k, v in counts.items()}}


UPLOAD_MODEL_MB = 48
BLOCK_AT_CHUNK = 36
"""The client stops sending at this MiB of the upload: loopback socket buffers (~10 MiB at
most) cannot hold what the API has not read, so it has read over one 16 MiB part by then."""


def receiving_upload(farm: ServedFarm, sha256: str) -> bool:
    """The API is past authentication and streaming the file's parts into the store."""
    store = farm.store
    key = store._key(model_storage_key(sha256))
    uploads = store.client.list_multipart_uploads(Bucket=store.bucket, Prefix=key)
    return bool(uploads.get("Uploads"))


def kill(api: ApiServer) -> None:
    os.killpg(api.process.pid, signal.SIGKILL)
    api.process.wait(timeout=30)
    api.process = None


# --- PostgreSQL ---------------------------------------------------------------------------


def test_postgres_stopped_during_a_submit(tmp_path, served_env, private_postgres, broker):
    env = {
        **served_env,
        "FARM_DATABASE_URL": private_postgres.create_database(),
        "FARM_BROKER_URL": broker,
    }
    farm = ServedFarm(env, tmp_path)
    api = ApiServer(env, tmp_path / "api.log")
    try:
        api.start()
        with farm.sessions() as session:
            token = create_token(session, "submitter", "submit")
        xml = models.save_ir(models.large_net(UPLOAD_MODEL_MB), tmp_path / "m" / "m.xml")
        ref = ModelRef.from_path(xml)
        spec = CompileSpec.create("CPU")
        chunks = 0

        @contextlib.contextmanager
        def on_upload(total: int):
            def advance(_: int) -> None:
                nonlocal chunks
                chunks += 1
                if chunks == BLOCK_AT_CHUNK:  # the API streams the .bin: the submit is half done
                    wait_until(
                        lambda: receiving_upload(farm, ref.identity["bin"]), 30, "the upload"
                    )
                    private_postgres.stop()

            yield advance

        with FarmClient(api.url, token) as client, pytest.raises(ApiError) as refused:
            client.submit_model(ref, [spec], host_toolchain(spec.target), on_upload)
        # The .bin went up whole (an upload in flight needs no database); the .xml's upload
        # was refused at its authentication.
        assert (refused.value.status, refused.value.code) == (503, "database_unavailable")
        assert "database" in refused.value.message and "\n" not in refused.value.message

        private_postgres.start()
        # Lost: nothing. Duplicated: nothing. The .bin stays stored (content-addressed, whole,
        # verified); the refused submission wrote no row.
        assert census(farm) == holding(model_objects=1)
        stored = farm.store.stat(model_storage_key(ref.identity["bin"]))
        assert (stored.size, stored.sha256) == (
            ref.files["bin"].stat().st_size,
            ref.identity["bin"],
        )

        answer = farm.farm_json(
            "submit", str(xml), "-d", "CPU", env={"FARM_API_URL": api.url, "FARM_TOKEN": token}
        )
        assert answer["outcome"] == "queued" and answer["job"]["state"] == "queued"
        assert census(farm) == holding(jobs=1, models=1, model_objects=2)
        assert api.requests_logged(f"PUT /v1/models/{ref.identity['bin']}") == 1  # not again
    finally:
        api.stop()
        farm.stop()


def test_postgres_stopped_during_a_jobs_finish(tmp_path, served_env, private_postgres, broker):
    env = {
        **served_env,
        "FARM_DATABASE_URL": private_postgres.create_database(),
        "FARM_BROKER_URL": broker,
    }
    farm = ServedFarm(env, tmp_path)
    work = tmp_path / "worker-tmp"
    work.mkdir()
    try:
        farm.start_worker("w1", env={"TMPDIR": str(work)})
        xml = models.save_ir(models.large_net(64), tmp_path / "m" / "m.xml")
        submission = submit_direct(farm, xml)
        job_id, key = submission.job_id, blob_storage_key(submission.cache_key)
        # The compile's request is written just before its child process starts.
        wait_until(lambda: any(work.glob("farm-job-*/*.request.json")), 60, "the compile")
        private_postgres.stop()  # the compile (~1.5 s) goes on; its finish meets no database

        # The blob is stored; its row cannot be written (no row without its object, ever:
        # the object first, then the row in the transaction that marks the job succeeded).
        wait_until(lambda: farm.store.exists(key), 60, "the blob to be stored")
        wait_until(lambda: "retry: Retry in" in farm.worker_log("w1"), 60, "a retry")
        assert farm.workers["w1"].poll() is None
        private_postgres.start()

        # The worker's retry re-claims the job once its lease has expired; if the retry came
        # too early (lease still live), the reconciler takes the job back and re-sends it.
        job = wait_until(
            lambda: _finished_or_reconciled(farm, job_id), 90, "the job to succeed after all"
        )
        assert job.state == "succeeded"
        assert job.attempts == 2  # the attempt that met the outage counts
        (blob,) = farm.blobs()
        assert blob.job_id == job_id and blob.storage_key == key
        stored = farm.store.stat(key)
        assert (stored.size, stored.sha256) == (blob.size_bytes, blob.sha256)
        # Lost: nothing. Duplicated: nothing (one job, one blob row, one object).
        assert census(farm) == holding(jobs=1, blobs=1, models=1, model_objects=2, blob_objects=1)
    finally:
        farm.stop()


def _finished_or_reconciled(farm: ServedFarm, job_id: int):
    job = farm.job(job_id)
    if job.state in ("succeeded", "failed"):
        return job
    if job.state == "running" and job.lease_expires_at and job.lease_expires_at < now():
        farm.farm("reconcile")
    return None


# --- S3 during an edge download -----------------------------------------------------------


def test_s3_unreachable_during_an_edge_download(tmp_path, served_env):
    farm = ServedFarm(served_env, tmp_path)
    # The API presigns URLs for the proxy; the proxy goes down 4 MB into the first download.
    proxy = TcpProxy(urlparse(S3_ENDPOINT_URL).port, down_after=4 * 2**20)
    api_env = {**served_env, "FARM_S3_ENDPOINT_URL": f"http://127.0.0.1:{proxy.port}"}
    api = ApiServer(api_env, tmp_path / "api.log")
    cache = tmp_path / "edge-cache"
    try:
        xml = models.save_ir(models.large_net(16), tmp_path / "m" / "m.xml")
        submission = submit_direct(farm, xml, send=False)
        signer = load_signer(Path(served_env["FARM_SIGNING_KEY"]))
        job = run_job(
            farm.sessions, farm.store, submission.job_id, work_root=tmp_path, signer=signer
        )
        assert job.state == "succeeded"  # compiled here: the worker is not what this tests
        (blob,) = farm.blobs()
        proxy.start()
        api.start()
        with farm.sessions() as session:
            token = create_token(session, "edge", "pull")
        edge_env = {k: v for k, v in os.environ.items() if not k.startswith("FARM_")}
        edge_env |= {
            "FARM_API_URL": api.url,
            "FARM_TOKEN": token,
            "FARM_TRUSTED_KEYS": served_env["FARM_TRUSTED_KEYS"],
            "FARM_CACHE_DIR": str(cache),
            "FARM_HOME": str(tmp_path / "edge-home"),
        }

        def pull() -> subprocess.CompletedProcess:
            return subprocess.run(
                [sys.executable, "-m", "farm", "pull", blob.cache_key, "--json"],
                env=edge_env,
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )

        broken = pull()
        assert broken.returncode == 5, broken.stderr  # infrastructure
        (line,) = broken.stderr.strip().splitlines()
        error = json.loads(line)  # with --json, the error is one JSON object on stderr
        assert (error["code"], error["exit"]) == ("unreachable", 5), line
        assert f"127.0.0.1:{proxy.port}" in error["message"], line
        assert proxy.cuts == 1
        # The cache holds no blob and nothing half-written outside partial/.
        partial = cache / "blobs" / "partial" / blob.cache_key
        files = {p.relative_to(cache) for p in cache.rglob("*") if p.is_file()}
        assert files == {partial.relative_to(cache)}
        # The proxy counts response headers too: the body kept is 4 MiB less those few bytes.
        assert 4 * 2**20 - 4096 <= partial.stat().st_size < blob.size_bytes
        kept = partial.stat().st_size
        # Lost: nothing. Nothing recorded for a pull that did not happen.
        assert census(farm) == holding(jobs=1, blobs=1, models=1, model_objects=2, blob_objects=1)

        proxy.sent.clear()
        proxy.start()  # S3 reachable again, on the same address
        resumed = pull()
        assert resumed.returncode == 0, resumed.stderr
        result = json.loads(resumed.stdout)
        assert result["downloaded"] and result["path"] == str(
            cache / "blobs" / f"{blob.cache_key}.blob"
        )
        assert f"range: bytes={kept}-".encode() in bytes(proxy.sent).lower()  # resumed
        data = Path(result["path"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == blob.sha256
        files = {p.relative_to(cache) for p in cache.rglob("*") if p.is_file()}
        kept_files = {f"{blob.cache_key}.blob", f"{blob.cache_key}.manifest"}  # + its manifest
        assert files == {Path("blobs") / name for name in kept_files}
        # One pull, reported once.
        assert census(farm) == holding(
            jobs=1, blobs=1, models=1, pulls=1, model_objects=2, blob_objects=1
        )
    finally:
        api.stop()
        proxy.cut()
        farm.stop()


# --- the worker's temporary disk ----------------------------------------------------------


def test_worker_temporary_disk_full(tmp_path, served_env, broker):
    small = models.save_ir(models.conv_net(), tmp_path / "small" / "m.xml")
    fits = models.save_ir(models.large_net(16), tmp_path / "fits" / "m.xml")
    too_big = models.save_ir(models.large_net(32, seed=1), tmp_path / "big" / "m.xml")
    disk = tmp_path / "worker-tmp"
    disk.mkdir()
    bin_bytes = fits.with_suffix(".bin").stat().st_size
    # 16 MiB model: its files fit, a blob of its size does not. 32 MiB model: nothing fits.
    prefix, kind = tiny_disk_command(disk, bin_bytes + 4 * 2**20)
    if kind == "RLIMIT_FSIZE":  # a limit per file: the .bin fits, a blob a little larger not
        prefix, kind = tiny_disk_command(disk, bin_bytes + 1024)
    farm = ServedFarm({**served_env, "FARM_BROKER_URL": broker}, tmp_path)
    try:
        worker = farm.start_worker("w1", env={"TMPDIR": str(disk)}, prefix=prefix)
        failing = [submit_direct(farm, xml, send=False).job_id for xml in (fits, too_big)]
        with farm.sessions() as session:  # two attempts each, not three: a shorter test
            session.execute(update(Job).values(max_attempts=2))
            session.commit()
        for job_id in failing:
            send_job(farm, job_id)
        for job_id in failing:
            job = farm.wait_job(job_id, timeout=90)
            assert job.state == "failed", (kind, job.error)
            assert job.attempts == 2, job.error  # an infrastructure error: retried, then failed
            assert "WorkDiskFull" in job.error and str(disk) in job.error, job.error
            assert "TMPDIR" in job.error, job.error
        assert worker.poll() is None  # the worker survived...
        assert farm.count(Blob) == 0
        job_id = submit_direct(farm, small).job_id
        job = farm.wait_job(job_id, timeout=90)  # ...and compiles the next job
        assert (job.state, job.worker) == ("succeeded", "w1"), job.error
        assert worker.poll() is None
        # Lost: nothing. Duplicated: nothing. Stored: only the blob that fitted.
        assert census(farm) == holding(jobs=3, blobs=1, models=3, model_objects=6, blob_objects=1)
        # No job's files are left on the worker's disk (seen through its own mount namespace),
        # once the job's reference run, the tail of its task after the record (docs §6), ended.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with farm.sessions() as session:
                if session.scalar(select(Blob.reference_state)) != "pending":
                    break
            time.sleep(0.2)
        seen_by_worker = Path(f"/proc/{worker.pid}/root") / disk.relative_to("/")
        leftover = [p.name for p in seen_by_worker.glob("farm-job-*")]
        for _ in range(50):  # the task removes its folder right after recording the reference
            if not leftover:
                break
            time.sleep(0.1)
            leftover = [p.name for p in seen_by_worker.glob("farm-job-*")]
        assert leftover == []
    finally:
        farm.stop()


# --- the API restarted during an upload ---------------------------------------------------


def test_api_killed_during_an_upload(tmp_path, served_env, broker):
    api_tmp = tmp_path / "api-tmp"
    api_tmp.mkdir()
    env = {**served_env, "FARM_BROKER_URL": broker, "TMPDIR": str(api_tmp)}
    farm = ServedFarm(env, tmp_path)
    api = ApiServer(env, tmp_path / "api.log")
    try:
        api.start()
        with farm.sessions() as session:
            token = create_token(session, "submitter", "submit")
        xml = models.save_ir(models.large_net(UPLOAD_MODEL_MB), tmp_path / "m" / "m.xml")
        ref = ModelRef.from_path(xml)
        chunks = 0

        def progress(_: int) -> None:
            nonlocal chunks
            chunks += 1
            if chunks == BLOCK_AT_CHUNK:
                wait_until(lambda: receiving_upload(farm, ref.identity["bin"]), 30, "the upload")
                kill(api)

        with FarmClient(api.url, token) as client, pytest.raises(ApiError) as broken:
            client.upload(ref.identity["bin"], ref.files["bin"], progress)
        assert (broken.value.status, broken.value.code) == (0, "unreachable")
        assert chunks < UPLOAD_MODEL_MB

        api.start()  # the same port
        # Lost: nothing. Duplicated: nothing. No object under the digest, no row. The parts
        # the killed process sent stay in an unfinished upload, which the reconciler aborts
        # (after FARM_MAX_RUN_SECONDS; here at once). The API kept nothing on its own disk.
        assert census(farm) == holding(unfinished_uploads=1)
        assert not farm.store.exists(model_storage_key(ref.identity["bin"]))
        assert list(api_tmp.iterdir()) == []
        aborted = farm.store.abort_stale_uploads(timedelta(0))
        assert aborted == [farm.store._key(model_storage_key(ref.identity["bin"]))]
        assert census(farm) == holding()

        answer = farm.farm_json(
            "submit", str(xml), "-d", "CPU", env={"FARM_API_URL": api.url, "FARM_TOKEN": token}
        )
        assert answer["outcome"] == "queued"
        assert census(farm) == holding(jobs=1, models=1, model_objects=2)
        for role, sha in ref.identity.items():
            stored = farm.store.stat(model_storage_key(sha))
            assert (stored.size, stored.sha256) == (ref.files[role].stat().st_size, sha)
    finally:
        api.stop()
        farm.stop()
