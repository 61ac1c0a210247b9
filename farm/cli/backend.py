"""Where the CLI's commands go: straight to the database and store (embedded, or an operator
on the farm's network), or through the HTTP API (`FARM_API_URL`). Both answer in the same
dicts (`farm.views`), so each command prints one way whatever the mode."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from farm.spec import CompileSpec, Toolchain

Progress = Callable[[int], None] | None
FINAL_STATES = ("succeeded", "failed", "cancelled")
WAIT_POLL_SECONDS = 0.5


class Direct:
    """Embedded (compiles here, now) or served without the API (queues for workers)."""

    def __init__(self, farm) -> None:
        self.farm = farm

    def submit(
        self,
        ref,
        specs: list[CompileSpec],
        toolchain: Toolchain,
        on_compile: Callable[[CompileSpec], Any],
    ) -> dict:
        import uuid

        from farm import compiler, identity, routing, service

        settings, results, submission_id = self.farm.settings, [], uuid.uuid4().hex
        with self.farm.session() as session:
            for spec in specs:
                key = identity.key_for(ref.identity, spec, toolchain)
                if not settings.served and service.resolve(session, key) is None:
                    # Embedded compiles here: refuse what this host cannot compile before
                    # anything is stored.
                    reason = compiler.unavailable_reason(spec.target)
                    if reason:
                        raise compiler.CompilerUnavailable(reason)
                queue = "embedded"
                if settings.served:
                    large = ref.size_bytes > settings.large_model_bytes
                    queue = routing.queue_name(spec.target, large)
                outcome = service.submit_from_disk(
                    session,
                    self.farm.store,
                    ref,
                    spec,
                    toolchain,
                    queue=queue,
                    submission_id=submission_id,
                    max_attempts=settings.max_attempts,
                )
                if outcome.outcome == "queued":
                    if settings.served:
                        self.farm.dispatcher().send(session, outcome.job_id, queue)
                    else:
                        with on_compile(spec):
                            self.farm.run(outcome.job_id)
                job = self.job(outcome.job_id) if outcome.job_id else None
                results.append(
                    {
                        "cache_key": outcome.cache_key,
                        "target": spec.target.name,
                        "outcome": outcome.outcome,
                        "job": job,
                    }
                )
        return {"submission_id": submission_id, "results": results}

    def job(self, job_id: int) -> dict:
        from farm import routing, service
        from farm.views import job_dict

        with self.farm.session() as session:
            job = service.get_job(session, job_id)
            note = routing.waiting_note(session, job, self.farm.settings.worker_heartbeat_seconds)
            return {**job_dict(job), "note": note}

    def jobs(self, **filters: Any) -> list[dict]:
        from farm import service
        from farm.views import job_dict

        with self.farm.session() as session:
            return [job_dict(job) for job in service.list_jobs(session, **filters)]

    def log(self, job_id: int) -> dict:
        """`{"id", "state", "log"}`, as `GET /v1/jobs/{id}/log` answers."""
        from farm import service

        with self.farm.session() as session:
            job = service.get_job(session, job_id)
            return {"id": job.id, "state": job.state, "log": job.log or job.error or ""}

    def cancel(self, job_id: int) -> dict:
        from farm import service
        from farm.views import job_dict

        with self.farm.session() as session:
            return job_dict(service.cancel(session, job_id))

    def resolve(self, cache_key: str) -> dict | None:
        from farm import service
        from farm.views import blob_dict

        with self.farm.session() as session:
            blob = service.resolve(session, cache_key)
            return blob_dict(blob) if blob else None

    def latest_job(self, cache_key: str) -> dict | None:
        from farm import service
        from farm.views import job_dict

        with self.farm.session() as session:
            job = service.latest_job_for_key(session, cache_key)
            return job_dict(job) if job else None

    def download(self, cache_key: str, dest: Path, progress: Progress = None) -> None:
        """Copy the stored blob to `dest` (the edge agent verifies it)."""
        from farm import service

        with self.farm.session() as session:
            blob = service.resolve(session, cache_key)
            if blob is None:
                raise service.NotFound(f"the farm has no blob for cache key {cache_key}")
            storage_key = blob.storage_key
        self.farm.store.get_file(storage_key, dest)
        if progress:
            progress(dest.stat().st_size)

    def report_pull(
        self,
        cache_key: str,
        agent_id: str,
        ok: bool,
        import_seconds: float | None = None,
        error: str | None = None,
    ) -> None:
        from farm import service

        with self.farm.session() as session:
            service.record_pull(session, cache_key, agent_id, ok, import_seconds, error)

    def blobs(self, target: str | None) -> list[dict]:
        from farm import service
        from farm.views import blob_dict

        with self.farm.session() as session:
            return [blob_dict(blob) for blob in service.list_blobs(session, target)]

    def workers(self) -> list[dict]:
        from farm import routing
        from farm.views import worker_dict

        with self.farm.session() as session:
            live = {
                w.name
                for w in routing.live_workers(session, self.farm.settings.worker_heartbeat_seconds)
            }
            return [worker_dict(w, w.name in live) for w in routing.all_workers(session)]


class Http:
    """Through the farm API: the submitter holds no database, broker or S3 credentials."""

    def __init__(self, client) -> None:
        self.client = client

    def submit(
        self, ref, specs: list[CompileSpec], toolchain: Toolchain, on_upload: Callable[[int], Any]
    ) -> dict:
        from farm.client import ApiError

        body = [{"target": spec.target.name, **spec.canonical()} for spec in specs]
        wire_toolchain = {
            "openvino": toolchain.openvino,
            "runtime_requirements": toolchain.runtime_requirements,
        }
        try:
            return self.client.submit(ref.identity, ref.name, body, wire_toolchain)
        except ApiError as error:
            if error.code != "model_missing":
                raise
        # A new job needs the model, and the farm lacks some of its files: upload only those.
        missing = set(self.client.missing(sorted(set(ref.identity.values()))))
        files = [(sha, ref.files[role]) for role, sha in ref.identity.items() if sha in missing]
        with on_upload(sum(path.stat().st_size for _, path in files)) as advance:
            for sha, path in files:
                self.client.upload(sha, path, advance)
        return self.client.submit(ref.identity, ref.name, body, wire_toolchain)

    def job(self, job_id: int) -> dict:
        return self.client.job(job_id)

    def jobs(self, **filters: Any) -> list[dict]:
        since = filters.get("since")
        if since is not None:
            filters["since"] = since.isoformat()
        return self.client.jobs(**filters)

    def log(self, job_id: int) -> dict:
        return self.client.job_log(job_id)

    def cancel(self, job_id: int) -> dict:
        return self.client.cancel(job_id)

    def resolve(self, cache_key: str) -> dict | None:
        return self.client.resolve(cache_key)

    def latest_job(self, cache_key: str) -> dict | None:
        jobs = self.client.jobs(cache_key=cache_key, limit=1)
        return jobs[0] if jobs else None

    def blobs(self, target: str | None) -> list[dict]:
        return self.client.blobs(target)

    def workers(self) -> list[dict]:
        return self.client.workers()


def wait_for(backend, job_id: int, on_state: Callable[[str], None]) -> dict:
    """Poll a job until it reaches a final state."""
    while True:
        job = backend.job(job_id)
        if job["state"] in FINAL_STATES:
            return job
        on_state(job["state"])
        time.sleep(WAIT_POLL_SECONDS)
