"""The business rules: submit, run a job, resolve a cache key. Shared by the CLI, API and workers.

The database is the source of truth (DESIGN.md §6). A submission is a hit (the blob exists),
the job already queued or running for that cache key (single flight, enforced by a partial
unique index), or a new queued job. A job's blob row and its `succeeded` state are written in
one transaction, after the blob is stored and its sha256 known.
"""

from __future__ import annotations

import logging
import shutil
import socket
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Literal

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from farm import hashing
from farm.db.models import ACTIVE_STATES, Blob, Job, Model
from farm.spec import CompileSpec, Target, Toolchain
from farm.storage import BlobStore

log = logging.getLogger(__name__)

LEASE = timedelta(minutes=10)
"""How long a claimed job stays with its worker without a renewal."""

Outcome = Literal["hit", "existing", "queued"]


class NotFound(LookupError):
    """No job or blob by that id or cache key."""


class IntegrityMismatch(Exception):
    """Stored bytes do not match their recorded sha256."""


@dataclass(frozen=True)
class ModelRef:
    """A model on the submitter's disk: its files by role, their digests, its display name."""

    files: dict[str, Path]
    identity: dict[str, str]
    name: str

    @classmethod
    def from_path(cls, path: str | Path, progress: Callable[[int], None] | None = None):
        files = hashing.model_files(path)
        return cls(files, hashing.model_identity(files, progress), Path(path).name)

    @property
    def size_bytes(self) -> int:
        return sum(file.stat().st_size for file in self.files.values())


@dataclass(frozen=True)
class Submission:
    outcome: Outcome
    cache_key: str
    job_id: int | None = None


def model_storage_key(sha256: str) -> str:
    return f"models/{sha256}"


def blob_storage_key(cache_key: str) -> str:
    return f"blobs/{cache_key}.blob"


def key_for(identity: Mapping[str, str], spec: CompileSpec, toolchain: Toolchain) -> str:
    return hashing.cache_key(
        identity, spec.target.name, spec.canonical(), toolchain.key_part(spec.target)
    )


def submit(
    session: Session,
    store: BlobStore,
    model: ModelRef,
    spec: CompileSpec,
    toolchain: Toolchain,
    *,
    submitter: str | None = None,
    submission_id: str | None = None,
) -> Submission:
    """Return the hit, the active job for the same cache key, or a new queued job (committed)."""
    key = key_for(model.identity, spec, toolchain)
    if session.scalar(select(Blob.id).where(Blob.cache_key == key)) is not None:
        return Submission("hit", key)
    active = _active_job_id(session, key)
    if active is not None:
        return Submission("existing", key, active)

    model_row = store_model(session, store, model)
    job = Job(
        cache_key=key,
        model_id=model_row.id,
        target=spec.target.name,
        spec=spec.canonical(),
        toolchain=toolchain.key_part(spec.target),
        state="queued",
        submitter=submitter,
        submission_id=submission_id,
        created_at=_now(),
    )
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


def store_model(session: Session, store: BlobStore, model: ModelRef) -> Model:
    """Upload the model files the store lacks (content-addressed) and return the model row."""
    for role, path in model.files.items():
        storage_key = model_storage_key(model.identity[role])
        if not store.exists(storage_key):
            store.put_file(storage_key, path, expected_sha256=model.identity[role])
    digest = hashing.model_digest(model.identity)
    row = session.scalar(select(Model).where(Model.digest == digest))
    if row is not None:
        return row
    row = Model(
        digest=digest,
        format="onnx" if "onnx" in model.files else "ir",
        files=dict(model.identity),
        size_bytes=model.size_bytes,
        name=model.name,
        created_at=_now(),
    )
    try:
        with session.begin_nested():
            session.add(row)
    except IntegrityError:
        # Same model registered concurrently: use the row that won.
        return session.scalars(select(Model).where(Model.digest == digest)).one()
    return row


def claim(session: Session, job_id: int, worker: str) -> bool:
    """Take a queued job (or one whose lease expired) for `worker`; False if someone has it."""
    now = _now()
    claimable = (Job.state == "queued") | ((Job.state == "running") & (Job.lease_expires_at < now))
    result = session.execute(
        update(Job)
        .where(Job.id == job_id, claimable, Job.cancel_requested.is_(False))
        .values(
            state="running",
            worker=worker,
            started_at=now,
            lease_expires_at=now + LEASE,
            attempts=Job.attempts + 1,
        )
    )
    session.commit()
    return result.rowcount == 1


