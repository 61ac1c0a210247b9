"""The business rules: submit, run a job, resolve a cache key. Shared by the CLI, API and workers.

The database is the source of truth (DESIGN.md §6). A submission is a hit (the blob exists),
the job already queued or running for that cache key (single flight, enforced by a partial
unique index), or a new queued job. A job's blob row and its `succeeded` state are written in
one transaction, after the blob is stored and its sha256 known.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from farm import hashing
from farm.db.models import ACTIVE_STATES, Blob, Job, Model, Pull
from farm.errors import IntegrityMismatch, NotFound
from farm.identity import ModelInfo, ModelRef, key_for
from farm.spec import CompileSpec, Target, Toolchain
from farm.storage import BlobStore

log = logging.getLogger(__name__)

Outcome = Literal["hit", "existing", "queued"]


class ModelMissing(LookupError):
    """The store lacks model files a new job needs; upload them and submit again."""

    def __init__(self, missing: list[str]) -> None:
        super().__init__(f"the farm lacks model files {', '.join(missing)}; upload them first")
        self.missing = missing


@dataclass(frozen=True)
class Submission:
    outcome: Outcome
    cache_key: str
    job_id: int | None = None


def model_storage_key(sha256: str) -> str:
    return f"models/{sha256}"


def blob_storage_key(cache_key: str) -> str:
    return f"blobs/{cache_key}.blob"


def submit(
    session: Session,
    store: BlobStore,
    model: ModelInfo,
    spec: CompileSpec,
    toolchain: Toolchain,
    *,
    queue: str = "embedded",
    submitter: str | None = None,
    submission_id: str | None = None,
    max_attempts: int | None = None,
) -> Submission:
    """Return the hit, the active job for the same cache key, or a new queued job (committed).

    The caller sends a new job's message only after this commit (`farm.dispatch`). A new job
    needs the model's files in the store: ModelMissing names those it lacks. `max_attempts`:
    claims the new job gets (`Settings.max_attempts`); None: the column's default.
    """
    known = known_outcome(session, model.identity, spec, toolchain)
    if known is not None:
        return known
    key = key_for(model.identity, spec, toolchain)
    missing = missing_model_files(store, model.identity.values())
    if missing:
        raise ModelMissing(missing)
    model_row = register_model(session, model)
    job = Job(
        cache_key=key,
        model_id=model_row.id,
        target=spec.target.name,
        queue=queue,
        spec=spec.canonical(),
        toolchain=toolchain.key_part(spec.target),
        state="queued",
        submitter=submitter,
        submission_id=submission_id,
        created_at=now(),
    )
    if max_attempts is not None:
        job.max_attempts = max_attempts
    session.add(job)
    try:
        session.commit()
    except IntegrityError:
        # Another submitter inserted the active job for this key between our check and our
        # insert; the partial unique index refused ours. Theirs is the job to follow.
        session.rollback()
        active = _active_job_id(session, key)
        if active is None:
            raise
        return Submission("existing", key, active)
    return Submission("queued", key, job.id)


def known_outcome(
    session: Session, identity: Mapping[str, str], spec: CompileSpec, toolchain: Toolchain
) -> Submission | None:
    """The hit, or the active job for the same cache key; None when a new job is needed.
    Reads only the database: what `submit` answers before it needs the store."""
    key = key_for(identity, spec, toolchain)
    if session.scalar(select(Blob.id).where(Blob.cache_key == key)) is not None:
        return Submission("hit", key)
    active = _active_job_id(session, key)
    if active is not None:
        return Submission("existing", key, active)
    return None


def missing_model_files(store: BlobStore, digests: Iterable[str]) -> list[str]:
    """The digests among `digests` whose files the store lacks."""
    return sorted({sha for sha in digests if not store.exists(model_storage_key(sha))})


def upload_model_files(store: BlobStore, model: ModelRef, only: Iterable[str] | None = None):
    """Upload the model's files (those in `only`, or all), each verified against its digest."""
    wanted = set(model.identity.values()) if only is None else set(only)
    for role, path in model.files.items():
        sha = model.identity[role]
        if sha in wanted:
            store.put_file(model_storage_key(sha), path, expected_sha256=sha)


def submit_from_disk(
    session: Session, store: BlobStore, model: ModelRef, spec, toolchain, **kwargs
) -> Submission:
    """`submit`, uploading the model files the store lacks when a new job needs them."""
    try:
        return submit(session, store, model.info, spec, toolchain, **kwargs)
    except ModelMissing as missing:
        upload_model_files(store, model, missing.missing)
        return submit(session, store, model.info, spec, toolchain, **kwargs)


