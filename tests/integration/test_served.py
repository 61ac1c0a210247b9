"""The served farm end to end: real `farm worker` processes, PostgreSQL, Redis, SeaweedFS."""

from __future__ import annotations

import json
import re
import threading
from datetime import timedelta

import pytest
from sqlalchemy import select

from farm.core.clock import now
from farm.core.identity import ModelRef
from farm.core.spec import CompileSpec, Target
from farm.server.db.models import Blob, Job
from farm.server.jobs import service
from farm.toolchain import host_toolchain
from tests import models
from tests.integration.served import host_queue, submit_ref, wait_until
from tests.integration.served import send as send_job


@pytest.fixture
def conv_xml(tmp_path):
    return models.save_ir(models.conv_net(), tmp_path / "model" / "conv.xml")


@pytest.fixture(scope="session")
def big_xml(tmp_path_factory):
    """~300 MB of weights: a compile that lasts long enough to be interrupted."""
    return models.save_ir(models.large_net(300), tmp_path_factory.mktemp("big") / "big.xml")


def submit_direct(farm, xml, send: bool = True, **spec) -> service.Submission:
    """Submit through the service layer, as the CLI and API do; `send=False` loses the message."""
    submission = submit_ref(farm, ModelRef.from_path(xml), CompileSpec.create("CPU", **spec))
    if send and submission.outcome == "queued":
        send_job(farm, submission.job_id)
    return submission


def test_a_real_worker_compiles_a_cpu_job_end_to_end(served, conv_xml, tmp_path):
    served.start_worker("w1")
    listed = served.farm_json("workers")
    assert [w["name"] for w in listed] == ["w1"]
    assert listed[0]["queues"][0] == host_queue() and "control" in listed[0]["queues"]
    cpu = Target.parse("CPU")
    assert listed[0]["toolchains"]["CPU"] == host_toolchain(cpu).key_part(cpu)

    result = served.farm_json("submit", str(conv_xml), "-d", "CPU", "--wait")
    assert result["outcome"] == "queued"
    job = result["job"]
    assert job["state"] == "succeeded" and job["worker"] == "w1" and job["queue"] == host_queue()

    (blob,) = served.blobs()
    assert blob.cache_key == result["cache_key"]
    stored = served.store.stat(blob.storage_key)
    assert (stored.size, stored.sha256) == (blob.size_bytes, blob.sha256)
    log = served.farm_json("logs", str(job["id"]))
    assert (log["id"], log["state"]) == (job["id"], "succeeded")
    # The timings line the worker wrote for this very blob (its size), not any mention of
    # "compile".
    timings = (
        r"compile \d+\.\d{3}s, export \d+\.\d{3}s, peak RSS \d+ MiB, "
        f"blob {blob.size_bytes} bytes"
    )
    assert re.search(rf"^{timings}$", log["log"], re.MULTILINE), log["log"]

    out = tmp_path / "pulled.blob"
    served.farm("pull", str(conv_xml), "-d", "CPU", "-o", str(out))
    ran = served.farm_json("run", str(out), "-d", "CPU")
    assert ran["import_seconds"] > 0
    assert served.farm_json("submit", str(conv_xml), "-d", "CPU")["outcome"] == "hit"

    # Another spec of the same model: the worker links the files it fetched, no second fetch.
    other = served.farm_json("submit", str(conv_xml), "-d", "CPU", "--hint", "latency", "--wait")
    assert other["job"]["state"] == "succeeded"
    assert served.worker_log("w1").count("into the worker cache") == 2  # .xml and .bin, once


