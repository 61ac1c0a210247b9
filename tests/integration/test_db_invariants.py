"""The schema refuses what the code must never write, on both dialects."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from sqlalchemy import update
from sqlalchemy.exc import DataError, IntegrityError
from sqlalchemy.orm import Session

from farm.server.db.models import Blob, Job, Model
from farm.server.db.session import make_engine, make_session_factory, upgrade_database

NOW = datetime(2026, 1, 1, tzinfo=UTC)
KEY = "ab" * 32


@pytest.fixture
def session(database_url):
    upgrade_database(database_url)
    engine = make_engine(database_url)
    with make_session_factory(engine)() as session:
        yield session
    engine.dispose()


def add_model(session: Session) -> Model:
    model = Model(
        digest="cd" * 32,
        format="ir",
        files={"xml": "1" * 64, "bin": "2" * 64},
        size_bytes=10,
        name="m.xml",
        created_at=NOW,
    )
    session.add(model)
    session.commit()
    return model


def job(model: Model, state: str = "queued", key: str = KEY) -> Job:
    return Job(
        cache_key=key,
        model_id=model.id,
        target="CPU",
        spec={},
        toolchain={},
        state=state,
        created_at=NOW,
    )


def blob(model: Model, key: str = KEY, sha256: str = "ef" * 32) -> Blob:
    return Blob(
        cache_key=key,
        model_id=model.id,
        target="CPU",
        spec={},
        toolchain={},
        openvino_version="2026.4.1",
        storage_key=f"blobs/{key}.blob",
        size_bytes=1,
        sha256=sha256,
        payload_offset=0,
        weightless=False,
        created_at=NOW,
    )


def refused(session: Session, row) -> bool:
    session.add(row)
    try:
        session.commit()
    except (IntegrityError, DataError):  # DataError: PostgreSQL refuses an over-long value
        session.rollback()
        return True
    return False


def test_one_active_job_per_cache_key(session):
    model = add_model(session)
    session.add(job(model))
    session.commit()
    assert refused(session, job(model))
    assert refused(session, job(model, state="running"))
    session.execute(update(Job).values(state="succeeded"))
    session.commit()
    assert not refused(session, job(model))  # a finished job does not block a new one
    assert not refused(session, job(model, state="failed"))


def test_blob_cache_key_is_unique(session):
    model = add_model(session)
    assert not refused(session, blob(model))
    assert refused(session, blob(model, sha256="12" * 32))


@pytest.mark.parametrize(
    "bad", ["AB" * 32, "ab" * 31, "zz" * 32, "ab" * 32 + "a", "", "ab" * 31 + "a "]
)
def test_sha256_columns_must_be_64_lowercase_hex(session, bad):
    model = add_model(session)
    assert refused(session, blob(model, key=bad))
    assert refused(session, blob(model, sha256=bad))
    assert refused(session, job(model, key=bad))


def test_job_state_is_checked(session):
    model = add_model(session)
    assert refused(session, job(model, state="exploded"))


def test_jobs_need_their_model(session):
    assert refused(
        session,
        Job(
            cache_key=KEY,
            model_id=999,
            target="CPU",
            spec={},
            toolchain={},
            state="queued",
            created_at=NOW,
        ),
    )
