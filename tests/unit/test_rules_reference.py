"""A blob's reference run after its job (docs/architecture.md §6, §14): who may claim a pending
reference (one run at a time, a lease, the job's attempts, a reconciler's send by its number),
and what the reconciler does with a run that was lost: sends it again to the job's queue as the
next attempt, or past the attempts records it skipped. Real SQLite rows, every branch."""

from __future__ import annotations

from datetime import timedelta

import pytest

from farm.core.clock import now
from farm.server.db.models import Blob
from farm.server.jobs import reference_run
from farm.server.jobs.reconcile import reconcile
from farm.server.jobs.reference_run import SEND_LEASE, claim
from tests.unit.conftest import add_blob, add_job, add_model, key


@pytest.fixture
def pending(served_farm):
    """A succeeded job's blob, its reference pending and unclaimed; its id."""
    model_id = add_model(served_farm)
    job_id = add_job(served_farm, model_id, 1, state="succeeded", attempts=1, max_attempts=3)
    blob = add_blob(served_farm, model_id, key(1))
    set_reference(served_farm, blob.id, job_id=job_id, reference_state="pending")
    return blob.id


def set_reference(farm, blob_id: int, **values) -> None:
    with farm.session() as session:
        row = session.get_one(Blob, blob_id)
        for name, value in values.items():
            setattr(row, name, value)
        session.commit()


def reference_of(farm, blob_id: int) -> tuple:
    with farm.session() as session:
        row = session.get_one(Blob, blob_id)
        return (
            row.reference_state,
            row.reference_attempts,
            row.reference_lease_expires_at,
            row.reference_note,
        )


def take(farm, blob_id: int, granted: int | None = None) -> int | None:
    with farm.session() as session:
        return claim(session, blob_id, 60, 3, granted)


def test_one_run_at_a_time_each_claim_an_attempt_up_to_the_jobs(served_farm, pending):
    assert take(served_farm, pending) == 1
    assert take(served_farm, pending) is None  # a live lease: another run holds it
    set_reference(served_farm, pending, reference_lease_expires_at=now() - timedelta(seconds=1))
    assert take(served_farm, pending) == 2  # its run died: taken over, the next attempt
    set_reference(served_farm, pending, reference_lease_expires_at=None, reference_attempts=3)
    assert take(served_farm, pending) is None  # no attempt left
    set_reference(served_farm, pending, reference_state="skipped", reference_attempts=0)
    assert take(served_farm, pending) is None  # nothing pending


def test_a_sent_run_holds_only_the_attempt_its_send_granted(served_farm, pending):
    set_reference(served_farm, pending, reference_attempts=2, reference_lease_expires_at=now())
    assert take(served_farm, pending, granted=1) is None  # a send superseded by a later one
    assert take(served_farm, pending, granted=2) == 2
    state, attempts, lease, _ = reference_of(served_farm, pending)
    assert (state, attempts) == ("pending", 2) and lease > now() + timedelta(seconds=50)


def lost_runs(farm) -> tuple[list, object]:
    sent: list[tuple[int, int, str]] = []
    with farm.session() as session:
        report = reconcile(
            session, farm.store, farm.settings, None, lambda *send: sent.append(send)
        )
    return sent, report


def test_the_reconciler_leaves_live_and_new_runs_alone(served_farm, pending):
    assert lost_runs(served_farm)[0] == []  # recorded just now: its run is starting
    set_reference(
        served_farm,
        pending,
        reference_attempts=1,
        reference_lease_expires_at=now() + timedelta(seconds=30),
    )
    sent, report = lost_runs(served_farm)
    assert sent == [] and report.references_resent == report.references_skipped == []


@pytest.mark.parametrize("lease", ["expired", "never claimed"])
def test_a_lost_run_is_sent_again_to_its_jobs_queue_as_the_next_attempt(
    served_farm, pending, lease
):
    if lease == "expired":
        set_reference(
            served_farm,
            pending,
            reference_attempts=1,
            reference_lease_expires_at=now() - timedelta(seconds=1),
        )
    else:  # its detached process never started
        old = now() - timedelta(seconds=served_farm.settings.resend_after_seconds + 1)
        set_reference(served_farm, pending, created_at=old)
    attempts_before = reference_of(served_farm, pending)[1]
    at = now()
    sent, report = lost_runs(served_farm)
    assert sent == [(pending, attempts_before + 1, "compile.cpu")]
    assert report.references_resent == [pending] and report.references_skipped == []
    state, attempts, lease_until, _ = reference_of(served_farm, pending)
    assert (state, attempts) == ("pending", attempts_before + 1)
    assert lease_until >= at + SEND_LEASE - timedelta(seconds=1)  # waits in its queue
    assert lost_runs(served_farm)[0] == []  # not sent again on the next pass


def test_past_its_attempts_a_lost_run_is_recorded_skipped_saying_why(served_farm, pending):
    set_reference(
        served_farm,
        pending,
        reference_attempts=3,
        reference_lease_expires_at=now() - timedelta(seconds=1),
    )
    sent, report = lost_runs(served_farm)
    assert sent == [] and report.references_skipped == [pending]
    state, attempts, lease, note = reference_of(served_farm, pending)
    assert (state, attempts, lease) == ("skipped", 3, None)
    assert note.startswith("no reference outputs: 3 runs ended without a result")


def test_a_run_records_only_while_its_claim_holds(served_farm, pending):
    attempt = take(served_farm, pending)
    assert attempt == 1
    set_reference(served_farm, pending, reference_attempts=2)  # a later send took it over
    with served_farm.session() as session:
        assert reference_run._record(session, pending, attempt, None, "late") is None
    assert reference_of(served_farm, pending)[0] == "pending"
    with served_farm.session() as session:
        ended = reference_run._record(session, pending, 2, None, "no reference outputs: x")
    assert ended == "skipped" and reference_of(served_farm, pending)[3] == "no reference outputs: x"
