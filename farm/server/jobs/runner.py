"""Running one job: claim it with a lease, compile in a child process, store, record.

Used by Celery workers and by the embedded farm alike. The job row is the truth
(docs/architecture.md §6): a claim is a conditional UPDATE, so a duplicated delivery finds the
job taken or finished and does nothing; the lease is renewed while compiling, so a dead
worker's job can be taken back; the blob row and `succeeded` are written in one transaction
after the blob is stored, the blob's reference outputs `pending`. The reference run follows
the record (`reference_run`): here, as the tail of the same call, with the model files still
in the job's folder, or in a detached process (`detach_reference`, the embedded `farm
submit`), so the job's submitter never waits for it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import resource
import shutil
import socket
import tempfile
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from farm.core import errors, sources
from farm.core.clock import now
from farm.core.errors import (
    BlobTooLarge,
    CompileCancelled,
    CompileError,
    CompileTimeout,
    IntegrityMismatch,
    ModelFileCorrupt,
    WorkDiskFull,
)
from farm.core.filecache import BlobCache
from farm.core.hashing import sha256_file
from farm.core.identity import FileVersion
from farm.core.signing import PART_BYTES, Signer
from farm.core.spec import CompileSpec, Target, Toolchain, compile_properties
from farm.core.vocabulary import JobState, ReferenceState
from farm.server.blobs.parts import record_parts
from farm.server.blobs.signatures import sign_row
from farm.server.blobs.verifications import inherited_quarantine
from farm.server.db.models import Blob, Job, Model
from farm.server.db.session import rows_changed
from farm.server.jobs.limits import (
    BLOB_BYTES_OVER_MODEL,
    BLOB_BYTES_PER_MODEL_BYTE,
    blob_size_limit,
)
from farm.server.jobs.model_cache import condemn_model_file, link_model_file
from farm.server.jobs.phases import PhaseClock
from farm.server.jobs.reference_run import Prepared, detach, run_reference
from farm.server.jobs.sandbox import blob_limit_message, compile_in_child
from farm.server.leases import Renewing
from farm.server.memory import release_free_memory
from farm.server.storage import (
    BlobStore,
    LocalPaths,
    StoredObject,
    blob_storage_key,
    model_storage_key,
)

log = logging.getLogger(__name__)


ONE_CHILD_PHASE = "convert+compile"
"""The phase of a job whose one convert stage ran here: one child converted and compiled
(docs §15); the phase is the child's whole span (the IR is stored, and the stage recorded,
beside the blob's upload)."""
CANCEL_POLL_SECONDS = 2.0
"""How often a running job's worker looks for a cancel request (and renews the lease)."""
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
"""A write refused for want of room: disk full, file size limit (ulimit -f), quota."""


@dataclass(frozen=True)
class RunLimits:
    lease_seconds: int = 120
    max_run_seconds: int = 3 * 3600
    memory_bytes: int | None = None
    """Address-space limit of the compile's child process; None: none."""
    max_blob_bytes: int | None = None
    """Size limit of a blob; None: `blob_size_limit`'s ratio, from the model's size."""
    max_blob_ratio: float = BLOB_BYTES_PER_MODEL_BYTE
    blob_bytes_over_model: int = BLOB_BYTES_OVER_MODEL
    compile_user: str | None = None
    """Who compiles (`compile_user.compile_identity`; None: nobody)."""
    compile_launcher: Path | None = None
    """How a worker that is not root becomes compile_user (`compile_user.compile_identity`)."""
    reference_outputs: bool = True
    """Compute the blob's reference outputs after compiling it (FARM_REFERENCE_OUTPUTS)."""
    allow_remote_code: bool = False
    """A stage may run a Hugging Face folder's own code (FARM_ALLOW_REMOTE_CODE)."""
    part_bytes: int = PART_BYTES
    """The size of a blob's parts (FARM_BLOB_PART_BYTES; `parts.record_parts`)."""


