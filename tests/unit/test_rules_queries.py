"""Finding jobs: by id, the latest for a cache key, and the filtered list (newest first)."""

from __future__ import annotations

from datetime import timedelta, timezone

import pytest

from farm.core.clock import now
from farm.core.errors import NotFound
from farm.server.db.models import Job, Model
from farm.server.db.session import upgrade_database
from farm.server.jobs import service
from farm.server.jobs.service import latest_job_for_key, list_jobs
from tests.unit.conftest import add_job, add_model, close_farm, key, open_farm


@pytest.fixture
def jobs(embedded_farm) -> dict[str, int]:
    """Two models; jobs of several states, targets, submitters and ages; two for key 1."""
    first, second = add_model(embedded_farm, "a.xml"), add_model(embedded_farm, "b.xml")
    old = now() - timedelta(days=3)
    return {
        "failed": add_job(embedded_farm, first, 1, state="failed", submitter="ci", created_at=old),
        "retry": add_job(embedded_farm, first, 1, submitter="ci"),
        "npu": add_job(
            embedded_farm, second, 2, target="NPU.4000", queue="compile.npu.4000", submitter="bob"
        ),
        "done": add_job(embedded_farm, second, 3, state="succeeded", created_at=old),
    }


def ids(rows) -> list[int]:
    return [row.id for row in rows]


def test_get_job_finds_a_job_or_raises_not_found(embedded_farm, jobs):
    with embedded_farm.session() as session:
        assert service.get_job(session, jobs["npu"]).target == "NPU.4000"
        with pytest.raises(NotFound, match=r"^no job 999$"):
            service.get_job(session, 999)


def test_the_latest_job_for_a_key_is_the_newest(embedded_farm, jobs):
    with embedded_farm.session() as session:
        assert latest_job_for_key(session, key(1)).id == jobs["retry"]
        assert latest_job_for_key(session, key("none")) is None


def test_jobs_are_listed_newest_first_up_to_the_limit(embedded_farm, jobs):
    with embedded_farm.session() as session:
        assert ids(list_jobs(session)) == [jobs["done"], jobs["npu"], jobs["retry"], jobs["failed"]]
        assert ids(list_jobs(session, limit=2)) == [jobs["done"], jobs["npu"]]


@pytest.mark.parametrize(
    ("filters", "expected"),
    [
        ({"state": "queued"}, ["npu", "retry"]),
        ({"target": "4000"}, ["npu"]),  # any spelling of the target
        ({"target": "cpu"}, ["done", "retry", "failed"]),
        ({"model": "a.xml"}, ["retry", "failed"]),  # by file name
        ({"submitter": "ci"}, ["retry", "failed"]),
        ({"cache_key": key(1)}, ["retry", "failed"]),
        ({"state": "queued", "submitter": "ci"}, ["retry"]),
    ],
)
def test_jobs_are_filtered(embedded_farm, jobs, filters, expected):
    with embedded_farm.session() as session:
        assert ids(list_jobs(session, **filters)) == [jobs[name] for name in expected]


def test_jobs_are_filtered_by_model_digest(embedded_farm, jobs):
    with embedded_farm.session() as session:
        model_id = service.get_job(session, jobs["npu"]).model_id
        model_digest = session.get_one(Model, model_id).digest
        assert ids(list_jobs(session, model=model_digest)) == [jobs["done"], jobs["npu"]]


def test_a_since_without_time_zone_is_utc(embedded_farm, jobs):
    since = (now() - timedelta(days=1)).replace(tzinfo=None)
    with embedded_farm.session() as session:
        assert ids(list_jobs(session, since=since)) == [jobs["npu"], jobs["retry"]]


def test_an_aware_since_is_taken_in_its_own_time_zone(embedded_farm, jobs):
    """Two hours ago, written in UTC+5: the same instant, so the same jobs."""
    since = (now() - timedelta(hours=2)).astimezone(timezone(timedelta(hours=5)))
    with embedded_farm.session() as session:
        assert ids(list_jobs(session, since=since)) == [jobs["npu"], jobs["retry"]]


def test_since_includes_a_job_created_at_that_very_instant(embedded_farm):
    model = add_model(embedded_farm)
    at = now() - timedelta(hours=1)
    job_id = add_job(embedded_farm, model, 1, created_at=at)
    with embedded_farm.session() as session:
        assert ids(list_jobs(session, since=at)) == [job_id]


def test_at_most_fifty_jobs_are_listed_by_default(embedded_farm):
    model = add_model(embedded_farm)
    with embedded_farm.session() as session:
        session.add_all(
            Job(
                cache_key=key(n),
                model_id=model,
                target="CPU",
                queue="compile.cpu",
                spec={},
                toolchain={},
                state="succeeded",
                created_at=now(),
            )
            for n in range(51)
        )
        session.commit()
        listed = ids(list_jobs(session))
    assert len(listed) == 50 and listed == sorted(listed, reverse=True)


@pytest.mark.postgres
def test_a_naive_since_is_utc_whatever_the_database_session_time_zone(
    tmp_path, monkeypatch, postgres_url
):
    """PostgreSQL reads a naive timestamp in the session's TimeZone: `list_jobs` must not
    hand it one (here the session is UTC-8, so a naive "two hours ago" would be in the future)."""
    upgrade_database(postgres_url)
    farm = open_farm(
        tmp_path / "farm",
        monkeypatch,
        database_url=f"{postgres_url}?options=-c%20TimeZone%3DEtc/GMT%2B8",
    )
    try:
        job_id = add_job(farm, add_model(farm), 1)
        since = (now() - timedelta(hours=2)).replace(tzinfo=None)
        with farm.session() as session:
            assert ids(list_jobs(session, since=since)) == [job_id]
    finally:
        close_farm(farm)
