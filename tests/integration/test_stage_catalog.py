"""Single flight of stages in the real catalog (`stage_outputs`, SQLite and PostgreSQL): one job
runs a stage, a concurrent one waits and reuses it, a dead job's stage is taken over, a failed
stage fails its waiters and is tried again by the next job (docs/architecture.md §15)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import update
from sqlalchemy.exc import IntegrityError

from farm.core.clock import now
from farm.core.identity import ModelInfo
from farm.core.spec import CompileSpec, Toolchain
from farm.server.db.models import Job, StageOutput
from farm.server.db.session import make_engine, make_session_factory, upgrade_database
from farm.server.jobs.service import register_model
from farm.server.stages import catalog

KEY = "ab" * 32
ARGS = {"format": "tflite"}


@pytest.fixture
def sessions(database_url):
    upgrade_database(database_url)
    engine = make_engine(database_url)
    yield make_session_factory(engine)
    engine.dispose()


@pytest.fixture
def setup(sessions):
    """A source model and two jobs that both need its convert stage."""
    with sessions() as session:
        source = register_model(session, ModelInfo({"tflite": "cd" * 32}, "m.tflite", 10))
        output = register_model(session, ModelInfo({"xml": "ef" * 32, "bin": "01" * 32}, "ir", 9))
        spec = CompileSpec.create("CPU")
        toolchain = Toolchain("2026.4.1", runtime_requirements="rr").key_part(spec.target)
        jobs = []
        for index in range(2):
            job = Job(
                cache_key=f"{index:064x}",
                model_id=source.id,
                target="CPU",
                spec=spec.canonical(),
                toolchain=toolchain,
                state="running",
                created_at=now(),
            )
            session.add(job)
            jobs.append(job)
        session.commit()
        return source.id, output.id, [job.id for job in jobs]


def _claim(sessions, source_id, job_id, lease=60):
    with sessions() as session:
        claimed = catalog.claim(
            session,
            KEY,
            "convert",
            ARGS,
            input_model_id=source_id,
            input_stage_key=None,
            job_id=job_id,
            lease_seconds=lease,
        )
        return claimed.action, claimed.row.job_id


def test_one_job_runs_a_stage_the_other_waits_then_reuses_it(sessions, setup):
    source_id, output_id, (first, second) = setup
    assert _claim(sessions, source_id, first) == ("run", first)
    assert _claim(sessions, source_id, second) == ("wait", first)
    with sessions() as session:
        assert catalog.finish(
            session,
            KEY,
            first,
            output_model_id=output_id,
            output_files={"xml": "ef" * 32, "bin": "01" * 32},
            tool_versions={"openvino": "2026.4.1"},
            metrics={"seconds": 1.0},
            seconds=1.0,
        )
    assert _claim(sessions, source_id, second) == ("reuse", first)
    with sessions() as session:
        rows = session.query(StageOutput).all()
        assert [(r.state, r.output_model_id, r.job_id) for r in rows] == [
            ("done", output_id, first)
        ]


def test_a_dead_jobs_stage_is_taken_over(sessions, setup):
    source_id, _, (first, second) = setup
    assert _claim(sessions, source_id, first)[0] == "run"
    with sessions() as session:  # the first job's worker died: its lease ran out
        session.execute(update(StageOutput).values(lease_expires_at=now() - timedelta(seconds=1)))
        session.commit()
    assert _claim(sessions, source_id, second) == ("run", second)
    with sessions() as session:  # the first job, back from the dead, may not record it
        assert not catalog.finish(
            session,
            KEY,
            first,
            output_model_id=1,
            output_files={},
            tool_versions={},
            metrics={},
            seconds=0,
        )


def test_a_failed_stage_records_its_reason_and_is_tried_again(sessions, setup):
    source_id, _, (first, second) = setup
    assert _claim(sessions, source_id, first)[0] == "run"
    with sessions() as session:
        catalog.fail(session, KEY, first, "cannot convert m.tflite (tflite): bad file")
        row = catalog.find(session, KEY)
        assert (row.state, row.error, row.output_model_id) == (
            "failed",
            "cannot convert m.tflite (tflite): bad file",
            None,
        )
        assert catalog.done_output(session, KEY) is None  # nothing half-made to reuse
    assert _claim(sessions, source_id, second) == ("run", second)


def test_a_done_stage_needs_its_output(sessions, setup):
    """The database refuses a 'done' row without an output model (CHECK done_output)."""
    source_id, _, (first, _) = setup
    _claim(sessions, source_id, first)
    with sessions() as session, pytest.raises(IntegrityError):
        session.execute(update(StageOutput).values(state="done"))
        session.commit()
