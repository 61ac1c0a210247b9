"""The CLI's light reads (farm/server/db/reads.py, SQLAlchemy Core) answer exactly what the ORM
services shaped by `farm.server.views` answer (the API's answers), page by page and filter by
filter, on a real SQLite farm."""

from __future__ import annotations

from datetime import timedelta

import pytest

from farm.cli.backends.direct import Direct
from farm.core.clock import now
from farm.core.vocabulary import EMBEDDED_QUEUE
from farm.server import views
from farm.server.blobs import service as blob_service
from farm.server.db import models, reads
from farm.server.db.models import JobPhase, StageOutput
from farm.server.jobs import service as job_service
from tests.unit.conftest import add_blob, add_job, add_model, key, set_job

HEARTBEAT = 30


def test_each_column_read_has_its_models_name_and_type():
    for table in reads.metadata.sorted_tables:
        full = models.Base.metadata.tables[table.name]
        for column in table.columns:
            model_column = full.c[column.name]
            assert type(column.type) is type(model_column.type), (table.name, column.name)
            assert getattr(column.type, "length", None) == getattr(
                model_column.type, "length", None
            ), (table.name, column.name)


@pytest.fixture
def farm_with_rows(embedded_farm):
    """Two models; jobs of every kind (states, targets, submitters, ages, queues); blobs, one of
    a compressed model (a stage output), and a job with timed phases."""
    farm = embedded_farm
    first, second = add_model(farm, "first.xml"), add_model(farm, "second.xml")
    start = now() - timedelta(days=3)
    for n in range(12):
        add_job(
            farm,
            first if n % 3 else second,
            n,
            state=("queued", "running", "succeeded", "failed")[n % 4],
            target="CPU" if n % 2 else "NPU.4000",
            queue=EMBEDDED_QUEUE if n % 5 else "compile.cpu",
            submitter=f"token-{n % 2}",
            created_at=start + timedelta(hours=n),
            error="it broke" if n % 4 == 3 else None,
        )
    stage_key = key("stage")
    with farm.session() as session:
        session.add(
            StageOutput(
                stage_key=stage_key,
                kind="compress",
                input_model_id=first,
                args={"mode": "int4_sym"},
                tool_versions={"nncf": "2.0"},
                metrics={"ratio": 0.25, "size_before": 400, "size_after": 100},
                state="running",
                created_at=now(),
            )
        )
        session.commit()
    compressed = add_job(farm, first, "compressed", state="succeeded", stage_key=stage_key)
    timed = add_job(
        farm,
        second,
        "timed",
        state="succeeded",
        queue=EMBEDDED_QUEUE,
        attempts=2,
        started_at=now() - timedelta(seconds=30),
        created_at=now() - timedelta(seconds=40),
    )
    with farm.session() as session:
        for attempt, phase, seconds in ((1, "compile", 9.0), (2, "fetch", 0.5), (2, "compile", 3)):
            session.add(
                JobPhase(
                    job_id=timed, attempt=attempt, phase=phase, started_at=now(), seconds=seconds
                )
            )
        session.commit()
    for n in range(7):
        add_blob(
            farm,
            first if n % 2 else second,
            key(f"blob {n}"),
            created_at=start + timedelta(minutes=n // 2),  # ties: the cursor's second part
            target="CPU" if n % 3 else "NPU.4000",
        )
    blob = add_blob(farm, first, key("compressed"))
    with farm.session() as session:
        session.get(models.Blob, blob.id).job_id = compressed
        session.commit()
    return farm


def _orm_jobs(farm, size, cursor=None, **filters):
    with farm.session() as session:
        rows = job_service.list_jobs(session, limit=size, cursor=cursor, **filters)
        return views.job_rows(session, rows)


@pytest.mark.parametrize(
    "filters",
    [
        {},
        {"state": "failed"},
        {"target": "4000"},
        {"model": "first.xml"},
        {"submitter": "token-1"},
        {"since": now() - timedelta(days=2)},
        {"state": "queued", "target": "CPU", "model": "second.xml"},
    ],
)
def test_job_pages_are_the_orms(farm_with_rows, filters):
    light = reads.Reads(farm_with_rows.engine, farm_with_rows.settings.resolved_database_url)
    cursor, pages = None, 0
    while True:
        rows, following = light.jobs_page(4, cursor, **filters)
        assert rows == _orm_jobs(farm_with_rows, 4, cursor, **filters)
        pages += 1
        if following is None:
            break
        cursor = following
    assert pages > 1 or len(rows) < 4


@pytest.mark.parametrize("target", [None, "CPU", "NPU.4000"])
def test_blob_pages_are_the_orms(farm_with_rows, target):
    light = reads.Reads(farm_with_rows.engine, farm_with_rows.settings.resolved_database_url)
    cursor, seen = None, []
    while True:
        rows, following = light.blobs_page(target, 3, cursor)
        with farm_with_rows.session() as session:
            found = blob_service.list_blobs(session, target, 3, cursor)
            expected = [
                views.blob_dict(b, views.compressions(session, found).get(b.id)) for b in found
            ]
            assert following == blob_service.page_cursor(found, 3)
        assert rows == expected
        seen += rows
        if following is None:
            break
        cursor = following
    assert seen and all(target is None or row["target"] == target for row in seen)
    compressed = [row["compression"] for row in seen if row["compression"]]
    assert target == "NPU.4000" or compressed[0]["args"] == {"mode": "int4_sym"}


def test_a_blob_its_keys_and_its_latest_job_are_the_orms(farm_with_rows):
    light = reads.Reads(farm_with_rows.engine, farm_with_rows.settings.resolved_database_url)
    for cache_key in (key("compressed"), key("blob 3"), key(4), key("none")):
        with farm_with_rows.session() as session:
            blob = blob_service.resolve(session, cache_key)
            expected = blob and views.blob_dict(blob, views.compression_dict(session, blob))
            latest = job_service.latest_job_for_key(session, cache_key)
            assert light.latest_job(cache_key) == (latest and views.job_dict(latest))
            for prefix in (cache_key[:8], cache_key[:1], ""):
                assert light.cache_keys(prefix, 4) == blob_service.cache_keys_starting_with(
                    session, prefix, 4
                )
        found = light.blob(cache_key)
        assert (found and found[1]) == expected


def test_a_jobs_view_is_the_orms_with_its_phases_and_notes(farm_with_rows):
    """Embedded jobs through the light reads; a job queued for workers through the ORM (its
    note weighs the live workers): `Direct.job` answers what `GET /v1/jobs/{id}` does."""
    direct = Direct(farm_with_rows)
    set_job(farm_with_rows, 1, sent_at=None)  # queued for workers, never sent: it has a note
    with farm_with_rows.session() as session:
        ids = [job.id for job in job_service.list_jobs(session, limit=100)]
    assert len(ids) == 14
    for job_id in ids:
        with farm_with_rows.session() as session:
            job = job_service.get_job(session, job_id)
            expected = views.job_view(session, job, HEARTBEAT)
        assert direct.job(job_id) == expected
    notes = [direct.job(job_id)["note"] for job_id in ids]
    assert any(notes)
    timed = direct.job(ids[0])
    assert [p["phase"] for p in timed["phases"]] == ["queued", "fetch", "compile"]