@dataclass(frozen=True)
class ReferencePlan:
    """What the record says of the blob's reference: `pending` (the run follows the record,
    from `prepared`), or `skipped` at once with `note` (off, or too large to run here)."""

    note: str | None
    prepared: Prepared | None = None
    blob_file: Path | None = None
    """The blob's file, still in the job's folder after a remote store took its copy: its
    part digests are hashed from it once the job is recorded (`parts.record_parts`)."""

    @property
    def state(self) -> str:
        return ReferenceState.SKIPPED if self.note else ReferenceState.PENDING


def _blob_limit_of(model_bytes: int, limits: RunLimits) -> int:
    return blob_size_limit(
        model_bytes, limits.max_blob_bytes, limits.max_blob_ratio, limits.blob_bytes_over_model
    )


def claim(session: Session, job_id: int, worker: str, lease_seconds: int) -> bool:
    """Take a queued job, or a running one whose lease has expired. False: not ours to run."""
    at = now()
    claimable = (Job.state == JobState.QUEUED) | (
        (Job.state == JobState.RUNNING) & (Job.lease_expires_at < at)
    )
    changed = rows_changed(
        session,
        update(Job)
        .where(
            Job.id == job_id,
            claimable,
            Job.cancel_requested.is_(False),
            Job.attempts < Job.max_attempts,
        )
        .values(
            state=JobState.RUNNING,
            worker=worker,
            started_at=at,
            lease_expires_at=at + timedelta(seconds=lease_seconds),
            attempts=Job.attempts + 1,
        ),
    )
    session.commit()
    return changed == 1


def run_job(
    sessions: sessionmaker[Session],
    store: BlobStore,
    job_id: int,
    *,
    worker: str | None = None,
    limits: RunLimits = RunLimits(),
    work_root: Path | None = None,
    signer: Signer | None = None,
    model_cache: BlobCache | None = None,
    detach_reference: bool = False,
) -> Job | None:
    """Run job `job_id` to its end if it can be claimed; returns the job row as it ends
    (None: no such job). A blob recorded with its reference pending then has the reference
    run here (after the job is recorded `succeeded`), or, with `detach_reference`, in a
    process of its own (`reference_run.detach`) that outlives this one.

    Compile errors fail the job with the compiler's message. Infrastructure errors (storage,
    database) put the job back in the queue, or fail it when that was its last attempt, and
    propagate, for the caller to retry (the retry finds the job failed and does nothing).
    `model_cache` keeps the model files a remote store sent, for this host's next jobs.
    """
    worker = worker or socket.gethostname()
    with sessions() as session:
        if not claim(session, job_id, worker, limits.lease_seconds):
            return session.get(Job, job_id)
        job = session.get_one(Job, job_id)
        model_row = session.get_one(Model, job.model_id)
    work_dir = Path(tempfile.mkdtemp(prefix=f"farm-job-{job_id}-", dir=work_root))
    lease = _lease(sessions, job_id, worker, limits.lease_seconds)
    clock = PhaseClock()
    plan = ReferencePlan(None)
    try:
        with lease:
            outcome, plan = _compile_and_store(
                job,
                model_row,
                store,
                work_dir,
                lease,
                limits,
                signer,
                model_cache,
                sessions,
                clock,
            )
        with sessions() as session:
            with clock.phase("record"):
                ended = outcome(session)
            clock.record(session, job_id, job.attempts)
            session.commit()
            blob_id = _pending_blob(session, ended, job_id)
            hashed_in_parts = _recorded_blob(session, ended, job_id) if plan.blob_file else None
    except Exception as error:
        _release(sessions, job_id, worker, error)
        shutil.rmtree(work_dir, ignore_errors=True)
        raise
    try:
        if hashed_in_parts is not None and plan.blob_file is not None:
            _record_parts_quietly(
                sessions, hashed_in_parts, plan.blob_file, signer, limits.part_bytes
            )
        if blob_id is not None and detach_reference:
            detach(blob_id)
        elif blob_id is not None and plan.prepared is not None:
            _reference_tail(
                sessions, store, blob_id, job, limits, signer, model_cache, plan, work_dir
            )
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    return ended


