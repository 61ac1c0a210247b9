"""Rows as plain dicts: the one shape jobs and blobs take in CLI output and API answers."""

from __future__ import annotations

from typing import Any


def job_dict(job) -> dict[str, Any]:
    return {
        "id": job.id,
        "cache_key": job.cache_key,
        "target": job.target,
        "state": job.state,
        "queue": job.queue,
        "worker": job.worker,
        "submitter": job.submitter,
        "submission_id": job.submission_id,
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


def blob_dict(blob) -> dict[str, Any]:
    return {
        "cache_key": blob.cache_key,
        "target": blob.target,
        "model": dict(blob.model.files),
        "openvino": blob.openvino_version,
        "toolchain": blob.toolchain,
        "size_bytes": blob.size_bytes,
        "sha256": blob.sha256,
        "payload_offset": blob.payload_offset,
        "spec": blob.spec,
        "weightless": blob.weightless,
        "signature": blob.signature,
        "signing_key_id": blob.signing_key_id,
        "compile_seconds": blob.compile_seconds,
        "export_seconds": blob.export_seconds,
        "created_at": blob.created_at,
    }


def worker_dict(worker, live: bool) -> dict[str, Any]:
    return {
        "name": worker.name,
        "host": worker.host,
        "live": live,
        "queues": worker.queues,
        "targets": worker.targets,
        "openvino": worker.openvino_version,
        "memory_bytes": worker.memory_bytes,
        "heartbeat_at": worker.heartbeat_at,
        "stopped_at": worker.stopped_at,
    }
