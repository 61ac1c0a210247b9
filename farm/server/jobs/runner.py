"""Running one job: claim it with a lease, compile in a child process, store, record.

Used by Celery workers and by the embedded farm alike. The job row is the truth
(docs/architecture.md §6): a claim is a conditional UPDATE, so a duplicated delivery finds the
job taken or finished and does nothing; the lease is renewed while compiling, so a dead
worker's job can be taken back; the blob row and `succeeded` are written in one transaction
after the blob is stored.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import resource
import shutil
import socket
import tempfile
import threading
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import NoReturn

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
    StorageError,
    WorkDiskFull,
)
from farm.core.filecache import BlobCache
from farm.core.hashing import sha256_file, sha256_stream
from farm.core.signing import Signer
from farm.core.spec import CompileSpec, Target, Toolchain, compile_properties
from farm.core.vocabulary import JobState
from farm.server.blobs.signatures import sign_reference, sign_row
from farm.server.db.models import Blob, Job, Model
from farm.server.db.session import rows_changed
from farm.server.jobs.model_cache import link_model_file
from farm.server.jobs.sandbox import blob_limit_message, compile_in_child, reference_in_child
from farm.server.memory import release_free_memory
from farm.server.storage import (
    BlobStore,
    LocalPaths,
    StoredObject,
    blob_storage_key,
    model_storage_key,
    reference_storage_key,
)

log = logging.getLogger(__name__)


CANCEL_POLL_SECONDS = 2.0
"""How often a running job's worker looks for a cancel request (and renews the lease)."""
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
"""A write refused for want of room: disk full, file size limit (ulimit -f), quota."""
BLOB_BYTES_PER_MODEL_BYTE = 4
BLOB_BYTES_OVER_MODEL = 256 * 2**20
"""The default blob size limit: 4 times the model's bytes plus 256 MiB. A blob holds the
weights once (or not at all when weightless) plus the compiled code; a blob far bigger than its
model is a constant broadcast at compile time (2.6 KB of IR made a 1 GiB blob in 14 s)."""


@dataclass(frozen=True)
class RunLimits:
    lease_seconds: int = 120
    max_run_seconds: int = 3 * 3600
    memory_bytes: int | None = None
    """Address-space limit of the compile's child process; None: none."""
    max_blob_bytes: int | None = None
    """Size limit of a blob; None: `blob_size_limit`'s default, from the model's size."""
    compile_user: str | None = None
    """Who compiles when the worker runs as root (`sandbox.compile_identity`; None: nobody)."""
    reference_outputs: bool = True
    """Compute the blob's reference outputs after compiling it (FARM_REFERENCE_OUTPUTS)."""
    allow_remote_code: bool = False
    """A stage may run a Hugging Face folder's own code (FARM_ALLOW_REMOTE_CODE)."""


@dataclass(frozen=True)
class ReferenceFile:
    """The reference outputs computed for a blob, or why there are none."""

    path: Path | None
    note: str | None