def _pending_blob(session: Session, ended: Job | None, job_id: int) -> int | None:
    """The blob this job recorded with its reference pending (None: no such blob)."""
    if ended is None or ended.state != JobState.SUCCEEDED:
        return None
    return session.scalar(
        select(Blob.id).where(Blob.job_id == job_id, Blob.reference_state == ReferenceState.PENDING)
    )


def _recorded_blob(session: Session, ended: Job | None, job_id: int) -> int | None:
    """The blob this job recorded (None: it recorded none)."""
    if ended is None or ended.state != JobState.SUCCEEDED:
        return None
    return session.scalar(select(Blob.id).where(Blob.job_id == job_id))


def _record_parts_quietly(sessions, blob_id: int, blob_file: Path, signer, part_bytes: int) -> None:
    """The blob's part digests (`parts.record_parts`), after its job was recorded `succeeded`:
    an edge downloads a blob without them as one stream, so their errors are logged only."""
    try:
        record_parts(sessions, blob_id, blob_file, signer, part_bytes)
    except Exception:
        log.warning("blob %s: its part digests were not recorded", blob_id, exc_info=True)


def _reference_tail(
    sessions, store, blob_id, job, limits, signer, model_cache, plan, work_dir
) -> None:
    """The blob's reference run, after its job was recorded `succeeded`: with the compile's
    files. Its errors are the reference's, not the job's: logged; the reconciler sends it
    again."""
    assert plan.prepared is not None
    try:
        with sessions() as session:
            source_row = session.get_one(Model, job.model_id)
            session.expunge(source_row)
        with _work_disk(work_dir):
            source = _reference_source(store, job, source_row, work_dir, model_cache)
        prepared = Prepared(plan.prepared.files, plan.prepared.inputs, source)
        run_reference(
            sessions, store, blob_id, limits, signer, model_cache=model_cache, prepared=prepared
        )
    except Exception:
        log.warning("job %s: its reference run failed; to be sent again", job.id, exc_info=True)


def _compile_and_store(
    job, source_row, store, work_dir, lease, limits, signer, model_cache, sessions, clock
):
    """Returns a function that records the outcome in a session (so recording is one place),
    and what the record says of the blob's reference (`ReferencePlan`). However it ends, a
    stage output still being stored (`Prepared.storing`) is waited for first: the job's work
    folder, which holds its files, goes when the job ends."""
    stages: list = []
    try:
        return _compile_and_store_steps(
            job, source_row, store, work_dir, lease, limits, signer, model_cache, sessions,
            clock, stages,
        )  # fmt: skip
    finally:
        for prepared in stages:
            _settle_quietly(prepared)


