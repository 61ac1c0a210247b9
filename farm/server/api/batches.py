"""An edge fleet's requests (resolve a key, report a pull), answered a batch at a time.

Every edge resolves the keys it computes and reports every pull; one database transaction per
request made a resolve cost about five health checks and a report eight (issue 30,
bench/catalog.py). Here a request joins the batch being gathered while the previous batch is
at the database, and a batch is one transaction: resolves are one `cache_key IN (...)` query,
reports one query for the blobs' ids and one multi-row INSERT. Under load the batches grow with
the requests waiting, so the database's cost per request falls; alone, a request goes at once.

Nothing is traded for it: a report is answered (201 and its id) only once its batch is
committed, as before, and one request's unknown key (404) fails only that request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Generic, TypeVar

from fastapi.concurrency import run_in_threadpool
from sqlalchemy import insert, select
from sqlalchemy.orm import Session

from farm.core.clock import now
from farm.core.errors import NotFound
from farm.server.api.schemas import BlobOut
from farm.server.db.models import Blob, Pull
from farm.server.views import blob_dict

MAX_BATCH = 500
"""Requests in one transaction at most."""

Sessions = Callable[[], AbstractContextManager[Session]]
Asked = TypeVar("Asked")
Answer = TypeVar("Answer")


class Batches(Generic[Asked, Answer]):
    """Gathers this process's requests of one kind and answers them a batch at a time, on one
    task: `answer_all` (run on the thread pool) answers a batch, each with a value or an error."""

    def __init__(self, answer_all: Callable[[list[Asked]], list[Answer | Exception]]) -> None:
        self._answer_all = answer_all
        self._waiting: list[tuple[Asked, asyncio.Future[Answer]]] = []
        self._worker: asyncio.Task[None] | None = None

    async def ask(self, asked: Asked) -> Answer:
        answer: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        self._waiting.append((asked, answer))
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._answer_waiting())
        return await answer

    async def _answer_waiting(self) -> None:
        while self._waiting:
            batch, self._waiting = self._waiting[:MAX_BATCH], self._waiting[MAX_BATCH:]
            try:
                answers = await run_in_threadpool(self._answer_all, [asked for asked, _ in batch])
            except Exception as error:  # the database's error is each request's answer
                answers = [error] * len(batch)
            for (_, answer), value in zip(batch, answers, strict=True):
                if answer.done():  # its request went away
                    continue
                if isinstance(value, Exception):
                    answer.set_exception(value)
                else:
                    answer.set_result(value)


@dataclass(frozen=True)
class PullReport:
    cache_key: str
    agent_id: str
    ok: bool
    import_seconds: float | None = None
    error: str | None = None


def pull_batches(sessions: Sessions) -> Batches[PullReport, int]:
    """Pull reports in, their new ids out."""

    def write(reports: list[PullReport]) -> list[int | Exception]:
        at = now()
        with sessions() as session:
            blob_ids = _blob_ids(session, {report.cache_key for report in reports})
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
        return [
            next(ids) if report.cache_key in blob_ids else _no_blob(report.cache_key)
            for report in reports
        ]

    return Batches(write)


def resolve_batches(reads: Sessions) -> Batches[str, str]:
    """Cache keys in, their blobs out (`BlobOut` as JSON, encoded on the thread pool)."""

    def read(keys: list[str]) -> list[str | Exception]:
        with reads() as session:
            found = session.scalars(select(Blob).where(Blob.cache_key.in_(set(keys))))
            blobs = {blob.cache_key: BlobOut(**blob_dict(blob)).model_dump_json() for blob in found}
        return [blobs[key] if key in blobs else _no_blob(key) for key in keys]

    return Batches(read)


def _blob_ids(session: Session, keys: set[str]) -> dict[str, int]:
    found = session.execute(select(Blob.cache_key, Blob.id).where(Blob.cache_key.in_(keys)))
    return {cache_key: blob_id for cache_key, blob_id in found}


def _no_blob(cache_key: str) -> NotFound:
    return NotFound(f"no blob for cache key {cache_key}")
