"""The stage phase of a job: run (or reuse) each stage of its recipe before the compile.

Called by the job runner (`farm.server.jobs.runner`) with the job's source model row. Each
stage is claimed in the catalog (single flight), run in the sandbox's child with the compile's
limits (`sandbox.stage_in_child`), its output IR stored as ordinary model files
(``models/<sha256>``) and registered as a `models` row, then recorded done. A stage recorded
done is reused, never run again; a job waiting on another job's stage polls, renewing its own
lease (the job runner's), and fails with that stage's reason if it fails.

A `compress` or `quantize` stage's drift (issue 27 item 4) is its own step: measured in a
sandboxed child of its own after the compression's child has ended (`sandbox.drift_in_child`),
timed as the job's `drift` phase (carved out of the stage phase), and recorded in the stage's
metrics before the stage is done: a stage row is reusable only with its drift recorded.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from farm.core import compression, sources
from farm.core.errors import (
    AlreadyStored,
    ChecksumMismatch,
    CompileCancelled,
    CompileError,
    ConversionError,
)
from farm.core.hashing import sha256_file
from farm.core.identity import ModelInfo
from farm.core.spec import CompileSpec
from farm.core.stages import Stage, recipe_from_json, stage_keys
from farm.server.db.models import Job, Model
from farm.server.jobs import phases
from farm.server.jobs.sandbox import StageRun, drift_in_child, stage_in_child
from farm.server.leases import Renewing
from farm.server.stages import catalog
from farm.server.stages import drift as drift_step
from farm.server.storage import BlobStore, LocalPaths, model_storage_key

log = logging.getLogger(__name__)

WAIT_POLL_SECONDS = 1.0
"""How often a job waiting on another job's stage looks at it again."""
OUTPUT_XML_NAME = {"xml": "model.xml", "bin": "model.bin"}
"""The names of a compression stage's output IR files where its drift child reads them."""
Fetch = Callable[[Model, Path], dict[str, Path]]
"""Fetches a model row's files into a folder (laid out by `sources.layout`)."""
Storing = Future[tuple[Model, dict[str, Path]]]
"""A stage's output being stored beside the job's blob upload: its models row and files."""


@dataclass(frozen=True)
class StageLimits:
    lease_seconds: int
    timeout_seconds: float
    memory_bytes: int | None
    max_output_bytes: int
    compile_user: str | None
    allow_remote_code: bool
    compile_launcher: Path | None = None


@dataclass(frozen=True)
class Prepared:
    """The model the compile reads: its files here, its models row; what the phase did."""

    files: dict[str, Path]
    model: Model | None
    """None while `storing`."""
    ran: list[str]
    """Stage keys this job ran (the others were reused or waited for)."""
    compiled: Any = None
    """With `run_recipe`'s `compile_spec`, when this job ran its one convert stage: the
    `CompileResult` of that same child, or the compile's error (to raise as a compile's)."""
    output: str = ""
    """That child's output (the compiler's, for the job log)."""
    storing: Storing | None = None
    """When that child compiled: its output IR being stored and the stage recorded, in a
    thread, while the job stores the blob (`settled` waits for it): both are a hash and a flush
    of hundreds of MB, one core each."""

    def settled(self) -> Prepared:
        """This, with the stage's output stored and the stage recorded: `files` are the
        stored IR's, `model` its row. Raises what storing it raised."""
        if self.storing is None:
            return self
        model, files = self.storing.result()
        return replace(self, files=files, model=model, storing=None)