def _compile_and_store_steps(
    job, source_row, store, work_dir, lease, limits, signer, model_cache, sessions, clock,
    stages,
):  # fmt: skip
    """`_compile_and_store`'s steps; `stages` gets the stage phase's `Prepared`.

    `source_row` is what was submitted; with a recipe (docs §15) the stage phase makes (or
    reuses) the model compiled, `model_row`. `clock` times each phase (`phases.PhaseClock`).
    The reference is not computed here: it follows the record (`run_job`)."""
    none = ReferencePlan(None)
    spec = CompileSpec.from_canonical(job.target, job.spec)
    mismatch = _toolchain_mismatch(job, spec.target)
    if mismatch:  # before any byte is fetched or compiled
        return (lambda session: _finish(session, job, JobState.FAILED, error=mismatch)), none
    model_row = source_row
    prepared = None
    try:
        with clock.phase("fetch"), _work_disk(work_dir):
            inputs = _fetch_inputs(store, job, work_dir, model_cache)
            if not job.recipe:
                files = _fetch_model(store, model_row, work_dir, model_cache)
        if job.recipe:
            kinds = "+".join(stage["stage"] for stage in job.recipe)  # "convert+compress"
            with clock.phase(kinds[:16]), _work_disk(work_dir):
                prepared = _run_stages(
                    sessions, store, job, source_row, work_dir, lease, limits, model_cache, spec
                )
                stages.append(prepared)
            if prepared.compiled is not None:  # one child converted and compiled (§15)
                _, at, seconds = clock.timed[-1]
                clock.timed[-1] = (ONE_CHILD_PHASE, at, seconds)
            if prepared.storing is None:
                files, model_row = prepared.files, prepared.model
            _check_drift(sessions, job)
        if prepared is None or prepared.storing is None:  # else: compiled already
            with _work_disk(work_dir):
                _ensure_room(work_dir, 0 if spec.weightless else model_row.size_bytes)
    except ModelFileCorrupt as error:
        corrupt = str(error)
        return (lambda session: _finish(session, job, JobState.FAILED, error=corrupt)), none
    except CompileCancelled:
        return _cancelled(job), none
    except (
        CompileTimeout,
        errors.CompileError,
        errors.ConverterUnavailable,
        errors.DriftExceeded,
    ) as error:
        message, output = str(error), getattr(error, "output", "")
        log_text = f"failed: {message}" + (f"\n--- stage output ---\n{output}" if output else "")
        return _failed(job, message, log_text), none
    try:
        if prepared is not None and prepared.compiled is not None:
            if isinstance(prepared.compiled, Exception):
                raise _with_child_output(prepared.compiled, prepared.output)
            result, output = prepared.compiled, prepared.output
            max_blob_bytes = _blob_limit_of(source_row.size_bytes, limits)
            if prepared.storing is None:
                max_blob_bytes = max(max_blob_bytes, _blob_limit_of(model_row.size_bytes, limits))
        else:
            max_blob_bytes = _blob_limit_of(model_row.size_bytes, limits)
            release_free_memory()  # before the compile child's peak, not after it
            with clock.phase("compile"), _work_disk(work_dir):  # files staged, the blob moved
                result, output = compile_in_child(
                    files,
                    spec,
                    work_dir / "out",
                    job.cache_key,
                    timeout_seconds=limits.max_run_seconds,
                    memory_bytes=limits.memory_bytes,
                    max_blob_bytes=max_blob_bytes,
                    compile_user=limits.compile_user,
                    compile_launcher=limits.compile_launcher,
                    should_stop=lease.should_stop,
                    in_place=_copied_from(store, model_row),
                )
        _check_blob_size(result.blob_path, max_blob_bytes)
        _check_toolchain(job, result.toolchain, spec.target)
        if lease.should_stop():  # cancelled while the compile was finishing: store nothing
            raise CompileCancelled("compile cancelled")
    except CompileCancelled:
        return _cancelled(job), none
    except (CompileTimeout, errors.CompileError, errors.CompilerUnavailable) as error:
        message = str(error)  # `error` itself is unbound when the except block ends
        log_text = _failure_log(spec, message, error.output)
        return _failed(job, message, log_text), none
    with clock.phase("upload"):
        # The blob file is ours to give: a local store moves it in (one read, to hash it).
        stored = _adopt_blob(sessions, store, job, result.blob_path)
        if prepared is not None and prepared.storing is not None:
            # Beside the blob: the stage's output IR stored and the stage recorded.
            try:
                prepared = prepared.settled()
            except BaseException as error:
                _forget_blob(sessions, store, job)
                if not isinstance(error, errors.CompileError):  # storage, database: retried
                    raise
                # An output that is not what the child said: the stage failed, and the job.
                return _failed(job, str(error), f"failed: {error}"), none
            files, model_row = prepared.files, prepared.model
    release_free_memory()
    plan = _reference_plan(model_row, limits, Prepared(dict(files), inputs))
    if not isinstance(store, LocalPaths):  # a local store moved the file in: edges read it whole
        plan = dataclasses.replace(plan, blob_file=result.blob_path)
    record = lambda session: _record_blob(  # noqa: E731
        session, store, job, source_row, result, stored, output, signer, plan
    )
    return record, plan