def register_model(session: Session, model: ModelInfo) -> Model:
    """The model's row, created on first sight."""
    digest = hashing.model_digest(model.identity)
    row = session.scalar(select(Model).where(Model.digest == digest))
    if row is not None:
        return row
    row = Model(
        digest=digest,
        format="onnx" if "onnx" in model.identity else "ir",
        files=dict(model.identity),
        size_bytes=model.size_bytes,
        name=model.name,
        created_at=now(),
    )
    try:
        with session.begin_nested():
            session.add(row)
    except IntegrityError:
        # Same model registered concurrently: use the row that won.
        return session.scalars(select(Model).where(Model.digest == digest)).one()
    return row


def resolve(session: Session, cache_key: str) -> Blob | None:
    return session.scalar(select(Blob).where(Blob.cache_key == cache_key))


def fetch_blob(store: BlobStore, blob: Blob, output: Path) -> None:
    """Copy a stored blob to `output`, verified against its recorded sha256, atomically."""
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = output.with_name(f".{output.name}.partial")
    try:
        store.get_file(blob.storage_key, partial)
        actual = hashing.sha256_file(partial)
        if actual != blob.sha256:
            raise IntegrityMismatch(
                f"blob {blob.cache_key} is corrupt in storage: sha256 {actual}, "
                f"recorded {blob.sha256}"
            )
        partial.replace(output)
    finally:
        partial.unlink(missing_ok=True)


def record_pull(
    session: Session,
    cache_key: str,
    agent_id: str,
    ok: bool,
    import_seconds: float | None = None,
    error: str | None = None,
) -> Pull:
    """An edge's report of one pull: who, how long the import took, ok or why not."""
    blob = resolve(session, cache_key)
    if blob is None:
        raise NotFound(f"no blob for cache key {cache_key}")
    pull = Pull(
        blob_id=blob.id,
        cache_key=cache_key,
        agent_id=agent_id,
        import_seconds=import_seconds,
        ok=ok,
        error=error,
        created_at=now(),
    )
    session.add(pull)
    session.commit()
    return pull


def cancel(session: Session, job_id: int) -> Job:
    """Cancel a job: a queued one never starts; a running one is stopped by its worker."""
    job = get_job(session, job_id)
    dropped = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.state == "queued")
        .values(
            state="cancelled",
            cancel_requested=True,
            finished_at=now(),
            error="cancelled before it started",
        )
    )
    if dropped.rowcount == 0:  # running (perhaps claimed a moment ago) or already finished
        session.execute(
            update(Job)
            .where(Job.id == job_id, Job.state == "running")
            .values(cancel_requested=True)
        )
    session.commit()
    session.refresh(job)
    return job


def get_job(session: Session, job_id: int) -> Job:
    job = session.get(Job, job_id)
    if job is None:
        raise NotFound(f"no job {job_id}")
    return job


def latest_job_for_key(session: Session, cache_key: str) -> Job | None:
    return session.scalar(
        select(Job).where(Job.cache_key == cache_key).order_by(Job.id.desc()).limit(1)
    )


def list_jobs(
    session: Session,
    state: str | None = None,
    target: str | None = None,
    limit: int = 50,
    *,
    model: str | None = None,
    submitter: str | None = None,
    since: datetime | None = None,
    cache_key: str | None = None,
) -> list[Job]:
    """Newest first. `model` is a model digest or a model's file name; a `since` without a
    time zone is UTC."""
    query = select(Job).order_by(Job.id.desc()).limit(limit)
    if state:
        query = query.where(Job.state == state)
    if target:
        query = query.where(Job.target == Target.parse(target).name)
    if model:
        query = query.join(Model, Model.id == Job.model_id).where(
            (Model.digest == model) | (Model.name == model)
        )
    if submitter:
        query = query.where(Job.submitter == submitter)
    if since:
        if since.tzinfo is None:
            since = since.replace(tzinfo=UTC)
        query = query.where(Job.created_at >= since)
    if cache_key:
        query = query.where(Job.cache_key == cache_key)
    return list(session.scalars(query))


def list_blobs(session: Session, target: str | None = None) -> list[Blob]:
    query = select(Blob).order_by(Blob.created_at.desc(), Blob.id.desc())
    if target:
        query = query.where(Blob.target == Target.parse(target).name)
    return list(session.scalars(query))


def _active_job_id(session: Session, key: str) -> int | None:
    return session.scalar(select(Job.id).where(Job.cache_key == key, Job.state.in_(ACTIVE_STATES)))


def now() -> datetime:
    return datetime.now(UTC)
