"""Rows as plain dicts: the one shape jobs, logs, blobs and workers take in CLI output and API
answers. The direct CLI and the API both build their answers here, so they cannot drift apart.

The shaping functions (`job_dict`, `blob_dict`, ...) read attributes only: they take ORM rows
and the CLI's light Core rows alike (`farm.server.db.reads`), so this module loads the ORM only
in the functions that query through it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from sqlalchemy import select

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from farm.server.db.models import Blob, Job, StageOutput, Verification, Worker


def model_names(session: Session, jobs: Iterable[Job]) -> dict[int, str]:
    """The file names of the models of `jobs`: one query for a whole page."""
    from farm.server.db.models import Model

    ids = {job.model_id for job in jobs}
    if not ids:
        return {}
    rows = session.execute(select(Model.id, Model.name).where(Model.id.in_(ids)))
    return {model_id: name for model_id, name in rows}


def job_dict(job: Job, model_name: str | None = None) -> dict[str, Any]:
    return {
        "id": job.id,
        "model_name": model_name,
        "cache_key": job.cache_key,
        "target": job.target,
        "toolchain": job.toolchain,
        "state": job.state,
        "queue": job.queue,
        "worker": job.worker,
        "submitter": job.submitter,
        "submission_id": job.submission_id,
        "cancelled_by": job.cancelled_by,
        "spec": job.spec,
        "error": job.error,
        "attempts": job.attempts,
        "created_at": job.created_at,
        "started_at": job.started_at,
        "finished_at": job.finished_at,
        "compile_seconds": job.compile_seconds,
        "export_seconds": job.export_seconds,
        "peak_rss_bytes": job.peak_rss_bytes,
    }


def blob_dict(blob: Blob, compression: dict[str, Any] | None = None) -> dict[str, Any]:
    """A blob as API answers and CLI output show it; `compression`: `compression_dict` of it
    (or of a page: `compressions`), never read here (no query per row of a listing)."""
    return {
        "cache_key": blob.cache_key,
        "target": blob.target,
        "model": dict(blob.model.files),
        "model_name": blob.model.name,
        "openvino": blob.openvino_version,
        "toolchain": blob.toolchain,
        "size_bytes": blob.size_bytes,
        "sha256": blob.sha256,
        "payload_offset": blob.payload_offset,
        "spec": blob.spec,
        "weightless": blob.weightless,
        "signature": blob.signature,
        "signing_key_id": blob.signing_key_id,
        "manifest_signature": blob.manifest_signature,
        "compile_seconds": blob.compile_seconds,
        "export_seconds": blob.export_seconds,
        "created_at": blob.created_at,
        "reference_sha256": blob.reference_sha256,
        "reference_size_bytes": blob.reference_size_bytes,
        "reference_signature": blob.reference_signature,
        "part_bytes": blob.part_bytes,
        "part_sha256s": blob.part_sha256s,
        "parts_signature": blob.parts_signature,
        "reference_note": blob.reference_note,
        "reference_state": blob.reference_state,
        "quarantined_at": blob.quarantined_at,
        "quarantine_reason": blob.quarantine_reason,
        "compression": compression,
    }


COMPRESSION_KINDS = ("compress", "quantize")


def compressions(session: Session, blobs: Sequence[Blob]) -> dict[int, dict[str, Any]]:
    """`compression_dict` of many blobs in one query (the dashboard's page), by blob id."""
    from farm.server.db.models import Job, StageOutput

    job_ids = {blob.job_id: blob.id for blob in blobs if blob.job_id is not None}
    if not job_ids:
        return {}
    rows = session.execute(
        select(Job.id, StageOutput)
        .join(StageOutput, StageOutput.stage_key == Job.stage_key)
        .where(Job.id.in_(job_ids), StageOutput.kind.in_(COMPRESSION_KINDS))
    )
    return {job_ids[job_id]: compression_of(row) for job_id, row in rows}


def compression_dict(session: Session, blob: Blob) -> dict[str, Any] | None:
    """How the model the blob was compiled from was compressed (docs §15): the stage, its
    args, the sizes and drift it measured, NNCF's version; None when it was not."""
    from farm.server.db.models import Job, StageOutput

    if blob.job_id is None:
        return None
    row = session.scalar(
        select(StageOutput)
        .join(Job, Job.stage_key == StageOutput.stage_key)
        .where(Job.id == blob.job_id, StageOutput.kind.in_(COMPRESSION_KINDS))
    )
    return None if row is None else compression_of(row)


def compression_of(row: StageOutput) -> dict[str, Any]:
    metrics = dict(row.metrics or {})
    return {
        "kind": row.kind,
        "stage_key": row.stage_key,
        "args": row.args,
        "metrics": {
            name: metrics.get(name)
            for name in ("size_before", "size_after", "ratio", "weights", "resolved", "drift")
        },
        "tool_versions": row.tool_versions or {},
    }


def verification_dict(verification: Verification) -> dict[str, Any]:
    return {
        "id": verification.id,
        "cache_key": verification.cache_key,
        "blob_sha256": verification.blob_sha256,
        "target": verification.target,
        "agent_id": verification.agent_id,
        "device_name": verification.device_name,
        "openvino_version": verification.openvino_version,
        "driver_version": verification.driver_version,
        "passed": verification.passed,
        "max_abs_error": verification.max_abs_error,
        "mean_abs_error": verification.mean_abs_error,
        "min_cosine": verification.min_cosine,
        "runs": verification.runs,
        "latency_p50_ms": verification.latency_p50_ms,
        "latency_p90_ms": verification.latency_p90_ms,
        "latency_min_ms": verification.latency_min_ms,
        "import_seconds": verification.import_seconds,
        "peak_rss_bytes": verification.peak_rss_bytes,
        "tolerance": verification.tolerance,
        "outputs": verification.outputs,
        "error": verification.error,
        "created_at": verification.created_at,
    }


def worker_dict(worker: Worker, live: bool) -> dict[str, Any]:
    return {
        "name": worker.name,
        "host": worker.host,
        "live": live,
        "queues": worker.queues,
        "targets": worker.targets,
        "toolchains": worker.toolchains,
        "converters": worker.converters,
        "openvino": worker.openvino_version,
        "memory_bytes": worker.memory_bytes,
        "heartbeat_at": worker.heartbeat_at,
        "stopped_at": worker.stopped_at,
    }


def job_view(session: Session, job: Job, heartbeat_seconds: int) -> dict[str, Any]:
    """A job as `farm status` and `GET /v1/jobs/{id}` show it: with the note of a queued job
    that no live worker can take, and where its last attempt's time went (its phases)."""
    from farm.server.jobs.phases import phases_of

    return {**job_views(session, [job], heartbeat_seconds)[0], "phases": phases_of(session, job)}


def job_views(
    session: Session, jobs: Sequence[Job], heartbeat_seconds: int
) -> list[dict[str, Any]]:
    """`job_view` of each job of a page, with what they share read once: the model names
    (one query) and the live workers (one query), not one query per job."""
    from farm.server import routing

    names = model_names(session, jobs)
    notes = routing.waiting_notes(session, jobs, heartbeat_seconds)
    return [{**job_dict(job, names.get(job.model_id)), "note": notes[job.id]} for job in jobs]


def job_rows(session: Session, jobs: Sequence[Job]) -> list[dict[str, Any]]:
    """`job_dict` of each job of a page, with its model's name (one query for the page)."""
    names = model_names(session, jobs)
    return [job_dict(job, names.get(job.model_id)) for job in jobs]


def log_view(job: Job) -> dict[str, Any]:
    """`{"id", "state", "log"}`: the compiler's log, or the error of a job that never ran."""
    return {"id": job.id, "state": job.state, "log": job.log or job.error or ""}


def workers_view(
    session: Session, heartbeat_seconds: int, limit: int, after: str | None = None
) -> list[dict[str, Any]]:
    """A page of registered workers by name (after the worker named `after`), each marked
    live or not."""
    from farm.server import routing

    live = {w.name for w in routing.live_workers(session, heartbeat_seconds)}
    return [worker_dict(w, w.name in live) for w in routing.workers_page(session, limit, after)]