def _adopt_blob(sessions, store: BlobStore, job: Job, blob_path: Path) -> StoredObject:
    """Store the compiled blob under its cache key. Objects are written once, so an object
    there that no row names (left by an attempt that failed between storing and recording
    it, or kept by `farm gc` for this job) is deleted first; one a row names stays, and
    another attempt's equal bytes are fine (`adopt_file` refuses others)."""
    key = blob_storage_key(job.cache_key)
    if store.exists(key):
        with sessions() as session:
            recorded = session.scalar(select(Blob.id).where(Blob.cache_key == job.cache_key))
        if recorded is None:
            log.warning("job %s: deleting %s, stored before with no row naming it", job.id, key)
            store.delete(key)
    return store.adopt_file(key, blob_path)


def _forget_blob(sessions, store: BlobStore, job: Job) -> None:
    """Delete the blob this attempt stored, unless a row names it (an attempt whose lease was
    taken back may have recorded it after all)."""
    with sessions() as session:
        if session.scalar(select(Blob.id).where(Blob.cache_key == job.cache_key)) is None:
            store.delete(blob_storage_key(job.cache_key))


def _settle_quietly(prepared) -> None:
    """Wait for a stage output being stored (its work folder goes with the job's); a failure
    to store it is the stage's, recorded there, not this job's outcome."""
    if prepared is not None and prepared.storing is not None:
        with contextlib.suppress(Exception):
            prepared.settled()


def _cancelled(job: Job):
    return lambda session: _finish(
        session, job, JobState.CANCELLED, error="cancelled while running"
    )


def _failed(job: Job, message: str, log_text: str):
    return lambda session: _finish(session, job, JobState.FAILED, error=message, log_text=log_text)


def _reference_plan(model_row: Model, limits: RunLimits, prepared: Prepared) -> ReferencePlan:
    """`pending` with the compile's files, or `skipped` at once with the reason: reference
    outputs are off, or the model is too large for the compile memory limit."""
    # numpy and OpenVINO: loaded already where jobs run (the worker, the embedded submit).
    from farm.server.jobs.reference import skip_reason

    if not limits.reference_outputs:
        return ReferencePlan("no reference outputs: FARM_REFERENCE_OUTPUTS is off")
    too_large = skip_reason(model_row.size_bytes, limits.memory_bytes)
    if too_large:
        return ReferencePlan(too_large)
    return ReferencePlan(None, prepared)


def _reference_source(store, job, source_row, work_dir, model_cache):
    """(format, files) of the source a convert stage made the compiled model from, for the
    reference run to compute its outputs from (docs §15); None without a convert stage, or
    with a compress/quantize stage after it."""
    if not job.recipe or job.recipe[0].get("stage") != "convert":
        return None
    if any(stage.get("stage") in ("compress", "quantize") for stage in job.recipe):
        # A compressed model is judged against its own outputs: the source computes the
        # uncompressed numbers, and the compression's distance from them is its recorded drift.
        return None
    with _work_disk(work_dir):
        files = _fetch_model(store, source_row, work_dir / "reference-source", model_cache)
    return job.recipe[0]["args"]["format"], files


def _run_stages(sessions, store, job, source_row, work_dir, lease, limits, model_cache, spec):
    """The stage phase (farm.server.stages.phase): the model the compile reads, and, when
    this job runs a recipe of one convert, the blob its child compiled too."""
    from farm.server.stages.phase import StageLimits, run_recipe

    stage_limits = StageLimits(
        lease_seconds=limits.lease_seconds,
        timeout_seconds=limits.max_run_seconds,
        memory_bytes=limits.memory_bytes,
        max_output_bytes=_blob_limit_of(source_row.size_bytes, limits),
        compile_user=limits.compile_user,
        compile_launcher=limits.compile_launcher,
        allow_remote_code=limits.allow_remote_code,
    )
    return run_recipe(
        sessions,
        store,
        job,
        source_row,
        work_dir,
        lambda row, folder: _fetch_model(store, row, folder, model_cache),
        lease.should_stop,
        stage_limits,
        compile_spec=(spec, job.cache_key),
    )


def _with_child_output(error: Exception, output: str) -> Exception:
    """A compile error of the converting child, with that child's output for the job log."""
    error.output = output  # type: ignore[attr-defined]
    return error


