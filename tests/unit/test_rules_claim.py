"""Claim (docs/architecture.md §6): a conditional UPDATE takes a queued job, or a running one
whose lease expired; never a cancelled one, and never one that used up its attempts."""

from __future__ import annotations

from datetime import timedelta

import pytest

from farm.core.clock import now
from farm.server.jobs.runner import claim
from tests.unit.conftest import add_job, add_model, columns, get_job

LEASE = 120


@pytest.fixture
def model_id(embedded_farm) -> int:
    return add_model(embedded_farm)


def claimed(farm, job_id: int, worker: str = "w2") -> bool:
    with farm.session() as session:
        return claim(session, job_id, worker, LEASE)


def running(lease_expires_at, **fields):
    return {
        "state": "running",
        "attempts": 1,
        "worker": "w1",
        "started_at": now() - timedelta(minutes=10),
        "lease_expires_at": lease_expires_at,
        **fields,
    }


def test_a_queued_job_becomes_running_with_one_more_attempt_and_a_lease(embedded_farm, model_id):
    job_id = add_job(embedded_farm, model_id, 1)
    other = add_job(embedded_farm, model_id, 2)
    other_before = columns(embedded_farm, other)
    before = now()
    assert claimed(embedded_farm, job_id, "w1") is True
    job = get_job(embedded_farm, job_id)
    assert (job.state, job.attempts, job.worker) == ("running", 1, "w1")
    assert before <= job.started_at <= now()
    assert job.lease_expires_at - job.started_at == timedelta(seconds=LEASE)
    assert columns(embedded_farm, other) == other_before


def test_a_running_job_with_a_live_lease_is_not_claimable(embedded_farm, model_id):
    job_id = add_job(embedded_farm, model_id, 1, **running(now() + timedelta(seconds=60)))
    before = columns(embedded_farm, job_id)
    assert claimed(embedded_farm, job_id) is False
    assert columns(embedded_farm, job_id) == before


def test_a_running_job_whose_lease_expired_is_claimable(embedded_farm, model_id):
    job_id = add_job(embedded_farm, model_id, 1, **running(now() - timedelta(seconds=1)))
    assert claimed(embedded_farm, job_id, "w2") is True
    job = get_job(embedded_farm, job_id)
    assert (job.state, job.attempts, job.worker) == ("running", 2, "w2")
    assert job.lease_expires_at - job.started_at == timedelta(seconds=LEASE)
    assert job.lease_expires_at > now()


def test_a_job_with_cancel_requested_is_not_claimable(embedded_farm, model_id):
    job_id = add_job(
        embedded_farm,
        model_id,
        1,
        **running(now() - timedelta(seconds=1), cancel_requested=True),
    )
    before = columns(embedded_farm, job_id)
    assert claimed(embedded_farm, job_id) is False
    assert columns(embedded_farm, job_id) == before


@pytest.mark.parametrize("state", ["queued", "running"])
def test_a_job_at_max_attempts_is_not_claimable(embedded_farm, model_id, state):
    fields = {"state": "queued"} if state == "queued" else running(now() - timedelta(seconds=1))
    job_id = add_job(embedded_farm, model_id, 1, **{**fields, "attempts": 3, "max_attempts": 3})
    before = columns(embedded_farm, job_id)
    assert claimed(embedded_farm, job_id) is False
    assert columns(embedded_farm, job_id) == before


def test_a_job_one_short_of_max_attempts_is_claimed_for_its_last(embedded_farm, model_id):
    job_id = add_job(embedded_farm, model_id, 1, attempts=2, max_attempts=3)
    assert claimed(embedded_farm, job_id) is True
    assert get_job(embedded_farm, job_id).attempts == 3


@pytest.mark.parametrize("state", ["succeeded", "failed", "cancelled"])
def test_a_finished_job_is_not_claimable(embedded_farm, model_id, state):
    job_id = add_job(embedded_farm, model_id, 1, state=state, attempts=1, finished_at=now())
    before = columns(embedded_farm, job_id)
    assert claimed(embedded_farm, job_id) is False
    assert columns(embedded_farm, job_id) == before


def test_a_duplicate_delivery_finds_the_job_claimed(embedded_farm, model_id):
    job_id = add_job(embedded_farm, model_id, 1)
    assert claimed(embedded_farm, job_id, "w1") is True
    assert claimed(embedded_farm, job_id, "w2") is False
    job = get_job(embedded_farm, job_id)
    assert (job.state, job.attempts, job.worker) == ("running", 1, "w1")


def test_an_unknown_job_is_not_claimable(embedded_farm, model_id):
    assert claimed(embedded_farm, 999) is False