def run_job(
    session: Session,
    store: BlobStore,
    job_id: int,
    *,
    worker: str | None = None,
    work_root: Path | None = None,
) -> Job:
    """Claim, compile, store and record one job; returns the job row in its final state.

    Compile errors (bad model, spec that does not fit, compiler missing) fail the job with the
    compiler's message. Anything else (storage, database) propagates for the caller to retry.
    """
    from farm import compiler  # OpenVINO is loaded only where jobs really run

    worker = worker or socket.gethostname()
    job = session.get(Job, job_id)
    if job is None:
        raise NotFound(f"no job {job_id}")
    if not claim(session, job_id, worker):
        session.refresh(job)
        return job
    session.refresh(job)
    spec = CompileSpec.from_canonical(job.target, job.spec)
    model_row = session.get(Model, job.model_id)
    work_dir = Path(tempfile.mkdtemp(prefix=f"farm-job-{job_id}-", dir=work_root))
    try:
        files = _fetch_model(store, model_row, work_dir)
        try:
            result = compiler.compile_to_file(files, spec, work_dir / "out", job.cache_key)
            _check_toolchain(job, result.toolchain, spec.target)
        except (compiler.CompileError, compiler.CompilerUnavailable) as error:
            return _finish_failed(session, job, str(error))
        stored = store.put_file(blob_storage_key(job.cache_key), result.blob_path)
        return _finish_succeeded(session, job, model_row, result, stored.sha256, stored.size)
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)


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


def get_job(session: Session, job_id: int) -> Job:
    job = session.get(Job, job_id)
    if job is None:
        raise NotFound(f"no job {job_id}")
    return job


def latest_job_for_key(session: Session, cache_key: str) -> Job | None:
    return session.scalar(
        select(Job).where(Job.cache_key == cache_key).order_by(Job.id.desc()).limit(1)
    )


def list_blobs(session: Session, target: str | None = None) -> list[Blob]:
    query = select(Blob).order_by(Blob.created_at.desc(), Blob.id.desc())
    if target:
        query = query.where(Blob.target == Target.parse(target).name)
    return list(session.scalars(query))


def _active_job_id(session: Session, key: str) -> int | None:
    return session.scalar(select(Job.id).where(Job.cache_key == key, Job.state.in_(ACTIVE_STATES)))


def _fetch_model(store: BlobStore, model_row: Model, work_dir: Path) -> dict[str, Path]:
    """Model files as paths the compiler can read: the store's own files when it is local."""
    suffix = {"xml": ".xml", "bin": ".bin", "onnx": ".onnx"}
    files = {}
    for role, sha in model_row.files.items():
        key = model_storage_key(sha)
        local = store.local_path(key)
        if local is None:
            local = work_dir / f"model{suffix[role]}"
            store.get_file(key, local)
        files[role] = local
    return files


def _check_toolchain(job: Job, produced: Toolchain, target: Target) -> None:
    """Never record a blob under a key whose toolchain is not the one that produced it."""
    from farm.compiler import CompileError

    if produced.key_part(target) != job.toolchain:
        raise CompileError(
            f"this host's toolchain {produced.key_part(target)} differs from the job's "
            f"{job.toolchain}; the job must run on a host with that toolchain"
        )


def _finish_failed(session: Session, job: Job, message: str) -> Job:
    session.execute(
        update(Job)
        .where(Job.id == job.id, Job.state == "running")
        .values(state="failed", error=message, log=message, finished_at=_now())
    )
    session.commit()
    session.refresh(job)
    return job


def _finish_succeeded(session, job, model_row, result, sha256: str, size: int) -> Job:
    now = _now()
    timings = {
        "compile_seconds": result.compile_seconds,
        "export_seconds": result.export_seconds,
    }
    session.add(
        Blob(
            cache_key=job.cache_key,
            job_id=job.id,
            model_id=model_row.id,
            target=job.target,
            spec=job.spec,
            toolchain=result.toolchain.as_dict(),
            openvino_version=result.toolchain.openvino,
            storage_key=blob_storage_key(job.cache_key),
            size_bytes=size,
            sha256=sha256,
            payload_offset=result.payload_offset,
            weightless=bool(job.spec.get("weightless")),
            created_at=now,
            **timings,
        )
    )
    session.execute(
        update(Job)
        .where(Job.id == job.id)
        .values(
            state="succeeded",
            finished_at=now,
            peak_rss_bytes=result.peak_rss_bytes,
            log=_job_log(result),
            **timings,
        )
    )
    session.commit()
    session.refresh(job)
    return job


def _job_log(result) -> str:
    lines = [f"{key}={value}" for key, value in sorted(result.properties.items())]
    lines.append(f"toolchain={result.toolchain.as_dict()}")
    lines.append(
        f"compile {result.compile_seconds:.3f}s, export {result.export_seconds:.3f}s, "
        f"peak RSS {result.peak_rss_bytes / 2**20:.0f} MiB, blob {result.size_bytes} bytes"
    )
    return "\n".join(lines)


def _now() -> datetime:
    return datetime.now(UTC)