def _check_drift(sessions, job) -> None:
    """The submitter's `--max-drift` against the drift the compression stage recorded (a
    reused stage's too): DriftExceeded with the figures, before anything is compiled."""
    if not job.max_drift:
        return
    from farm.core.compression import DriftBound
    from farm.server.stages import catalog

    with sessions() as session:
        row = catalog.find(session, job.stage_key)
        metrics = dict(row.metrics or {}) if row is not None else {}
    DriftBound.parse(job.max_drift).check(metrics)


def _check_blob_size(blob_path: Path, max_blob_bytes: int) -> None:
    """The sandbox stops a child at its first byte past the limit (RLIMIT_FSIZE); this is the
    check that holds even where that limit could not be set, before a byte is uploaded."""
    if blob_path.stat().st_size > max_blob_bytes:
        blob_path.unlink()
        raise BlobTooLarge(blob_limit_message(max_blob_bytes))


def _fetch_model(
    store: BlobStore, model_row: Model, work_dir: Path, model_cache: BlobCache | None
) -> dict[str, Path]:
    """Model files as paths the compiler (or a stage) can read, laid out in `work_dir` as
    `sources.layout` says (``model.xml``, a folder's relative paths): the store's own files
    when it is local, else from this host's model cache, fetched into it once."""
    files = {}
    for role, relative in sources.layout(model_row.files).items():
        local = work_dir.joinpath(*relative.split("/"))
        local.parent.mkdir(parents=True, exist_ok=True)
        files[role] = _fetch_file(store, model_row.files[role], local, model_cache, role)
    return files


def _copied_from(store: BlobStore, model_row: Model) -> dict[str, tuple[Path, FileVersion]]:
    """The model's files where this process copied them from, by role, with the version
    they had then (an embedded submit's store copy, made around the page cache)."""
    if not isinstance(store, LocalPaths):
        return {}
    found = {}
    for role, sha in model_row.files.items():
        copied = store.copied_from(model_storage_key(sha))
        if copied is not None:
            found[role] = copied
    return found


def _fetch_inputs(
    store: BlobStore, job: Job, work_dir: Path, model_cache: BlobCache | None
) -> Path | None:
    """The submitter's reference inputs (`farm submit --inputs`), stored like a model file."""
    if job.reference_inputs is None:
        return None
    local = work_dir / "reference-inputs.npz"
    return _fetch_file(store, job.reference_inputs, local, model_cache, "reference inputs")


def _fetch_file(
    store: BlobStore, sha: str, local: Path, model_cache: BlobCache | None, role: str
) -> Path:
    key = model_storage_key(sha)
    stored = store.local_path(key) if isinstance(store, LocalPaths) else None
    if stored is None and model_cache is not None:
        try:
            link_model_file(model_cache, store, key, sha, local)
        except IntegrityMismatch:
            condemn_model_file(store, key, sha, f"the model's {role}")
    elif stored is None:
        store.get_file(key, local)
        if sha256_file(local) != sha:
            condemn_model_file(store, key, sha, f"the model's {role}")
    else:
        # A link, not the store's own path: a model may name files relative to itself
        # (ONNX external data), and beside it must be its own folder, not other models.
        local.symlink_to(stored)
    return local


@contextlib.contextmanager
def _work_disk(work_dir: Path):
    """A write refused for want of room in the work dir becomes WorkDiskFull, naming it."""
    try:
        yield
    except OSError as error:
        if error.errno not in DISK_FULL_ERRNOS:
            raise
        raise WorkDiskFull(_no_room(work_dir, str(error))) from error


def _ensure_room(work_dir: Path, needed: int) -> None:
    """Refuse to compile when the blob cannot be written: OpenVINO drops a failed blob write
    without a word (the compile "wrote no blob"), after a compile that may take hours.

    Note: `needed` is an estimate, the model's size (a weightful blob holds the weights).
    """
    free = shutil.disk_usage(work_dir).free
    if free < needed:
        why = f"the blob needs about {needed} bytes and {free} are free"
        raise WorkDiskFull(_no_room(work_dir, why))
    limit, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    if limit != resource.RLIM_INFINITY and limit < needed:
        why = f"the blob needs about {needed} bytes, over this worker's file size limit {limit}"
        raise WorkDiskFull(_no_room(work_dir, f"{why} (ulimit -f)"))


