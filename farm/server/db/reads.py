"""The read queries of the CLI's listing commands (`farm jobs`, `farm blobs`, `farm status`) on
SQLAlchemy Core: the same rows and the same dicts (`farm.server.views` shapes both) as the ORM
services, without loading the ORM and its declarative models, which cost a read command more
than its query (issue 30, item 4; bench/startup.py).

The rows are typed `Any`: the views read them by attribute, as they read the ORM's rows.
The tables here name only the columns these reads use, each with the type of its model's
column (`tests/unit/test_cli_startup.py` checks them against `farm.server.db.models`): the
models stay the schema, this is a view of part of it.

What these reads cannot answer alone goes back to the ORM services: the note of a job queued
for workers (`farm.server.routing` weighs what the live workers serve).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    Connection,
    Engine,
    Float,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    and_,
    or_,
    select,
)

from farm.core import keyprefix
from farm.core.vocabulary import EMBEDDED_QUEUE, JobState
from farm.server import pagination
from farm.server.db.session import database_errors
from farm.server.db.types import UTCDateTime
from farm.server.views import COMPRESSION_KINDS, blob_dict, compression_of, job_dict

metadata = MetaData()

models = Table(
    "models",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("digest", String(64)),
    Column("files", JSON),
    Column("name", Text),
)
jobs = Table(
    "jobs",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("cache_key", String(64)),
    Column("model_id", Integer),
    Column("target", String(16)),
    Column("queue", String(64)),
    Column("spec", JSON),
    Column("toolchain", JSON),
    Column("state", String(16)),
    Column("submitter", Text),
    Column("submission_id", Text),
    Column("attempts", Integer),
    Column("error", Text),
    Column("worker", Text),
    Column("cancelled_by", Text),
    Column("created_at", UTCDateTime),
    Column("sent_at", UTCDateTime),
    Column("started_at", UTCDateTime),
    Column("finished_at", UTCDateTime),
    Column("compile_seconds", Float),
    Column("export_seconds", Float),
    Column("peak_rss_bytes", BigInteger),
    Column("stage_key", String(64)),
)
blobs = Table(
    "blobs",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("cache_key", String(64)),
    Column("job_id", Integer),
    Column("model_id", Integer),
    Column("target", String(16)),
    Column("spec", JSON),
    Column("toolchain", JSON),
    Column("openvino_version", String(32)),
    Column("size_bytes", BigInteger),
    Column("sha256", String(64)),
    Column("payload_offset", Integer),
    Column("weightless", Boolean),
    Column("compile_seconds", Float),
    Column("export_seconds", Float),
    Column("created_at", UTCDateTime),
    Column("signature", Text),
    Column("signing_key_id", String(16)),
    Column("manifest_signature", Text),
    Column("reference_sha256", String(64)),
    Column("reference_size_bytes", BigInteger),
    Column("reference_signature", Text),
    Column("part_bytes", BigInteger),
    Column("part_sha256s", JSON),
    Column("parts_signature", Text),
    Column("reference_note", Text),
    Column("reference_state", String(16)),
    Column("reference_lease_expires_at", UTCDateTime),
    Column("quarantined_at", UTCDateTime),
    Column("quarantine_reason", Text),
)
stage_outputs = Table(
    "stage_outputs",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("stage_key", String(64)),
    Column("kind", String(32)),
    Column("args", JSON),
    Column("tool_versions", JSON),
    Column("metrics", JSON),
)
job_phases = Table(
    "job_phases",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("job_id", Integer),
    Column("attempt", Integer),
    Column("phase", String(16)),
    Column("seconds", Float),
)


class Reads:
    """The read queries, each on a connection of its own from `engine`'s pool."""

    def __init__(self, engine: Engine, url: str) -> None:
        self.engine = engine
        self.url = url
        """The URL as configured: what an error names (masked), as the ORM sessions' do."""

    @contextmanager
    def _connection(self) -> Iterator[Connection]:
        with database_errors(self.url), self.engine.connect() as connection:
            yield connection

    # --- jobs ----------------------------------------------------------------------------------

    def job(self, job_id: int) -> Any | None:
        """The job's row (None: no such job)."""
        with self._connection() as db:
            return db.execute(select(jobs).where(jobs.c.id == job_id)).first()

    @staticmethod
    def needs_routing(job: Any) -> bool:
        """Whether the job's note needs the live workers (`farm.server.routing`): a job queued
        for workers; an embedded job is run by the farm itself and says nothing."""
        return job.state == JobState.QUEUED and job.queue != EMBEDDED_QUEUE

    def job_view(self, job: Any) -> dict[str, Any]:
        """`views.job_view` of a job that needs no routing note."""
        with self._connection() as db:
            name = db.scalar(select(models.c.name).where(models.c.id == job.model_id))
            phases = db.execute(
                select(job_phases.c.phase, job_phases.c.seconds)
                .where(job_phases.c.job_id == job.id, job_phases.c.attempt == job.attempts)
                .order_by(job_phases.c.id)
            ).all()
        queued = []
        if job.started_at is not None:
            queued = [
                {"phase": "queued", "seconds": (job.started_at - job.created_at).total_seconds()}
            ]
        return {
            **job_dict(job, name),
            "note": None,
            "phases": queued + [{"phase": phase, "seconds": seconds} for phase, seconds in phases],
        }

    def jobs_page(
        self,
        limit: int,
        cursor: str | None = None,
        *,
        state: str | None = None,
        target: str | None = None,
        model: str | None = None,
        submitter: str | None = None,
        since: datetime | None = None,
    ) -> tuple[list[dict[str, Any]], str | None]:
        """`jobs.service.list_jobs` shaped by `views.job_rows`, and the cursor of the next page
        (None after the last)."""
        query = select(jobs).order_by(jobs.c.id.desc()).limit(limit)
        if cursor:
            query = query.where(jobs.c.id < pagination.after_job(cursor))
        if state:
            query = query.where(jobs.c.state == state)
        if target:
            query = query.where(jobs.c.target == _target_name(target))
        if model:
            query = query.join(models, models.c.id == jobs.c.model_id).where(
                (models.c.digest == model) | (models.c.name == model)
            )
        if submitter:
            query = query.where(jobs.c.submitter == submitter)
        if since:
            if since.tzinfo is None:
                since = since.replace(tzinfo=UTC)
            query = query.where(jobs.c.created_at >= since)
        with self._connection() as db:
            rows: list[Any] = list(db.execute(query))
            names = _model_names(db, {row.model_id for row in rows})
        following = pagination.job_cursor(rows[-1].id) if len(rows) == limit else None
        return [job_dict(row, names.get(row.model_id)) for row in rows], following

    def latest_job(self, cache_key: str) -> dict[str, Any] | None:
        """`views.job_dict` of the newest job of `cache_key`."""
        query = select(jobs).where(jobs.c.cache_key == cache_key)
        with self._connection() as db:
            row: Any = db.execute(query.order_by(jobs.c.id.desc()).limit(1)).first()
        return None if row is None else job_dict(row)

    # --- blobs ---------------------------------------------------------------------------------

    def cache_keys(self, prefix: str, limit: int) -> list[str]:
        """`blobs.service.cache_keys_starting_with` (blobs and jobs)."""
        upper = keyprefix.upper_bound(prefix)
        found: set[str] = set()
        with self._connection() as db:
            for column in (blobs.c.cache_key, jobs.c.cache_key):
                query = select(column).where(column >= prefix, column < upper).distinct()
                found.update(db.scalars(query.order_by(column).limit(limit)))
        return sorted(found)[:limit]

    def blob(self, cache_key: str) -> tuple[Any, dict[str, Any]] | None:
        """The blob of `cache_key` (its row, which `signatures.signed_status` takes) and its
        `views.blob_dict`; None when there is none."""
        with self._connection() as db:
            row = db.execute(_blobs_query().where(blobs.c.cache_key == cache_key)).first()
            if row is None:
                return None
            found = _compressions(db, [row])
        blob = _with_model(row)
        return blob, blob_dict(blob, found.get(row.id))

    def blobs_page(
        self, target: str | None, limit: int, cursor: str | None = None
    ) -> tuple[list[dict[str, Any]], str | None]:
        """`blobs.service.list_blobs` shaped by `views.blob_dict`, and the cursor of the next
        page (None after the last)."""
        query = _blobs_query().order_by(blobs.c.created_at.desc(), blobs.c.id.desc()).limit(limit)
        if target:
            query = query.where(blobs.c.target == _target_name(target))
        if cursor:
            created_at, blob_id = pagination.after_blob(cursor)
            query = query.where(
                or_(
                    blobs.c.created_at < created_at,
                    and_(blobs.c.created_at == created_at, blobs.c.id < blob_id),
                )
            )
        with self._connection() as db:
            rows = db.execute(query).all()
            found = _compressions(db, rows)
        following = None
        if len(rows) == limit:
            following = pagination.blob_cursor(rows[-1].created_at, rows[-1].id)
        return [blob_dict(_with_model(row), found.get(row.id)) for row in rows], following


