"""The stage phase of a job: run (or reuse) each stage of its recipe before the compile.

Called by the job runner (`farm.server.jobs.runner`) with the job's source model row. Each
stage is claimed in the catalog (single flight), run in the sandbox's child with the compile's
limits (`sandbox.stage_in_child`), its output IR stored as ordinary model files
(``models/<sha256>``) and registered as a `models` row, then recorded done. A stage recorded
done is reused, never run again; a job waiting on another job's stage polls, renewing its own
lease (the job runner's), and fails with that stage's reason if it fails.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from farm.core import sources
from farm.core.errors import CompileCancelled, ConversionError
from farm.core.hashing import sha256_file
from farm.core.identity import ModelInfo
from farm.core.stages import Stage, recipe_from_json, stage_keys
from farm.server.db.models import Job, Model
from farm.server.jobs.sandbox import stage_in_child
from farm.server.stages import catalog
from farm.server.storage import BlobStore, model_storage_key

log = logging.getLogger(__name__)

WAIT_POLL_SECONDS = 1.0
"""How often a job waiting on another job's stage looks at it again."""
Fetch = Callable[[Model, Path], dict[str, Path]]
"""Fetches a model row's files into a folder (laid out by `sources.layout`)."""


@dataclass(frozen=True)
class StageLimits:
    lease_seconds: int
    timeout_seconds: float
    memory_bytes: int | None
    max_output_bytes: int
    compile_user: str | None
    allow_remote_code: bool


@dataclass(frozen=True)
class Prepared:
    """The model the compile reads: its files here, its models row; what the phase did."""

    files: dict[str, Path]
    model: Model
    ran: list[str]
    """Stage keys this job ran (the others were reused or waited for)."""


def run_recipe(
    sessions: sessionmaker[Session],
    store: BlobStore,
    job: Job,
    source: Model,
    work_dir: Path,
    fetch: Fetch,
    should_stop: Callable[[], bool],
    limits: StageLimits,
) -> Prepared:
    """Run or reuse every stage of `job.recipe` on `source`; the last stage's output."""
    recipe = recipe_from_json(job.recipe)
    keys = stage_keys(source.files, recipe)
    current, current_key, local = source, None, None
    ran = []
    for index, (stage, key) in enumerate(zip(recipe, keys, strict=True)):
        folder = work_dir / f"stage-{index}"
        current, local = _one_stage(
            sessions, store, job, stage, key, current, current_key, folder, fetch, should_stop,
            limits,
        )  # fmt: skip
        if local is not None:
            ran.append(key)
        current_key = key
    if local is None:
        local = fetch(current, work_dir / "compile-input")
    return Prepared(local, current, ran)


def _one_stage(
    sessions: sessionmaker[Session],
    store: BlobStore,
    job: Job,
    stage: Stage,
    key: str,
    input_row: Model,
    input_key: str | None,
    folder: Path,
    fetch: Fetch,
    should_stop: Callable[[], bool],
    limits: StageLimits,
) -> tuple[Model, dict[str, Path] | None]:
    """The stage's output model row, and its files here when this job ran it (else None)."""
    waited_on: int | None = None
    while True:
        if should_stop():
            raise CompileCancelled("compile cancelled")
        with sessions() as session:
            if waited_on is not None:
                row = catalog.find(session, key)
                if row is not None and row.state == catalog.FAILED:
                    raise ConversionError(f"{stage.kind} failed in job {row.job_id}: {row.error}")
            claimed = catalog.claim(
                session,
                key,
                stage.kind,
                stage.args,
                input_model_id=None if input_key else input_row.id,
                input_stage_key=input_key,
                job_id=job.id,
                lease_seconds=limits.lease_seconds,
            )
            if claimed.action == "reuse":
                output = session.get_one(Model, claimed.row.output_model_id)
                session.expunge(output)
                return output, None
            if claimed.action == "wait":
                waited_on = claimed.row.job_id
        if claimed.action == "wait":
            time.sleep(WAIT_POLL_SECONDS)
            continue
        return _run_here(sessions, store, job, stage, key, input_row, folder, fetch, should_stop,
                         limits)  # fmt: skip


def _run_here(
    sessions: sessionmaker[Session],
    store: BlobStore,
    job: Job,
    stage: Stage,
    key: str,
    input_row: Model,
    folder: Path,
    fetch: Fetch,
    should_stop: Callable[[], bool],
    limits: StageLimits,
) -> tuple[Model, dict[str, Path]]:
    started = time.perf_counter()
    try:
        files = fetch(input_row, folder / "input")
        with _renewing(sessions, key, job.id, limits.lease_seconds):
            result = stage_in_child(
                stage.kind,
                files,
                sources.layout(input_row.files),
                stage.args,
                folder / "out",
                key,
                timeout_seconds=limits.timeout_seconds,
                memory_bytes=limits.memory_bytes,
                max_output_bytes=limits.max_output_bytes,
                compile_user=limits.compile_user,
                should_stop=should_stop,
                options={
                    "allow_remote_code": limits.allow_remote_code,
                    "source_name": input_row.name,
                },
            )
    except BaseException as error:
        with sessions() as session:
            catalog.fail(session, key, job.id, str(error) or type(error).__name__)
        raise
    outputs = {"xml": result.xml, "bin": result.bin}
    identity = {role: sha256_file(path) for role, path in outputs.items()}
    for role, path in outputs.items():
        store_key = model_storage_key(identity[role])
        if not store.exists(store_key):
            store.put_file(store_key, path, expected_sha256=identity[role])
    size = sum(path.stat().st_size for path in outputs.values())
    seconds = time.perf_counter() - started
    # The service registers rows; imported here: it imports the runner's neighbours.
    from farm.server.jobs.service import register_model

    with sessions() as session:
        name = f"{input_row.name} ({stage.kind})"
        output = register_model(session, ModelInfo(identity, name, size))
        session.commit()
        recorded = catalog.finish(
            session,
            key,
            job.id,
            output_model_id=output.id,
            output_files=identity,
            tool_versions=result.tool_versions,
            metrics={**result.metrics, "output_bytes": size},
            seconds=seconds,
        )
        if not recorded:
            log.warning("stage %s was taken over while job %s ran it", key, job.id)
        session.expunge(output)
    log.info("job %s ran stage %s (%s) in %.1f s", job.id, stage.kind, key[:12], seconds)
    return output, outputs


@contextmanager
def _renewing(
    sessions: sessionmaker[Session], key: str, job_id: int, lease_seconds: int
) -> Iterator[None]:
    """Renew the stage's lease while it runs (every third of the lease)."""
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(lease_seconds / 3):
            try:
                with sessions() as session:
                    catalog.renew(session, key, job_id, lease_seconds)
            except Exception:
                log.warning("renewing stage %s failed", key, exc_info=True)

    thread = threading.Thread(target=renew, name=f"stage-{key[:8]}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def stage_summary(prepared: Prepared) -> dict[str, Any]:
    return {"stages_run": len(prepared.ran), "model_id": prepared.model.id}