def _no_room(work_dir: Path, why: str) -> str:
    return (
        f"no room to compile in the worker's temporary directory {work_dir.parent} (TMPDIR): "
        f"{why}; free space there or point TMPDIR at a bigger disk"
    )


def _toolchain_mismatch(job: Job, target: Target) -> str | None:
    """Why this host would not make the job's blob (another toolchain), checked before the
    compile: routing sends a job only to workers of its toolchain, so this is a message sent
    by hand to the wrong queue, or an embedded farm asked for a toolchain it lacks."""
    # OpenVINO: loaded already in every process that runs jobs (the worker probed its targets
    # before forking its pool; the embedded farm read the model); the answer is cached.
    from farm import toolchain

    here = toolchain.host_toolchain(target).key_part(target)
    if here == job.toolchain:
        return None
    return (
        f"this host's toolchain {here} is not the job's {job.toolchain}: nothing was compiled; "
        f"the job needs a worker with that toolchain (farm workers)"
    )


def _check_toolchain(job: Job, produced: Toolchain, target: Target) -> None:
    """Never record a blob under a key whose toolchain is not the one that produced it."""
    if produced.key_part(target) != job.toolchain:
        raise CompileError(
            f"this host's toolchain {produced.key_part(target)} differs from the job's "
            f"{job.toolchain}; the job must run on a host with that toolchain"
        )


def _finish(session: Session, job: Job, state: str, error: str, log_text: str | None = None):
    session.execute(
        update(Job)
        .where(Job.id == job.id, Job.state == JobState.RUNNING, Job.worker == job.worker)
        .values(
            state=state,
            error=error,
            log=log_text or error,
            finished_at=now(),
            lease_expires_at=None,
        )
    )
    session.commit()
    return session.get(Job, job.id, populate_existing=True)


def _record_blob(
    session: Session,
    store: BlobStore,
    job: Job,
    model_row: Model,
    result,
    stored,
    output: str,
    signer,
    reference: ReferencePlan = ReferencePlan(None),
):
    """`succeeded` and the blob row in one transaction, its reference `pending` (or `skipped`
    with the plan's note), unless the job was cancelled while it finished: then the job ends
    cancelled and the object it stored is deleted (when no blob row of the same key, another
    job's, claims it)."""
    timings = {"compile_seconds": result.compile_seconds, "export_seconds": result.export_seconds}
    at = now()
    succeeded = rows_changed(
        session,
        update(Job)
        .where(Job.id == job.id, Job.cancel_requested.is_(False))
        .values(
            state=JobState.SUCCEEDED,
            finished_at=at,
            lease_expires_at=None,
            peak_rss_bytes=result.peak_rss_bytes,
            log=_job_log(result, output, _reference_line(reference)),
            **timings,
        ),
    )
    if not succeeded:
        session.rollback()
        ended = _finish(session, job, JobState.CANCELLED, error="cancelled while running")
        if session.scalar(select(Blob.id).where(Blob.cache_key == job.cache_key)) is None:
            store.delete(blob_storage_key(job.cache_key))
        return ended
    # A blob may already exist if a job whose lease we took back finished after all: then the
    # store refused our write unless the bytes were equal, and one row is enough.
    if session.scalar(select(Blob.id).where(Blob.cache_key == job.cache_key)) is None:
        session.add(
            blob := Blob(
                cache_key=job.cache_key,
                job_id=job.id,
                model_id=model_row.id,
                target=job.target,
                spec=job.spec,
                toolchain=result.toolchain.as_dict(),
                openvino_version=result.toolchain.openvino,
                storage_key=blob_storage_key(job.cache_key),
                size_bytes=stored.size,
                sha256=stored.sha256,
                payload_offset=result.payload_offset,
                weightless=bool(job.spec.get("weightless")),
                created_at=at,
                **timings,
            )
        )
        sign_row(blob, signer, model_row.files)  # the manifest of the row's own fields
        blob.quarantine_reason = inherited_quarantine(session, job.cache_key, stored.sha256)
        blob.quarantined_at = at if blob.quarantine_reason else None
        blob.reference_state, blob.reference_note = reference.state, reference.note
        blob.reference_attempts = 0
    session.commit()
    return session.get(Job, job.id, populate_existing=True)