def blob_size_limit(model_bytes: int, max_blob_bytes: int | None = None) -> int:
    """The largest blob a compile of a `model_bytes` model may write (FARM_MAX_BLOB_BYTES, or
    4 x the model + 256 MiB)."""
    if max_blob_bytes:
        return max_blob_bytes
    return BLOB_BYTES_PER_MODEL_BYTE * model_bytes + BLOB_BYTES_OVER_MODEL


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
) -> Job | None:
    """Run job `job_id` to its end if it can be claimed; returns the job row as it ends
    (None: no such job).

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
    lease = _Lease(sessions, job_id, worker, limits.lease_seconds)
    try:
        with lease:
            outcome = _compile_and_store(
                job, model_row, store, work_dir, lease, limits, signer, model_cache, sessions
            )
        with sessions() as session:
            return outcome(session)
    except Exception as error:
        _release(sessions, job_id, worker, error)
        raise
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)


def _compile_and_store(
    job, source_row, store, work_dir, lease, limits, signer, model_cache, sessions
):
    """Returns a function that records the outcome in a session (so recording is one place).

    `source_row` is what was submitted; with a recipe (docs §15) the stage phase makes (or
    reuses) the model compiled, `model_row`."""
    spec = CompileSpec.from_canonical(job.target, job.spec)
    mismatch = _toolchain_mismatch(job, spec.target)
    if mismatch:  # before any byte is fetched or compiled
        return lambda session: _finish(session, job, JobState.FAILED, error=mismatch)
    model_row = source_row
    try:
        with _work_disk(work_dir):
            inputs = _fetch_inputs(store, job, work_dir, model_cache)
            if job.recipe:
                prepared = _run_stages(
                    sessions, store, job, source_row, work_dir, lease, limits, model_cache
                )
                files, model_row = prepared.files, prepared.model
            else:
                files = _fetch_model(store, model_row, work_dir, model_cache)
            _ensure_room(work_dir, 0 if spec.weightless else model_row.size_bytes)
    except ModelFileCorrupt as error:
        corrupt = str(error)
        return lambda session: _finish(session, job, JobState.FAILED, error=corrupt)
    except CompileCancelled:
        return lambda session: _finish(
            session, job, JobState.CANCELLED, error="cancelled while running"
        )
    except (CompileTimeout, errors.CompileError, errors.ConverterUnavailable) as error:
        message = str(error)
        log_text = f"failed: {message}" + (f"\n--- stage output ---\n{error.output}" if
                                             getattr(error, "output", "") else "")  # fmt: skip
        return lambda session: _finish(
            session, job, JobState.FAILED, error=message, log_text=log_text
        )
    max_blob_bytes = blob_size_limit(model_row.size_bytes, limits.max_blob_bytes)
    release_free_memory()  # before the compile child's peak, not after it
    try:
        with _work_disk(work_dir):  # the model's files staged, the blob moved for the child
            result, output = compile_in_child(
                files,
                spec,
                work_dir / "out",
                job.cache_key,
                timeout_seconds=limits.max_run_seconds,
                memory_bytes=limits.memory_bytes,
                max_blob_bytes=max_blob_bytes,
                compile_user=limits.compile_user,
                should_stop=lease.should_stop,
            )
        _check_blob_size(result.blob_path, max_blob_bytes)
        _check_toolchain(job, result.toolchain, spec.target)
        reference = _reference(files, spec, job, model_row, work_dir, inputs, lease, limits)
        if lease.should_stop():  # cancelled while the compile was finishing: store nothing
            raise CompileCancelled("compile cancelled")
    except CompileCancelled:
        return lambda session: _finish(
            session, job, JobState.CANCELLED, error="cancelled while running"
        )
    except (CompileTimeout, errors.CompileError, errors.CompilerUnavailable) as error:
        message = str(error)  # `error` itself is unbound when the except block ends
        log_text = _failure_log(spec, message, error.output)
        return lambda session: _finish(
            session, job, JobState.FAILED, error=message, log_text=log_text
        )
    # The blob file is ours to give: a local store moves it in (one read, to hash it).
    stored = store.adopt_file(blob_storage_key(job.cache_key), result.blob_path)
    stored_reference = None
    if reference.path is not None:
        digest = sha256_file(reference.path)
        key = reference_storage_key(job.cache_key, digest)
        stored_reference = store.put_file(key, reference.path, expected_sha256=digest)
    release_free_memory()
    return lambda session: _record_blob(
        session,
        store,
        job,
        source_row,
        result,
        stored,
        output,
        signer,
        (stored_reference, reference.note),
    )


def _reference(files, spec, job, model_row, work_dir, inputs, lease, limits) -> ReferenceFile:
    """The blob's reference outputs, computed in a child after the compile's child has ended
    (their memory peaks never add up); skipped, with the reason kept, when the model is too
    large for the compile memory limit or the run fails (a blob without one is still a blob)."""
    # OpenVINO and numpy: loaded already where jobs run (the worker, the embedded submit).
    from farm.server.jobs.reference import skip_reason

    if not limits.reference_outputs:
        return ReferenceFile(None, "no reference outputs: FARM_REFERENCE_OUTPUTS is off")
    too_large = skip_reason(model_row.size_bytes, limits.memory_bytes)
    if too_large:
        return ReferenceFile(None, too_large)
    release_free_memory()
    with _work_disk(work_dir):
        path, note = reference_in_child(
            files,
            spec,
            work_dir / "reference",
            job.cache_key,
            inputs_path=inputs,
            timeout_seconds=limits.max_run_seconds,
            memory_bytes=limits.memory_bytes,
            max_reference_bytes=blob_size_limit(model_row.size_bytes, limits.max_blob_bytes),
            compile_user=limits.compile_user,
            should_stop=lease.should_stop,
        )
    return ReferenceFile(path, note)


def _run_stages(sessions, store, job, source_row, work_dir, lease, limits, model_cache):
    """The stage phase (farm.server.stages.phase): the model the compile reads."""
    from farm.server.stages.phase import StageLimits, run_recipe

    stage_limits = StageLimits(
        lease_seconds=limits.lease_seconds,
        timeout_seconds=limits.max_run_seconds,
        memory_bytes=limits.memory_bytes,
        max_output_bytes=blob_size_limit(source_row.size_bytes, limits.max_blob_bytes),
        compile_user=limits.compile_user,
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
    )


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
            _condemn(store, key, sha, role)
    elif stored is None:
        store.get_file(key, local)
        if sha256_file(local) != sha:
            _condemn(store, key, sha, role)
    else:
        # A link, not the store's own path: a model may name files relative to itself
        # (ONNX external data), and beside it must be its own folder, not other models.
        local.symlink_to(stored)
    return local


def _condemn(store: BlobStore, key: str, sha256: str, role: str) -> NoReturn:
    """A fetched model file whose bytes do not match its digest: read the stored object once
    more, and when it really is corrupt (not a transfer gone wrong), delete it. Objects are
    write-once, so a corrupt one would otherwise stay forever: the farm would report it present
    and turn the genuine bytes away. Once deleted, `missing` names it and an upload stores it.

    Note: an upload of the genuine bytes that lands between the check and the delete is
    deleted too; the next submit finds the file missing and uploads it again.
    """
    with contextlib.closing(store.open_read(key)) as body:
        actual = sha256_stream(body)
    if actual == sha256:
        raise StorageError(f"model file {key} changed on its way from storage; retrying")
    store.delete(key)
    log.warning("model file %s in storage has sha256 %s; deleted it", key, actual)
    raise ModelFileCorrupt(
        f"model file {key} (the model's {role}) was corrupt in storage (its bytes have sha256 "
        f"{actual}); it was removed: submit the model again to upload it"
    )


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
    reference: tuple[StoredObject | None, str | None] = (None, None),
):
    """`succeeded` and the blob row in one transaction, unless the job was cancelled while it
    finished: then the job ends cancelled and the object it stored is deleted (when no blob
    row of the same key, another job's, claims it)."""
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
        stored_reference, blob.reference_note = reference
        if stored_reference is not None:
            blob.reference_sha256 = stored_reference.sha256
            blob.reference_size_bytes = stored_reference.size
            sign_reference(blob, signer)
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


def _reference_line(reference: tuple[StoredObject | None, str | None]) -> str:
    stored, note = reference
    if stored is None:
        return note or "no reference outputs"
    return f"reference outputs: {stored.key}, {stored.size} bytes, sha256 {stored.sha256}"


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


class _Lease:
    """Renews the job's lease in the background and notices cancel requests."""

    def __init__(self, sessions, job_id: int, worker: str, lease_seconds: int) -> None:
        self.sessions, self.job_id, self.worker = sessions, job_id, worker
        self.lease_seconds = lease_seconds
        self.cancelled = threading.Event()
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lease-{job_id}", daemon=True)

    def __enter__(self) -> _Lease:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def should_stop(self) -> bool:
        return self.cancelled.is_set() or self.lost.is_set()

    def _run(self) -> None:
        # Renew every third of the lease, so two renewals can fail before it expires; the
        # same UPDATE reads the cancel flag, checked more often so a cancel is quick.
        interval = min(self.lease_seconds / 3, CANCEL_POLL_SECONDS)
        while not self._stop.wait(interval):
            try:
                self._renew()
            except Exception:
                log.warning("lease renewal for job %s failed", self.job_id, exc_info=True)

    def _renew(self) -> None:
        with self.sessions() as session:
            row = session.execute(
                update(Job)
                .where(
                    Job.id == self.job_id, Job.state == JobState.RUNNING, Job.worker == self.worker
                )
                .values(lease_expires_at=now() + timedelta(seconds=self.lease_seconds))
                .returning(Job.cancel_requested)
            ).first()
            session.commit()
        if row is None:
            log.warning("job %s is no longer ours; stopping its compile", self.job_id)
            self.lost.set()
        elif row.cancel_requested:
            self.cancelled.set()