def _target_name(text: str) -> str:
    """The canonical name of the target `text` names (``4000``: ``NPU.4000``)."""
    from farm.core.spec import Target  # only to filter by target

    return Target.parse(text).name


def _model_names(db: Connection, ids: set[int]) -> dict[int, str]:
    if not ids:
        return {}
    rows = db.execute(select(models.c.id, models.c.name).where(models.c.id.in_(ids)))
    return {model_id: name for model_id, name in rows}


def _blobs_query() -> Any:
    """Blobs with their model's files and name (what `blob_dict` reads of `blob.model`)."""
    return select(
        blobs, models.c.files.label("model_files"), models.c.name.label("model_name")
    ).join(models, models.c.id == blobs.c.model_id)


def _with_model(row: Any) -> Any:
    """A blob row as `blob_dict` reads it: its columns, and its model as `blob.model`."""
    fields = dict(row._mapping)
    model = SimpleNamespace(files=fields.pop("model_files"), name=fields.pop("model_name"))
    return SimpleNamespace(**fields, model=model)


def _compressions(db: Connection, rows: Sequence[Any]) -> dict[int, dict[str, Any]]:
    """`views.compressions` of a page of blob rows, by blob id."""
    job_ids = {row.job_id: row.id for row in rows if row.job_id is not None}
    if not job_ids:
        return {}
    query = (
        select(jobs.c.id.label("compressed_job"), stage_outputs)
        .join(stage_outputs, stage_outputs.c.stage_key == jobs.c.stage_key)
        .where(jobs.c.id.in_(job_ids), stage_outputs.c.kind.in_(COMPRESSION_KINDS))
    )
    found: Iterable[Any] = db.execute(query)
    return {job_ids[row.compressed_job]: compression_of(row) for row in found}