def test_twenty_concurrent_identical_submits_compile_once(served, conv_xml):
    outcomes, errors = [], []

    def one() -> None:
        try:
            outcomes.append(submit_direct(served, conv_xml))
        except Exception as error:  # collected and asserted below
            errors.append(error)

    threads = [threading.Thread(target=one) for _ in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    job_ids = {s.job_id for s in outcomes}
    assert len(job_ids) == 1
    assert sorted(s.outcome for s in outcomes).count("queued") == 1
    served.start_worker("w1")
    (job_id,) = job_ids
    assert served.wait_job(job_id).state == "succeeded"
    assert served.count(Job) == 1 and served.count(Blob) == 1
    assert served.job(job_id).attempts == 1


def test_a_duplicated_delivery_compiles_once(served, conv_xml):
    submission = submit_direct(served, conv_xml)
    send_job(served, submission.job_id)  # the same job, twice
    served.start_worker("w1")
    assert served.wait_job(submission.job_id).state == "succeeded"
    wait_until(lambda: served.worker_log("w1").count("farm.compile") >= 4, 30, "both deliveries")
    assert served.job(submission.job_id).attempts == 1
    assert served.count(Blob) == 1


def test_a_lost_message_is_resent_by_the_reconciler(served, conv_xml):
    served.start_worker("w1")
    submission = submit_direct(served, conv_xml, send=False)  # committed, never sent
    assert served.job(submission.job_id).state == "queued"
    report = served.farm_json("reconcile", env={"FARM_RESEND_AFTER_SECONDS": "0"})
    assert report["resent"] == [submission.job_id]
    assert served.wait_job(submission.job_id).state == "succeeded"


def test_sigkill_mid_compile_then_restart_completes_with_one_blob(served, big_xml):
    served.start_worker("w1")
    submission = submit_direct(served, big_xml)
    wait_until(lambda: served.job(submission.job_id).state == "running", 60, "the compile")
    served.kill_worker("w1")  # SIGKILL to the worker, its pool and the compile child
    assert served.job(submission.job_id).state == "running"  # nobody told the database
    served.start_worker("w2")
    # The lease (3 s here) runs out; one reconciler pass takes exactly this job back and
    # re-sends it (a pass before that would have to leave it: tests/unit/test_rules_reconcile).
    wait_until(
        lambda: served.job(submission.job_id).lease_expires_at < now(), 30, "the lease to expire"
    )
    report = served.farm_json("reconcile")
    assert (report["taken_back"], report["resent"], report["failed"]) == (
        [submission.job_id],
        [submission.job_id],
        [],
    )
    job = served.wait_job(submission.job_id)
    assert job.state == "succeeded" and job.worker == "w2" and job.attempts == 2
    assert served.count(Blob) == 1


def test_a_queued_job_cancelled_never_starts(served, conv_xml):
    submission = submit_direct(served, conv_xml)
    cancelled = served.farm_json("cancel", str(submission.job_id))
    assert cancelled["state"] == "cancelled"
    served.start_worker("w1")
    wait_until(lambda: "farm.compile" in served.worker_log("w1"), 30, "the delivery")
    job = served.job(submission.job_id)
    assert job.state == "cancelled" and job.attempts == 0 and served.count(Blob) == 0


def test_a_running_compile_is_cancelled_by_its_worker(served, big_xml):
    served.start_worker("w1")
    submission = submit_direct(served, big_xml)
    wait_until(lambda: served.job(submission.job_id).state == "running", 60, "the compile")
    other = running_elsewhere(served, served.job(submission.job_id))
    with served.sessions() as session:  # at once: a `farm cancel` process takes a second to start
        service.cancel(session, submission.job_id, by="operator", as_admin=True)
    job = served.wait_job(submission.job_id, timeout=30)
    assert (job.state, job.error, job.cancelled_by) == (
        "cancelled",
        "cancelled while running",
        "operator",
    )
    assert served.count(Blob) == 0
    # Only the named job was asked to stop: another running job is left as it was.
    left = served.job(other)
    assert (left.state, left.cancel_requested, left.cancelled_by) == ("running", False, None)


def running_elsewhere(served, job: Job) -> int:
    """A second running job (its row only: a worker "w9" holds it, with a live lease)."""
    with served.sessions() as session:
        row = Job(
            cache_key="f" * 64,
            model_id=job.model_id,
            target=job.target,
            queue=job.queue,
            spec=job.spec,
            toolchain=job.toolchain,
            state="running",
            attempts=1,
            worker="w9",
            created_at=now(),
            started_at=now(),
            lease_expires_at=now() + timedelta(minutes=10),
        )
        session.add(row)
        session.commit()
        return row.id


def test_a_model_that_cannot_compile_fails_its_job_and_the_worker_carries_on(
    served, conv_xml, tmp_path
):
    broken = models.save_ir(models.conv_net(seed=9), tmp_path / "broken" / "m.xml")
    broken.write_text(broken.read_text().replace("<layers>", '<layers><layer id="x"'))
    bad = submit_direct(served, broken)
    good = submit_direct(served, conv_xml)
    served.start_worker("w1")
    failed = served.wait_job(bad.job_id)
    assert failed.state == "failed" and "cannot read model" in failed.error
    assert failed.attempts == 1
    assert served.wait_job(good.job_id).state == "succeeded"
    # The log keeps what the compiler said, beyond the one-line error: OpenVINO's full text.
    log = served.farm_json("logs", str(bad.job_id))
    assert log["state"] == "failed"
    assert f"failed: {failed.error}" in log["log"]
    assert "--- compiler output ---" in log["log"]
    assert "OpenVINO: Exception from src/" in log["log"]


def test_big_models_go_to_the_large_queue(served, conv_xml):
    served.start_worker("w1")  # this host has more than FARM_LARGE_WORKER_BYTES (16 GiB)
    result = served.farm_json(
        "submit", str(conv_xml), "-d", "CPU", "--wait", env={"FARM_LARGE_MODEL_BYTES": "1"}
    )
    assert result["job"]["queue"] == host_queue(large=True)
    assert result["job"]["state"] == "succeeded"


def test_a_target_nobody_serves_says_so(served, conv_xml):
    served.start_worker("w1")
    result = served.farm_json("submit", str(conv_xml), "-d", "4000", "--tiles", "2")
    assert result["job"]["state"] == "queued"
    assert result["job"]["queue"] == host_queue("4000")
    assert result["note"] == (
        f"no live worker has an NPU compiler, so none can compile for NPU.4000 (queue "
        f"{host_queue('4000')}): install one on a worker (farm toolchain install-npu-compiler); "
        "the job waits until such a worker starts (farm workers)"
    )
    status = served.farm_json("status", str(result["job"]["id"]))
    assert status["note"] == result["note"]
    # --wait gives up at once (exit 7), not after --wait-timeout: no live worker could take it.
    waited = served.farm(
        "submit", str(conv_xml), "-d", "4000", "--tiles", "2", "--wait", "--json", check=False
    )
    assert waited.returncode == 7, waited.stderr
    (error,) = [json.loads(line) for line in waited.stderr.splitlines()]
    assert error["code"] == "wait_timeout"
    assert error["message"].startswith(f"not waiting for job {result['job']['id']}: ")
    assert "no live worker has an NPU compiler" in error["message"]


def test_broken_configuration_stops_worker_and_doctor_with_one_line(served):
    cases = {
        "FARM_BROKER_URL": {"FARM_BROKER_URL": "redis://127.0.0.1:1/0"},
        "FARM_DATABASE_URL": {"FARM_DATABASE_URL": "postgresql+psycopg://postgres@127.0.0.1:1/x"},
        "does not exist": {"FARM_STORAGE_URL": "s3://no-such-bucket/x"},
        "refused the credentials": {"FARM_S3_SECRET_ACCESS_KEY": "wrong"},
    }
    for message, env in cases.items():
        for command in (["worker"], ["doctor"]):
            result = served.farm(*command, check=False, env=env)
            assert result.returncode == 5, (command, env, result.stderr)
            text = result.stderr + result.stdout
            assert message in text, (command, env, text)
            assert "Traceback" not in text
    bad_key = served.farm("worker", check=False, env={"FARM_SIGNING_KEY": "/no/such/key.pem"})
    assert bad_key.returncode == 5 and "FARM_SIGNING_KEY" in bad_key.stderr
    assert len(bad_key.stderr.strip().splitlines()) == 1
    with served.sessions() as session:
        assert session.scalars(select(Job)).all() == []


def test_a_job_over_its_attempt_limit_fails_through_farm_reconcile(served, conv_xml):
    from farm.server.jobs.runner import claim

    result = served.farm_json("submit", str(conv_xml), "-d", "CPU", env={"FARM_MAX_ATTEMPTS": "2"})
    job_id = result["job"]["id"]
    assert served.job(job_id).max_attempts == 2
    # Two workers claim it and die at once (a lease of 0 s): each claim is one attempt.
    with served.sessions() as session:
        assert claim(session, job_id, "dead-1", lease_seconds=0)
        assert claim(session, job_id, "dead-2", lease_seconds=0)
        assert not claim(session, job_id, "w3", lease_seconds=60)  # none left
    report = served.farm_json("reconcile")
    assert report["failed"] == [job_id] and report["resent"] == []
    job = served.job(job_id)
    assert job.state == "failed" and job.attempts == 2 and job.lease_expires_at is None
    assert job.error.startswith("gave up after 2 attempts (FARM_MAX_ATTEMPTS)")
    assert served.farm_json("status", str(job_id))["error"] == job.error


def test_a_job_queued_past_the_maximum_wait_fails_through_farm_reconcile(served, conv_xml):
    submission = submit_direct(served, conv_xml, send=False)
    assert served.farm_json("reconcile")["failed"] == []  # 24 h by default
    report = served.farm_json("reconcile", env={"FARM_MAX_QUEUE_SECONDS": "0"})
    assert report["failed"] == [submission.job_id] and report["resent"] == []
    job = served.job(submission.job_id)
    assert job.state == "failed" and job.attempts == 0 and job.finished_at is not None
    assert f"waited in queue {host_queue()} longer than 0 s" in job.error


def test_infrastructure_errors_count_as_attempts_then_fail_the_job(served, conv_xml, s3_url):
    from farm.server.jobs.runner import RunLimits, run_job
    from farm.server.storage import StorageError
    from farm.server.storage.s3 import S3Settings, S3Store
    from tests.conftest import S3_CREDENTIALS, S3_ENDPOINT_URL

    submission = submit_direct(served, conv_xml, send=False)
    # A worker whose store is misconfigured (another prefix): every model read fails.
    elsewhere = S3Settings.from_url(
        f"{s3_url}-elsewhere", endpoint_url=S3_ENDPOINT_URL, **S3_CREDENTIALS
    )
    store = S3Store(elsewhere)
    limits = RunLimits(lease_seconds=30)
    for attempt in (1, 2, 3):
        with pytest.raises(StorageError):
            run_job(served.sessions, store, submission.job_id, worker="w9", limits=limits)
        job = served.job(submission.job_id)
        assert (job.attempts, job.state) == (attempt, "queued" if attempt < 3 else "failed")
    assert job.error.startswith(
        "gave up after 3 attempts (FARM_MAX_ATTEMPTS); the last ended with an infrastructure "
        "error: StorageError: S3 read of models/"
    )
    # The retry Celery would still make finds the job failed and does nothing.
    again = run_job(served.sessions, store, submission.job_id, worker="w9", limits=limits)
    assert again.state == "failed" and again.attempts == 3
    assert served.count(Blob) == 0


def test_the_reference_follows_the_job_and_a_lost_run_is_sent_to_a_worker_again(served, conv_xml):
    served.start_worker("w1")
    submission = submit_direct(served, conv_xml)
    assert served.wait_job(submission.job_id).state == "succeeded"  # the blob is pullable now

    def reference() -> Blob:
        (blob,) = served.blobs()
        return blob

    wait_until(lambda: reference().reference_state == "ready", 120, "the worker task's tail")
    first = reference()
    assert first.reference_attempts == 1 and first.reference_signature

    with served.sessions() as session:  # its run died: the lease expired, nothing recorded
        row = session.get_one(Blob, first.id)
        row.reference_state, row.reference_lease_expires_at = "pending", now() - timedelta(1)
        row.reference_sha256 = row.reference_size_bytes = row.reference_signature = None
        session.commit()
    report = served.farm_json("reconcile")
    assert report["references_resent"] == [first.id] and report["resent"] == []
    wait_until(lambda: reference().reference_state == "ready", 120, "the re-sent reference run")
    again = reference()
    assert again.reference_attempts == 2 and again.reference_sha256 == first.reference_sha256
    assert "farm.reference" in served.worker_log("w1")