def run_recipe(
    sessions: sessionmaker[Session],
    store: BlobStore,
    job: Job,
    source: Model,
    work_dir: Path,
    fetch: Fetch,
    should_stop: Callable[[], bool],
    limits: StageLimits,
    compile_spec: tuple[CompileSpec, str] | None = None,
) -> Prepared:
    """Run or reuse every stage of `job.recipe` on `source`; the last stage's output.
    `compile_spec` (spec, blob id): a recipe of one `convert` that this job runs is compiled
    in the converting child too (`Prepared.compiled`); a reused stage is left to the compile."""
    recipe = recipe_from_json(job.recipe)
    keys = stage_keys(source.files, recipe)
    current, current_key, local = source, None, None
    ran = []
    one_child = compile_spec if len(recipe) == 1 and recipe[0].kind == "convert" else None
    compiled: StageRun | None = None
    for index, (stage, key) in enumerate(zip(recipe, keys, strict=True)):
        folder = work_dir / f"stage-{index}"
        ran_here = _one_stage(
            sessions, store, job, stage, key, current, current_key, folder, fetch, should_stop,
            limits, one_child,
        )  # fmt: skip
        if isinstance(ran_here[0], Future):  # one child converted and compiled (§15)
            storing, run = ran_here
            return Prepared({}, None, [key], run.compiled, run.output, storing=storing)
        current, local, compiled = ran_here
        if local is not None:
            ran.append(key)
        current_key = key
    if local is None:
        local = fetch(current, work_dir / "compile-input")
    if compiled is not None and compiled.compiled is not None:
        return Prepared(local, current, ran, compiled.compiled, compiled.output)
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
    compile_spec: tuple[CompileSpec, str] | None = None,
) -> tuple[Model, dict[str, Path] | None, StageRun | None] | tuple[Storing, StageRun]:
    """The stage's output model row, its files here when this job ran it (else None), and
    the child's run when it ran here; or, when its child compiled too, its output being
    stored (a `Future` of the row and files) and the child's run."""
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
                return output, None, None
            if claimed.action == "wait":
                waited_on = claimed.row.job_id
        if claimed.action == "wait":
            time.sleep(WAIT_POLL_SECONDS)
            continue
        return _run_here(sessions, store, job, stage, key, input_row, folder, fetch, should_stop,
                         limits, compile_spec)  # fmt: skip


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
    compile_spec: tuple[CompileSpec, str] | None = None,
) -> tuple[Model, dict[str, Path], StageRun] | tuple[Storing, StageRun]:
    started = time.perf_counter()
    try:
        files = fetch(input_row, folder / "input")
        names = sources.layout(input_row.files)
        extra = compression.stage_inputs(stage.kind, stage.args)  # calibration samples
        if extra:
            files.update(fetch(Model(files=extra), folder / "input"))
            names.update(sources.layout(extra))
        with _renewing(sessions, key, job.id, limits.lease_seconds):
            result = stage_in_child(
                stage.kind,
                files,
                names,
                stage.args,
                folder / "out",
                key,
                timeout_seconds=limits.timeout_seconds,
                memory_bytes=limits.memory_bytes,
                max_output_bytes=limits.max_output_bytes,
                compile_user=limits.compile_user,
                compile_launcher=limits.compile_launcher,
                should_stop=should_stop,
                options={
                    "allow_remote_code": limits.allow_remote_code,
                    "source_name": input_row.name,
                },
                compile_spec=compile_spec,
            )
    except BaseException as error:
        with sessions() as session:
            catalog.fail(session, key, job.id, str(error) or type(error).__name__)
        raise

    def store_outputs() -> tuple[Model, dict[str, Path]]:
        # An output that is not what the child said fails the stage (and the jobs waiting on
        # it); anything else (storage, database) leaves the stage to its lease: the job is
        # retried, and a job waiting on the stage takes it over once the lease has run out.
        try:
            return _store_outputs(sessions, store, job, stage, key, input_row, result, files,
                                  names, folder, should_stop, limits, started)  # fmt: skip
        except CompileError as error:
            with sessions() as session:
                catalog.fail(session, key, job.id, str(error) or type(error).__name__)
            raise

    if result.compiled is not None and not isinstance(result.compiled, Exception):
        pool = ThreadPoolExecutor(1, thread_name_prefix="store-stage-output")
        storing = pool.submit(store_outputs)
        pool.shutdown(wait=False)  # its one thread ends with the storing
        return storing, result
    output, outputs = store_outputs()
    return output, outputs, result


def _store_outputs(
    sessions: sessionmaker[Session],
    store: BlobStore,
    job: Job,
    stage: Stage,
    key: str,
    input_row: Model,
    result: StageRun,
    files: dict[str, Path],
    names: dict[str, str],
    folder: Path,
    should_stop: Callable[[], bool],
    limits: StageLimits,
    started: float,
) -> tuple[Model, dict[str, Path]]:
    """Store a stage's output IR (checking the child's digests), register it as a models row,
    measure a compression's drift, and record the stage done: its row and files here."""
    with _renewing(sessions, key, job.id, limits.lease_seconds):  # hundreds of MB, maybe
        outputs, identity, size = _store_files(store, stage, result)
    seconds = time.perf_counter() - started
    # The service registers rows; imported here: it imports the runner's neighbours.
    from farm.server.jobs.service import register_model

    with sessions() as session:
        name = f"{input_row.name} ({stage.kind})"
        output = register_model(session, ModelInfo(identity, name, size))
        session.commit()
        session.expunge(output)
    metrics = {**result.metrics, "output_bytes": size}
    if stage.kind in (compression.COMPRESS, compression.QUANTIZE):
        metrics.update(_drift(sessions, job, stage, key, files, names, outputs, folder, should_stop,
                              limits))  # fmt: skip
    with sessions() as session:
        recorded = catalog.finish(
            session,
            key,
            job.id,
            output_model_id=output.id,
            output_files=identity,
            tool_versions=result.tool_versions,
            metrics=metrics,
            seconds=seconds,
        )
        if not recorded:
            log.warning("stage %s was taken over while job %s ran it", key, job.id)
    log.info("job %s ran stage %s (%s) in %.1f s", job.id, stage.kind, key[:12], seconds)
    return output, outputs


