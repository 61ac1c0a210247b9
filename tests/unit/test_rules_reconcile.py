"""The reconciler (docs/architecture.md §6): each pass fails jobs past their attempts or their
queue wait, takes back running jobs whose lease expired, and re-sends queued jobs whose message
is missing or old, except the embedded farm's. Every branch, with the exact ids it touched."""

from __future__ import annotations

from datetime import timedelta

import pytest

from farm.core.clock import now
from farm.server.jobs.reconcile import ReconcileReport, reconcile
from tests.unit.conftest import add_job, add_model, columns, get_job

GAVE_UP = (
    "gave up after 3 attempts (FARM_MAX_ATTEMPTS): each ended without a result (the worker "
    "died, or storage, database or broker failed); see the workers' logs"
)


@pytest.fixture
def model_id(served_farm) -> int:
    return add_model(served_farm)


def run(farm, dispatcher) -> ReconcileReport:
    with farm.session() as session:
        return reconcile(session, farm.store, farm.settings, dispatcher)


def ago(**delta):
    return now() - timedelta(**delta)


def running(lease_expires_at, attempts: int = 1, **fields):
    return {
        "state": "running",
        "attempts": attempts,
        "worker": "w1",
        "started_at": ago(minutes=10),
        "sent_at": ago(minutes=10),
        "lease_expires_at": lease_expires_at,
        **fields,
    }


def test_a_job_with_a_live_lease_is_left_alone(served_farm, model_id, stub):
    job_id = add_job(served_farm, model_id, 1, **running(now() + timedelta(seconds=60)))
    before = columns(served_farm, job_id)
    assert run(served_farm, stub) == ReconcileReport()
    assert columns(served_farm, job_id) == before
    assert stub.sent == []


def test_an_expired_lease_is_taken_back_and_sent_again(served_farm, model_id, stub):
    job_id = add_job(served_farm, model_id, 1, **running(ago(seconds=1), sent_at=ago(seconds=5)))
    before = columns(served_farm, job_id)
    at = now()
    report = run(served_farm, stub)
    assert report == ReconcileReport(failed=[], taken_back=[job_id], resent=[job_id])
    assert stub.sent == [(job_id, "compile.cpu")]
    after = columns(served_farm, job_id)
    assert after["sent_at"] >= at  # re-sent although its last message was recent
    assert after == {
        **before,
        "state": "queued",
        "lease_expires_at": None,
        "sent_at": after["sent_at"],
    }


def test_an_expired_lease_on_the_last_attempt_fails_the_job(served_farm, model_id, stub):
    job_id = add_job(served_farm, model_id, 1, **running(ago(seconds=1), attempts=3))
    report = run(served_farm, stub)
    assert report == ReconcileReport(failed=[job_id])
    job = get_job(served_farm, job_id)
    assert (job.state, job.error, job.lease_expires_at, job.attempts) == (
        "failed",
        GAVE_UP,
        None,
        3,
    )
    assert job.finished_at is not None
    assert stub.sent == []


def test_a_live_lease_on_the_last_attempt_is_left_to_finish(served_farm, model_id, stub):
    job_id = add_job(served_farm, model_id, 1, **running(now() + timedelta(seconds=60), attempts=3))
    before = columns(served_farm, job_id)
    assert run(served_farm, stub) == ReconcileReport()
    assert columns(served_farm, job_id) == before


def test_a_queued_job_past_its_attempts_fails(served_farm, model_id, stub):
    job_id = add_job(served_farm, model_id, 1, attempts=2, max_attempts=2, sent_at=now())
    assert run(served_farm, stub) == ReconcileReport(failed=[job_id])
    job = get_job(served_farm, job_id)
    assert (job.state, job.error) == ("failed", GAVE_UP.replace("after 3", "after 2"))
    assert stub.sent == []


def test_a_job_queued_longer_than_the_maximum_wait_fails(served_farm, model_id, stub):
    wait = served_farm.settings.max_queue_seconds
    old = add_job(served_farm, model_id, 1, created_at=ago(seconds=wait + 1), sent_at=now())
    young = add_job(served_farm, model_id, 2, created_at=ago(seconds=wait - 60), sent_at=now())
    young_before = columns(served_farm, young)
    assert run(served_farm, stub) == ReconcileReport(failed=[old])
    job = get_job(served_farm, old)
    assert job.state == "failed"
    assert job.error == (
        "waited in queue compile.cpu longer than 86400 s; no live worker took it (farm workers)"
    )
    assert job.finished_at is not None
    assert columns(served_farm, young) == young_before
    assert stub.sent == []