def _release(sessions: sessionmaker[Session], job_id: int, worker: str, error: Exception) -> None:
    """Hand a job back to the queue after an infrastructure error; the retry re-claims it.

    The attempt stays counted: every claim is one of the job's `max_attempts`, so an outage
    that outlasts them fails the job with the error, instead of re-sending it until its
    maximum queue wait. If the database is down, the lease simply expires and the reconciler
    takes the job back (or fails it, past its attempts).
    """
    try:
        with sessions() as session:
            job = session.get(Job, job_id)
            values: dict[str, object] = {"state": JobState.QUEUED}
            if job is not None and job.attempts >= job.max_attempts:
                first_line = (str(error).strip().splitlines() or [""])[0]
                reason = (
                    f"gave up after {job.attempts} attempts (FARM_MAX_ATTEMPTS); the last "
                    f"ended with an infrastructure error: {type(error).__name__}: {first_line}"
                )
                values = {
                    "state": JobState.FAILED,
                    "finished_at": now(),
                    "error": reason,
                    "log": reason,
                }
            session.execute(
                update(Job)
                .where(Job.id == job_id, Job.state == JobState.RUNNING, Job.worker == worker)
                .values(lease_expires_at=None, **values)
            )
            session.commit()
    except Exception:
        log.warning("could not release job %s; its lease will expire", job_id, exc_info=True)


def _failure_log(spec: CompileSpec, message: str, output: str) -> str:
    """A failed job's log: what was asked, why it failed, and what the compiler printed."""
    lines = [f"{key}={value}" for key, value in sorted(compile_properties(spec).items())]
    lines.append(f"failed: {message}")
    if output.strip():
        lines += ["--- compiler output ---", output.rstrip()]
    return "\n".join(lines)


def _reference_line(reference: ReferencePlan) -> str:
    if reference.note:
        return reference.note
    return "reference outputs: pending (computed after the blob is recorded; see below)"


def _job_log(result, output: str, reference_line: str = "") -> str:
    lines = [f"{key}={value}" for key, value in sorted(result.properties.items())]
    lines.append(f"toolchain={result.toolchain.as_dict()}")
    lines.append(
        f"compile {result.compile_seconds:.3f}s, export {result.export_seconds:.3f}s, "
        f"peak RSS {result.peak_rss_bytes / 2**20:.0f} MiB, blob {result.size_bytes} bytes"
    )
    if reference_line:
        lines.append(reference_line)
    if output.strip():
        lines += ["--- compiler output ---", output.rstrip()]
    return "\n".join(lines)


def _lease(sessions, job_id: int, worker: str, lease_seconds: int) -> Renewing:
    """The job's lease, renewed every third of it; checked more often (the same UPDATE reads
    the cancel flag) so a cancel is quick. Lost when the job is no longer this worker's, or
    cancelled: the compile stops."""

    def renew() -> bool:
        with sessions() as session:
            row = session.execute(
                update(Job)
                .where(Job.id == job_id, Job.state == JobState.RUNNING, Job.worker == worker)
                .values(lease_expires_at=now() + timedelta(seconds=lease_seconds))
                .returning(Job.cancel_requested)
            ).first()
            session.commit()
        if row is not None and row.cancel_requested:
            log.info("job %s: cancel requested; stopping its compile", job_id)
        return row is not None and not row.cancel_requested

    return Renewing(renew, min(lease_seconds / 3, CANCEL_POLL_SECONDS), f"job {job_id}")
