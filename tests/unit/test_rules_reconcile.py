"""The reconciler (docs/architecture.md §6): each pass fails jobs past their attempts or their
queue wait, takes back running jobs whose lease expired, and re-sends queued jobs whose message
is missing or old, except the embedded farm's. Every branch, with the exact ids it touched."""

from __future__ import annotations

import logging
from datetime import timedelta

import pytest
from sqlalchemy import select

from farm.core.clock import now
from farm.server.db.models import Job
from farm.server.db.session import upgrade_database
from farm.server.jobs import reconcile as reconcile_module
from farm.server.jobs.reconcile import ReconcileReport, reconcile
from farm.server.storage.local import LocalStore
from tests.unit.conftest import (
    NOWHERE_BROKER,
    add_job,
    add_model,
    close_farm,
    columns,
    get_job,
    open_farm,
)

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
    # Listed after the cancelled one: ending a cancelled job does not end the pass.
    expired = add_job(served_farm, model_id, 2, **running(ago(seconds=1)))
    at = now()
    report = run(served_farm, stub)
    assert report == ReconcileReport(cancelled=[job_id], taken_back=[expired], resent=[expired])
    assert stub.sent == [(expired, "compile.cpu")]
    job = get_job(served_farm, job_id)
    assert (job.state, job.error, job.lease_expires_at) == (
        "cancelled",
        "cancelled while running",
        None,
    )
    assert job.finished_at >= at


def test_taking_a_job_back_is_logged_with_its_worker(served_farm, model_id, stub, caplog):
    job_id = add_job(served_farm, model_id, 1, **running(ago(seconds=1)))
    with caplog.at_level(logging.WARNING, logger="farm.server.jobs.reconcile"):
        run(served_farm, stub)
    assert caplog.messages == [f"job {job_id}: lease of w1 expired; taking it back"]


@pytest.fixture
def frozen(monkeypatch):
    """The reconciler's clock stopped at one instant: the limits' boundaries are exact."""
    at = now()
    monkeypatch.setattr(reconcile_module, "now", lambda: at)
    return at


def test_a_lease_ending_at_this_instant_is_still_live(served_farm, model_id, stub, frozen):
    """Past means strictly before now: a worker that renewed to exactly now keeps its job, as
    does one on its last attempt."""
    job_ids = [
        add_job(served_farm, model_id, 1, **running(frozen)),
        add_job(served_farm, model_id, 2, **running(frozen, attempts=3)),
    ]
    before = {job_id: columns(served_farm, job_id) for job_id in job_ids}
    assert run(served_farm, stub) == ReconcileReport()
    assert {job_id: columns(served_farm, job_id) for job_id in job_ids} == before


def test_a_job_queued_exactly_the_maximum_wait_may_still_start(served_farm, model_id, stub, frozen):
    wait = timedelta(seconds=served_farm.settings.max_queue_seconds)
    job_id = add_job(served_farm, model_id, 1, created_at=frozen - wait, sent_at=frozen)
    assert run(served_farm, stub) == ReconcileReport()
    assert get_job(served_farm, job_id).state == "queued"


def test_a_running_job_older_than_the_queue_limit_is_left_to_run(served_farm, model_id, stub):
    """The queue limit is about waiting for a worker: a job one took long ago keeps running."""
    wait = served_farm.settings.max_queue_seconds
    job_id = add_job(
        served_farm,
        model_id,
        1,
        created_at=ago(seconds=wait + 3600),
        **running(now() + timedelta(seconds=60)),
    )
    before = columns(served_farm, job_id)
    assert run(served_farm, stub) == ReconcileReport()
    assert columns(served_farm, job_id) == before


def test_an_expired_lease_older_than_the_queue_limit_is_taken_back_not_failed(
    served_farm, model_id, stub
):
    wait = served_farm.settings.max_queue_seconds
    job_id = add_job(
        served_farm, model_id, 1, created_at=ago(seconds=wait + 1), **running(ago(seconds=1))
    )
    report = run(served_farm, stub)
    assert report == ReconcileReport(taken_back=[job_id], resent=[job_id])
    assert get_job(served_farm, job_id).state == "queued"


def test_a_job_within_its_attempts_is_never_failed_for_them(served_farm, model_id, stub):
    """One attempt short of the maximum: queued, running with a live lease, or running with an
    expired one, none is failed (the expired one is taken back for its last attempt)."""
    queued = add_job(served_farm, model_id, 1, attempts=2, sent_at=now())
    live = add_job(served_farm, model_id, 2, **running(now() + timedelta(seconds=60), attempts=2))
    expired = add_job(served_farm, model_id, 3, **running(ago(seconds=1), attempts=2))
    unchanged = {job_id: columns(served_farm, job_id) for job_id in (queued, live)}
    report = run(served_farm, stub)
    assert report == ReconcileReport(taken_back=[expired], resent=[expired])
    assert {job_id: columns(served_farm, job_id) for job_id in (queued, live)} == unchanged
    assert (get_job(served_farm, expired).state, get_job(served_farm, expired).attempts) == (
        "queued",
        2,
    )