def test_a_job_both_exhausted_and_too_old_is_failed_once(served_farm, model_id, stub):
    wait = served_farm.settings.max_queue_seconds
    job_id = add_job(
        served_farm, model_id, 1, attempts=3, created_at=ago(seconds=wait + 1), sent_at=now()
    )
    assert run(served_farm, stub) == ReconcileReport(failed=[job_id])
    assert get_job(served_farm, job_id).error == GAVE_UP


def test_queued_jobs_are_resent_only_when_unsent_or_sent_long_ago(served_farm, model_id, stub):
    resend = served_farm.settings.resend_after_seconds
    unsent = add_job(served_farm, model_id, 1, sent_at=None)
    stale = add_job(served_farm, model_id, 2, sent_at=ago(seconds=resend + 5))
    recent = add_job(served_farm, model_id, 3, sent_at=ago(seconds=resend - 60))
    recent_before = columns(served_farm, recent)
    at = now()
    report = run(served_farm, stub)
    assert (report.failed, report.taken_back) == ([], [])
    assert sorted(report.resent) == [unsent, stale]
    assert sorted(stub.sent) == [(unsent, "compile.cpu"), (stale, "compile.cpu")]
    assert get_job(served_farm, unsent).sent_at >= at
    assert get_job(served_farm, stale).sent_at >= at
    assert columns(served_farm, recent) == recent_before


def test_embedded_jobs_are_never_resent(served_farm, model_id, stub):
    unsent = add_job(served_farm, model_id, 1, queue="embedded", sent_at=None)
    expired = add_job(served_farm, model_id, 2, queue="embedded", **running(ago(seconds=1)))
    unsent_before = columns(served_farm, unsent)
    report = run(served_farm, stub)
    assert report == ReconcileReport(taken_back=[expired])  # taken back, not re-sent
    assert get_job(served_farm, expired).state == "queued"
    assert columns(served_farm, unsent) == unsent_before
    assert stub.sent == []


def test_without_a_dispatcher_nothing_is_sent(served_farm, model_id):
    unsent = add_job(served_farm, model_id, 1, sent_at=None)
    report = run(served_farm, None)
    # Nothing to send through: nothing re-sent, nothing reported as re-sent.
    assert report == ReconcileReport()
    job = get_job(served_farm, unsent)
    assert (job.state, job.sent_at) == ("queued", None)


def test_the_local_store_has_no_uploads_to_abort(served_farm, model_id, stub):
    add_job(served_farm, model_id, 1, sent_at=now())
    assert run(served_farm, stub).aborted_uploads == []


def test_a_cancel_requested_job_whose_worker_died_ends_cancelled(served_farm, model_id, stub):
    job_id = add_job(served_farm, model_id, 1, **running(ago(seconds=1), cancel_requested=True))
    report = run(served_farm, stub)
    assert report == ReconcileReport(cancelled=[job_id])
    assert stub.sent == []
    assert get_job(served_farm, job_id).state == "cancelled"


def test_a_waiting_backlog_is_resent_with_a_per_job_backoff(served_farm, model_id, stub):
    """A job is re-sent once its last message is older than the job was when it was sent
    (doubling intervals), at least FARM_RESEND_AFTER_SECONDS apart and at most an hour."""
    due = add_job(served_farm, model_id, 1, created_at=ago(minutes=60), sent_at=ago(minutes=45))
    waiting = add_job(served_farm, model_id, 2, created_at=ago(minutes=60), sent_at=ago(minutes=20))
    capped = add_job(served_farm, model_id, 3, created_at=ago(hours=10), sent_at=ago(minutes=61))
    capped_recent = add_job(
        served_farm, model_id, 4, created_at=ago(hours=10), sent_at=ago(minutes=50)
    )
    floor = add_job(served_farm, model_id, 5, created_at=ago(minutes=4), sent_at=ago(minutes=3))
    untouched = {job: columns(served_farm, job) for job in (waiting, capped_recent, floor)}
    at = now()
    report = run(served_farm, stub)
    assert sorted(report.resent) == [due, capped]
    assert sorted(stub.sent) == [(due, "compile.cpu"), (capped, "compile.cpu")]
    assert get_job(served_farm, due).sent_at >= at
    assert get_job(served_farm, capped).sent_at >= at
    assert {job: columns(served_farm, job) for job in untouched} == untouched
    # The next pass re-sends neither: each message is now younger than its job was.
    stub.sent.clear()
    assert run(served_farm, stub) == ReconcileReport()
    assert stub.sent == []