def _store_files(
    store: BlobStore, stage: Stage, result: StageRun
) -> tuple[dict[str, Path], dict[str, str], int]:
    """Store the child's output IR: its files (here, or in a local store), digests, size."""
    outputs = {"xml": result.xml, "bin": result.bin}
    # Hashed by a child that compiled the files it wrote: the store checks the digest as it
    # takes a file in (one read); a file it holds already is read here, never taken on the
    # child's word. Else hashed here (a model saved beside its compile: the child did not).
    identity = result.sha256 or {role: sha256_file(path) for role, path in outputs.items()}
    size = sum(path.stat().st_size for path in outputs.values())
    for role, path in outputs.items():
        store_key = model_storage_key(identity[role])
        if store.exists(store_key):
            if result.sha256 and sha256_file(path) != identity[role]:
                raise ConversionError(f"{stage.kind}: its output {role} is not what it reported")
            continue
        try:  # a local store moves it: no copy
            store.adopt_file(store_key, path, expected_sha256=identity[role])
        except AlreadyStored:  # the store's object under this digest is not its bytes
            raise
        except ChecksumMismatch:  # nothing stored: what the child reported is not its output
            raise ConversionError(f"{stage.kind}: its output {role} changed while stored") from None
        # A local store took the file given up (moved, or copied and the file emptied as it
        # went): the compile reads it there.
        local = store.local_path(store_key) if isinstance(store, LocalPaths) else None
        if local is not None:
            outputs[role] = local
    return outputs, identity, size


def _drift(
    sessions: sessionmaker[Session],
    job: Job,
    stage: Stage,
    key: str,
    files: dict[str, Path],
    names: dict[str, str],
    outputs: dict[str, Path],
    folder: Path,
    should_stop: Callable[[], bool],
    limits: StageLimits,
) -> dict[str, Any]:
    """The compression stage's drift, measured in its own child (the job's `drift` phase) on
    the stage's input (`files` at `names`, calibration files included) and its output IR:
    `drift` (or None and `drift_note`), `drift_seconds` (the two CPU runs), the child's
    `drift_child_seconds` and `drift_peak_rss_bytes`. A failure fails the stage."""
    staged = dict(files)
    staged_names = dict(names)
    for role, path in outputs.items():
        staged[f"{drift_step.COMPRESSED}{role}"] = path
        staged_names[f"{drift_step.COMPRESSED}{role}"] = f"compressed/{OUTPUT_XML_NAME[role]}"
    try:
        with phases.step("drift"), _renewing(sessions, key, job.id, limits.lease_seconds):
            measured = drift_in_child(
                stage.kind,
                staged,
                staged_names,
                stage.args,
                folder / "drift",
                key,
                timeout_seconds=limits.timeout_seconds,
                memory_bytes=limits.memory_bytes,
                compile_user=limits.compile_user,
                compile_launcher=limits.compile_launcher,
                should_stop=should_stop,
            )
    except BaseException as error:
        with sessions() as session:
            catalog.fail(session, key, job.id, f"drift: {str(error) or type(error).__name__}")
        raise
    metrics = {
        "drift": measured.get("drift"),
        "drift_seconds": measured.get("drift_seconds"),
        "drift_child_seconds": measured.get("seconds"),
        "drift_peak_rss_bytes": measured.get("peak_rss_bytes"),
    }
    if measured.get("drift_note"):
        metrics["drift_note"] = measured["drift_note"]
    return metrics


def _renewing(
    sessions: sessionmaker[Session], key: str, job_id: int, lease_seconds: int
) -> Renewing:
    """Renew the stage's lease while it runs (every third of the lease)."""

    def renew() -> bool:
        with sessions() as session:
            return catalog.renew(session, key, job_id, lease_seconds)

    return Renewing(renew, lease_seconds / 3, f"stage {key[:12]}")