def test_each_rule_touches_only_its_own_jobs(served_farm, model_id, stub):
    """One pass over one job of each kind: each id lands in exactly one list."""
    wait, resend = served_farm.settings.max_queue_seconds, served_farm.settings.resend_after_seconds
    exhausted = add_job(served_farm, model_id, 1, **running(ago(seconds=1), attempts=3))
    too_old = add_job(served_farm, model_id, 2, created_at=ago(seconds=wait + 1), sent_at=now())
    expired = add_job(served_farm, model_id, 3, **running(ago(seconds=1)))
    lost = add_job(served_farm, model_id, 4, sent_at=ago(seconds=resend + 1))
    cancelled = add_job(served_farm, model_id, 5, **running(ago(seconds=1), cancel_requested=True))
    live = add_job(served_farm, model_id, 6, **running(now() + timedelta(seconds=60)))
    recent = add_job(served_farm, model_id, 7, sent_at=ago(seconds=resend - 10))
    # Finished, with the lease its worker never cleared: not running, nothing to take back.
    done = add_job(
        served_farm,
        model_id,
        8,
        state="succeeded",
        attempts=3,  # on its last attempt: still not one to fail
        finished_at=now(),
        lease_expires_at=ago(seconds=1),
    )
    untouched = {job_id: columns(served_farm, job_id) for job_id in (live, recent, done)}
    report = run(served_farm, stub)
    assert (sorted(report.failed), report.taken_back, report.cancelled) == (
        sorted([exhausted, too_old]),
        [expired],
        [cancelled],
    )
    assert sorted(report.resent) == sorted([expired, lost])
    assert sorted(stub.sent) == sorted([(expired, "compile.cpu"), (lost, "compile.cpu")])
    assert {job_id: columns(served_farm, job_id) for job_id in (live, recent, done)} == untouched
    states = {job_id: get_job(served_farm, job_id).state for job_id in (exhausted, too_old)}
    assert states == {exhausted: "failed", too_old: "failed"}


class RecordingStore(LocalStore):
    """The farm's local store, recording how idle the reconciler says an unfinished write must
    be to abort it, and answering what it "aborted" (which writes are idle is each store's
    rule: tests/integration/test_stale_uploads.py for S3, tests/unit/test_storage_local.py for
    the local folder)."""

    def __init__(self, root, aborted: list[str]) -> None:
        super().__init__(root)
        self.asked: list[timedelta] = []
        self.aborted = aborted

    def abort_stale_uploads(self, older_than: timedelta) -> list[str]:
        self.asked.append(older_than)
        return list(self.aborted)


def test_uploads_are_aborted_only_when_idle_past_their_setting(served_farm, stub, tmp_path):
    settings = served_farm.settings.model_copy(
        update={"stale_upload_seconds": 1800, "max_run_seconds": 60}
    )
    store = RecordingStore(tmp_path / "store", ["models/abc"])
    with served_farm.session() as session:
        report = reconcile(session, store, settings, stub)
    # Idle for FARM_STALE_UPLOAD_SECONDS: not 0 (an upload in progress would be cut off), not
    # the run limit (a slow upload outlives any compile).
    assert store.asked == [timedelta(seconds=1800)]
    assert report == ReconcileReport(aborted_uploads=["models/abc"])


@pytest.mark.postgres
def test_two_reconcilers_never_handle_one_job(tmp_path, monkeypatch, postgres_url, stub):
    """On PostgreSQL each pass locks the rows it acts on with FOR UPDATE SKIP LOCKED: a job
    another reconciler holds is skipped, not waited for and not handled twice."""
    upgrade_database(postgres_url)
    # lock_timeout: a pass that waited for the lock would fail in 2 s instead of hanging.
    farm = open_farm(
        tmp_path / "farm",
        monkeypatch,
        database_url=f"{postgres_url}?options=-c%20lock_timeout%3D2000",
        broker_url=NOWHERE_BROKER,
    )
    try:
        model_id = add_model(farm)
        held = add_job(farm, model_id, 1, **running(ago(seconds=1)))
        free = add_job(farm, model_id, 2, **running(ago(seconds=1)))
        with farm.session() as other:  # the other reconciler, mid-pass: it holds `held`
            other.scalars(select(Job).where(Job.id == held).with_for_update()).one()
            report = run(farm, stub)
            other.rollback()
        assert report == ReconcileReport(taken_back=[free], resent=[free])
        assert stub.sent == [(free, "compile.cpu")]
        assert get_job(farm, held).state == "running"  # left to the reconciler holding it
        assert get_job(farm, free).state == "queued"
    finally:
        close_farm(farm)


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


def test_a_message_is_due_for_a_re_send_exactly_when_its_wait_is_over():
    """`may_be_lost` to the microsecond: a job sent at creation waits `resend_after`; one sent
    ten minutes after it was created waits ten minutes (its age at that send); no wait is
    longer than `RESEND_BACKOFF_MAX`."""
    resend_after, tick = timedelta(minutes=5), timedelta(microseconds=1)
    created = now()
    for age_when_sent, wait in (
        (timedelta(0), resend_after),
        (timedelta(minutes=10), timedelta(minutes=10)),
        (reconcile_module.RESEND_BACKOFF_MAX * 3, reconcile_module.RESEND_BACKOFF_MAX),
    ):
        job = Job(created_at=created, sent_at=created + age_when_sent)
        due = job.sent_at + wait
        assert reconcile_module.may_be_lost(job, due, resend_after)
        assert not reconcile_module.may_be_lost(job, due - tick, resend_after)
    assert reconcile_module.may_be_lost(
        Job(created_at=created, sent_at=None), created, resend_after
    )
