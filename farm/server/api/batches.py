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
from farm.core.errors import BlobQuarantined, NotFound
from farm.core.status import StatusSigner
from farm.server.api.schemas import BlobOut
from farm.server.blobs.service import refuse_quarantined
from farm.server.blobs.signatures import signed_status
from farm.server.db.models import Blob, Pull
from farm.server.views import blob_dict, compressions

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
    """Pull reports in, their new ids out. An ok pull of a quarantined blob is refused
    (BlobQuarantined, 409): edges refuse such a blob, so the report is false."""

    def write(reports: list[PullReport]) -> list[int | Exception]:
        at = now()
        with sessions() as session:
            blobs = _blobs(session, {report.cache_key for report in reports})
            refused = {
                index: _refusal(blobs.get(report.cache_key), report)
                for index, report in enumerate(reports)
            }
            rows = [
                {
                    "blob_id": blobs[report.cache_key].id,
                    "cache_key": report.cache_key,
                    "agent_id": report.agent_id,
                    "import_seconds": report.import_seconds,
                    "ok": report.ok,
                    "error": report.error,
                    "created_at": at,
                }
                for index, report in enumerate(reports)
                if refused[index] is None
            ]
            inserted: list[int] = []
            if rows:
                query = insert(Pull).returning(Pull.id, sort_by_parameter_order=True)
                inserted = list(session.scalars(query, rows))
                session.commit()
        ids = iter(inserted)
        return [refused[index] or next(ids) for index in range(len(reports))]

    return Batches(write)


def _refusal(blob: Blob | None, report: PullReport) -> Exception | None:
    if blob is None:
        return _no_blob(report.cache_key)
    if report.ok:
        try:
            refuse_quarantined(blob)
        except BlobQuarantined as error:
            return error
    return None


def resolve_batches(
    reads: Sessions, status_signer: Callable[[], StatusSigner | None]
) -> Batches[str, str]:
    """Cache keys in, their blobs out (`BlobOut` as JSON, encoded on the thread pool), each
    with its status (ok or quarantined) signed now (`signatures.signed_status`)."""

    def read(keys: list[str]) -> list[str | Exception]:
        signer = status_signer()
        with reads() as session:
            found = list(session.scalars(select(Blob).where(Blob.cache_key.in_(set(keys)))))
            compressed = compressions(session, found)
            blobs = {
                blob.cache_key: BlobOut(
                    **blob_dict(blob, compressed.get(blob.id)),
                    status=signed_status(blob, signer),
                ).model_dump_json()
                for blob in found
            }
        return [blobs[key] if key in blobs else _no_blob(key) for key in keys]

    return Batches(read)


def _blobs(session: Session, keys: set[str]) -> dict[str, Blob]:
    found = session.scalars(select(Blob).where(Blob.cache_key.in_(keys)))
    return {blob.cache_key: blob for blob in found}


def _no_blob(cache_key: str) -> NotFound:
    return NotFound(f"no blob for cache key {cache_key}")
