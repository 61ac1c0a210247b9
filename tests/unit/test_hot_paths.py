"""An edge fleet's two requests (issue 30, item 6): resolves and pull reports are answered in
batches (a pull report is one statement outside the API), reads in autocommit; all answer as
before."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from sqlalchemy import select

from farm.core.errors import NotFound
from farm.server.api.batches import PullReport, pull_batches, resolve_batches
from farm.server.api.schemas import BlobOut
from farm.server.blobs import service
from farm.server.db.models import Pull
from farm.server.views import blob_dict
from tests.unit.conftest import add_blob, add_model, key


def test_a_read_session_is_autocommit_and_resolves_a_blob(embedded_farm):
    add_blob(embedded_farm, add_model(embedded_farm), key(1))
    with embedded_farm.read() as session:
        assert session.connection().get_execution_options()["isolation_level"] == "AUTOCOMMIT"
        blob = service.resolve(session, key(1))
        assert blob is not None and blob.cache_key == key(1)
        assert service.resolve(session, key(2)) is None
    with embedded_farm.session() as session:  # the pool's connections keep their own level
        assert "isolation_level" not in session.connection().get_execution_options()


def test_a_pull_report_is_recorded_with_the_blobs_id_and_returns_its_own(embedded_farm):
    blob = add_blob(embedded_farm, add_model(embedded_farm), key(1))
    with embedded_farm.session() as session:
        first = service.record_pull(session, key(1), "edge-1", True, 0.25)
        second = service.record_pull(session, key(1), "edge-2", False, error="device lost")
    assert second == first + 1
    with embedded_farm.session() as session:
        rows = session.execute(
            select(
                Pull.id, Pull.blob_id, Pull.cache_key, Pull.agent_id, Pull.ok, Pull.error
            ).order_by(Pull.id)
        ).all()
        created = session.scalar(select(Pull.created_at).where(Pull.id == first))
    assert [tuple(row) for row in rows] == [
        (first, blob.id, key(1), "edge-1", True, None),
        (second, blob.id, key(1), "edge-2", False, "device lost"),
    ]
    assert created is not None and created.tzinfo is not None


def test_a_pull_report_of_an_unknown_key_is_not_found_and_records_nothing(embedded_farm):
    with embedded_farm.session() as session:
        with pytest.raises(NotFound, match=f"no blob for cache key {key(9)}"):
            service.record_pull(session, key(9), "edge-1", True)
        assert session.scalars(select(Pull)).all() == []


def test_pull_reports_sent_together_are_written_in_batches_and_each_gets_its_answer(
    embedded_farm,
):
    blob = add_blob(embedded_farm, add_model(embedded_farm), key(1))
    other = add_blob(embedded_farm, add_model(embedded_farm, "n"), key(2))
    transactions: list[int] = []

    @contextlib.contextmanager
    def counted_session():
        transactions.append(1)
        with embedded_farm.session() as session:
            yield session

    batches = pull_batches(counted_session)
    reports = [PullReport(key(1 + n % 2), f"edge-{n}", n % 3 != 0, 0.5) for n in range(30)]
    unknown = PullReport(key(9), "edge-x", True)

    async def send_all() -> list[int | BaseException]:
        return await asyncio.gather(
            *(batches.ask(report) for report in [*reports, unknown]), return_exceptions=True
        )

    *ids, refused = asyncio.run(send_all())
    assert isinstance(refused, NotFound) and key(9) in str(refused)
    assert len(set(ids)) == 30 and all(isinstance(pull_id, int) for pull_id in ids)
    assert len(transactions) == 1  # all were waiting when the writer started: one batch
    with embedded_farm.session() as session:
        rows = {
            row.id: (row.blob_id, row.agent_id, row.ok) for row in session.scalars(select(Pull))
        }
    assert {pull_id: rows[pull_id] for pull_id in ids} == {
        pull_id: ((blob if n % 2 == 0 else other).id, f"edge-{n}", n % 3 != 0)
        for n, pull_id in enumerate(ids)
    }


def test_resolves_asked_together_are_one_query_and_each_gets_its_blob(embedded_farm):
    add_blob(embedded_farm, add_model(embedded_farm), key(1))
    add_blob(embedded_farm, add_model(embedded_farm, "n"), key(2))
    transactions: list[int] = []

    @contextlib.contextmanager
    def counted_read():
        transactions.append(1)
        with embedded_farm.read() as session:
            yield session

    resolves = resolve_batches(counted_read, lambda: None)  # no status key: no signed status

    async def ask_all() -> list[str | BaseException]:
        asked = [key(1), key(2), key(9), key(1)]
        return await asyncio.gather(*map(resolves.ask, asked), return_exceptions=True)

    first, second, unknown, again = asyncio.run(ask_all())
    assert transactions == [1]
    with embedded_farm.session() as session:
        expected = {
            n: BlobOut(**blob_dict(service.require(session, key(n)))).model_dump_json()
            for n in (1, 2)
        }
    assert (first, second, again) == (expected[1], expected[2], expected[1])
    assert isinstance(unknown, NotFound) and key(9) in str(unknown)
