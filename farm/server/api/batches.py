"""An edge fleet's requests (resolve a key, report a pull), answered a batch at a time.

Every edge resolves the keys it computes and reports every pull; one database transaction per
request made a resolve cost about five health checks and a report eight (issue 30,
bench/catalog.py). Here a request joins the batch being gathered while the previous batch is
at the database: resolves are one `cache_key IN (...)` query (with the blobs' compression
stages), reports one query for the blobs' ids and one multi-row INSERT (one statement, so one
transaction), on a connection each kind of batch keeps, in autocommit (`KeptSessions`).
Under load the batches grow with the requests waiting, so the database's cost per request
falls; alone, a request goes at once.

Nothing is traded for it: a report is answered (201 and its id) only once its batch is
committed, as before, and one request's unknown key (404) fails only that request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, suppress
from dataclasses import dataclass
from typing import Generic, TypeVar

from fastapi.concurrency import run_in_threadpool
from sqlalchemy import Connection, and_, insert, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from farm.core.clock import now
from farm.core.errors import BlobQuarantined, NotFound
from farm.core.status import StatusSigner
from farm.server.api.schemas import BlobOut
from farm.server.blobs.service import refuse_quarantined
from farm.server.blobs.signatures import signed_status
from farm.server.context import FarmContext, database_errors
from farm.server.db.models import Blob, Job, Pull, StageOutput
from farm.server.views import COMPRESSION_KINDS, blob_dict, compression_of

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
        try:
            return write_once(reports)
        except IntegrityError:
            # A blob went (farm gc) between the read and the insert: nothing was inserted (one
            # statement); read again, and its reports are answered as for any missing blob.
            return write_once(reports)

    def write_once(reports: list[PullReport]) -> list[int | Exception]:
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


class KeptSessions:
    """Sessions on one connection kept by a kind of batch (its batches run one at a time), in
    autocommit: a batch then costs its statements' round trips alone, not a pool checkout with
    its ping (`pool_pre_ping`: a `SELECT 1` before each), a BEGIN and a COMMIT (issue 30: at 1M
    blobs the database's round trips were most of a resolve). A report batch's INSERT is one
    statement, so autocommit loses nothing; a connection that fails is dropped and the next
    batch opens another. PostgreSQL only (SQLite: the ordinary sessions, `farm.session`).
    `close()` when the API stops: the kept connection is the pool's no longer."""

    def __init__(self, farm: FarmContext) -> None:
        self.farm = farm
        self.engine = farm.sessions.kw["bind"]
        self.kept: list[Connection] = []

    @contextmanager
    def __call__(self) -> Iterator[Session]:
        if self.engine.dialect.name != "postgresql":
            with self.farm.session() as session:
                yield session
            return
        url = self.farm.settings.resolved_database_url
        if not self.kept or self.kept[0].closed or self.kept[0].invalidated:
            with database_errors(url):
                connection = self.engine.connect()
                self.kept[:] = [connection.execution_options(isolation_level="AUTOCOMMIT")]
        connection = self.kept[0]
        try:
            with database_errors(url), Session(connection, expire_on_commit=False) as opened:
                yield opened
        except BaseException:
            self.close()  # whatever went wrong, the next batch starts on a new connection
            raise

    def close(self) -> None:
        for connection in self.kept:
            with suppress(Exception):
                connection.close()
        self.kept.clear()


def resolve_batches(
    reads: Sessions, status_signer: Callable[[], StatusSigner | None]
) -> Batches[str, str]:
    """Cache keys in, their blobs out (`BlobOut` as JSON, encoded on the thread pool), each
    with its status (ok or quarantined) signed now (`signatures.signed_status`)."""

    def read(keys: list[str]) -> list[str | Exception]:
        signer = status_signer()
        with reads() as session:
            # The blobs and their compression stages in one query (not one more per batch).
            rows = session.execute(
                select(Blob, StageOutput)
                .outerjoin(Job, Job.id == Blob.job_id)
                .outerjoin(
                    StageOutput,
                    and_(
                        StageOutput.stage_key == Job.stage_key,
                        StageOutput.kind.in_(COMPRESSION_KINDS),
                    ),
                )
                .where(Blob.cache_key.in_(set(keys)))
            ).all()
            found = [blob for blob, _ in rows]
            compressed = {blob.id: compression_of(stage) for blob, stage in rows if stage}
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
