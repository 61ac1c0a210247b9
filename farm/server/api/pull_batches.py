"""Pull reports of one API process, written to the database in batches.

An edge fleet reports every pull; one transaction per report made a report cost about eight
health checks (issue 30, bench/catalog.py). Here a report joins the batch being gathered while
the previous one is written, and a batch is one transaction: one query for the blobs' ids, one
multi-row INSERT, one commit. Under load the batches grow with the number of reports waiting,
so the database's cost per report falls; alone, a report is written at once.

Nothing is traded for it: each report is answered (201 and its id) only once its batch is
committed, as before, and one report's unknown key (404) fails only that report.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

from fastapi.concurrency import run_in_threadpool
from sqlalchemy import insert, select
from sqlalchemy.orm import Session

from farm.core.clock import now
from farm.core.errors import NotFound
from farm.server.db.models import Blob, Pull

MAX_BATCH = 500
"""Reports in one transaction at most."""


@dataclass(frozen=True)
class PullReport:
    cache_key: str
    agent_id: str
    ok: bool
    import_seconds: float | None = None
    error: str | None = None


class PullBatches:
    """Gathers this process's pull reports and writes them a batch at a time, on one task."""

    def __init__(self, session: Callable[[], AbstractContextManager[Session]]) -> None:
        self._session = session
        self._waiting: list[tuple[PullReport, asyncio.Future[int]]] = []
        self._writer: asyncio.Task[None] | None = None

    async def record(self, report: PullReport) -> int:
        """The new pull's id, once its batch is committed; NotFound for an unknown key."""
        answer: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._waiting.append((report, answer))
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._write_all())
        return await answer

    async def _write_all(self) -> None:
        while self._waiting:
            batch, self._waiting = self._waiting[:MAX_BATCH], self._waiting[MAX_BATCH:]
            try:
                ids = await run_in_threadpool(self._write, [report for report, _ in batch])
            except Exception as error:  # the database's error is each report's answer
                for _, answer in batch:
                    if not answer.done():
                        answer.set_exception(error)
                continue
            for (report, answer), pull_id in zip(batch, ids, strict=True):
                if answer.done():  # its request went away
                    continue
                if pull_id is None:
                    answer.set_exception(NotFound(f"no blob for cache key {report.cache_key}"))
                else:
                    answer.set_result(pull_id)

    def _write(self, reports: list[PullReport]) -> list[int | None]:
        """One transaction: the reports of known keys inserted, their ids in order (None for an
        unknown key)."""
        keys = {report.cache_key for report in reports}
        at = now()
        with self._session() as session:
            found = session.execute(select(Blob.cache_key, Blob.id).where(Blob.cache_key.in_(keys)))
            blob_ids = {cache_key: blob_id for cache_key, blob_id in found}
            rows = [
                {
                    "blob_id": blob_ids[report.cache_key],
                    "cache_key": report.cache_key,
                    "agent_id": report.agent_id,
                    "import_seconds": report.import_seconds,
                    "ok": report.ok,
                    "error": report.error,
                    "created_at": at,
                }
                for report in reports
                if report.cache_key in blob_ids
            ]
            inserted: list[int] = []
            if rows:
                query = insert(Pull).returning(Pull.id, sort_by_parameter_order=True)
                inserted = list(session.scalars(query, rows))
                session.commit()
        ids = iter(inserted)
        return [next(ids) if report.cache_key in blob_ids else None for report in reports]
