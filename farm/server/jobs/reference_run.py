"""A blob's reference run, after its job succeeded (docs/architecture.md §6, §14).

A job is `succeeded`, and its blob pullable, as soon as the blob is stored: the blob row is
recorded with its reference `pending`, and this run follows it. It claims the pending
reference (a conditional UPDATE of the blob row, like a job's claim), computes it in the
sandbox's reference child (`sandbox.reference_in_child`: the compile's limits, user and
environment), stores it, and records it signed (`ready`), or records why there is none
(`skipped`, with the reason: too large for the memory budget, a dynamic shape, a failed run).
A verification waits while it is pending (`farm.edge.verify`); it is never a failure.

Where it runs:
- a worker runs it as the tail of the compile task, with the model files still in the job's
  folder (nothing fetched again); the pool process is busy until it ends, as before, but the
  job's submitter is not;
- the embedded farm hands it to a detached process (`detach`: ``python -m
  farm.server.jobs.reference_run BLOB_ID``), so `farm submit` returns when the blob is stored;
- the reconciler finds a run whose process died (its lease expired, or it was never claimed)
  and sends it again (`farm.reference`, or a detached process for the embedded farm, where a
  command that resolves a blob whose run is lost also does it:
  `reconcile.resend_lost_references`); each
  send is an attempt, the send carries its number, and past the job's `max_attempts` it
  records the reference skipped.

Note: a worker that runs the tail holds its lease on the blob row (renewed every third of
`lease_seconds`); a worker that dies mid-run leaves the lease to expire.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session, sessionmaker

from farm.core.clock import now
from farm.core.errors import CompileCancelled, ModelFileCorrupt
from farm.core.hashing import sha256_file
from farm.core.signing import Signer
from farm.core.spec import CompileSpec
from farm.core.vocabulary import EMBEDDED_QUEUE, ReferenceState
from farm.server.blobs.signatures import sign_reference
from farm.server.db.models import Blob, Job, JobPhase, Model
from farm.server.db.session import rows_changed
from farm.server.leases import Renewing
from farm.server.storage import BlobStore, StoredObject, reference_storage_key

log = logging.getLogger(__name__)

PENDING, READY, SKIPPED = ReferenceState.PENDING, ReferenceState.READY, ReferenceState.SKIPPED
SEND_LEASE = timedelta(minutes=30)
"""How long a run the reconciler sent may wait in its queue before it is sent again (each send
is one of the job's attempts): the compile queue it goes to may hold a backlog."""


@dataclass(frozen=True)
class Prepared:
    """What the compile already has on this host: the compiled model's files, the submitter's
    inputs, the source a convert stage made the model from (`runner._reference_source`)."""

    files: dict[str, Path]
    inputs: Path | None = None
    source: tuple[str, dict[str, Path]] | None = None


def claim(
    session: Session,
    blob_id: int,
    lease_seconds: float,
    max_attempts: int,
    granted: int | None = None,
) -> int | None:
    """Take the blob's pending reference; its attempt number (the claim), or None: not ours
    to run (ready, skipped, held by a live run, out of attempts, or a send superseded).

    `granted`: the attempt a reconciler's send carries, already counted; the run holds it as
    long as no later send replaced it. Without it (the run after the compile), an unclaimed
    or expired reference is taken as a new attempt."""
    at = now()
    lease = at + timedelta(seconds=lease_seconds)
    pending = (Blob.id == blob_id) & (Blob.reference_state == PENDING)
    if granted is not None:
        row = session.execute(
            update(Blob)
            .where(pending, Blob.reference_attempts == granted)
            .values(reference_lease_expires_at=lease)
            .returning(Blob.reference_attempts)
        ).first()
    else:
        row = session.execute(
            update(Blob)
            .where(
                pending,
                or_(
                    Blob.reference_lease_expires_at.is_(None),
                    Blob.reference_lease_expires_at < at,
                ),
                Blob.reference_attempts < max_attempts,
            )
            .values(
                reference_attempts=Blob.reference_attempts + 1, reference_lease_expires_at=lease
            )
            .returning(Blob.reference_attempts)
        ).first()
    session.commit()
    return None if row is None else int(row[0])


def run_reference(
    sessions: sessionmaker[Session],
    store: BlobStore,
    blob_id: int,
    limits,
    signer: Signer | None,
    *,
    model_cache=None,
    work_root: Path | None = None,
    prepared: Prepared | None = None,
    granted: int | None = None,
) -> str | None:
    """Run blob `blob_id`'s pending reference to its end if it can be claimed; the state it
    ends in (None: not ours to run). `limits`: the worker's `runner.RunLimits`. `prepared`:
    the files already here (the compile's); else they are fetched as for a compile.

    Infrastructure errors (storage, database) release the claim and propagate; the
    reconciler sends the run again."""
    with sessions() as session:
        blob = session.get(Blob, blob_id)
        job = session.get(Job, blob.job_id) if blob is not None and blob.job_id else None
        max_attempts = job.max_attempts if job is not None else 1
        attempt = claim(session, blob_id, limits.lease_seconds, max_attempts, granted)
        if attempt is None or blob is None:
            return None
        if job is None:  # the job row is gone: nothing says how the model was prepared
            return _record(session, blob_id, attempt, None, "no reference outputs: no job")
    started_at, began = now(), time.monotonic()
    lease = _lease(sessions, blob_id, attempt, limits.lease_seconds)
    work_dir = Path(tempfile.mkdtemp(prefix=f"farm-reference-{blob_id}-", dir=work_root))
    try:
        with lease:
            path, note = None, None
            try:
                if prepared is None:
                    prepared = _prepare(sessions, store, job, work_dir, model_cache)
                path, note = _compute(prepared, blob, work_dir, limits, lease)
            except (ReferenceUnavailable, ModelFileCorrupt) as error:
                note = f"no reference outputs: {error}"
            except CompileCancelled:  # the lease was lost: another run holds it
                pass
            stored = None
            if path is not None and not lease.lost.is_set():
                digest = sha256_file(path)
                key = reference_storage_key(blob.cache_key, digest)
                stored = store.put_file(key, path, expected_sha256=digest)
        if lease.lost.is_set():  # another run holds it now (this one outlived its lease)
            return None
        phase = JobPhase(
            job_id=job.id,
            attempt=job.attempts,
            phase="reference",
            started_at=started_at,
            seconds=time.monotonic() - began,
        )
        with sessions() as session:
            ended = _record(session, blob_id, attempt, stored, note, signer, phase)
            if ended is None and stored is not None and session.get(Blob, blob_id) is None:
                store.delete(stored.key)  # the blob was deleted meanwhile (gc, a rebuild)
            return ended
    except Exception:
        _release(sessions, blob_id, attempt)
        raise
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)


def _prepare(sessions, store, job: Job, work_dir: Path, model_cache) -> Prepared:
    """The compiled model's files (the stage's output for a recipe), inputs and source,
    fetched here as a compile fetches them."""
    from farm.server.jobs import runner
    from farm.server.stages import catalog

    with sessions() as session:
        source_row = session.get_one(Model, job.model_id)
        model_row = source_row
        if job.recipe:
            stage = catalog.find(session, job.stage_key) if job.stage_key else None
            if stage is None or stage.output_model_id is None:
                raise ReferenceUnavailable("its stage's output model is no longer recorded")
            model_row = session.get_one(Model, stage.output_model_id)
        session.expunge_all()
    files = runner._fetch_model(store, model_row, work_dir / "model", model_cache)
    inputs = runner._fetch_inputs(store, job, work_dir, model_cache)
    source = runner._reference_source(store, job, source_row, work_dir, model_cache)
    return Prepared(files, inputs, source)


class ReferenceUnavailable(Exception):
    """Nothing to compute the reference from (recorded as its note)."""


def _compute(prepared: Prepared, blob: Blob, work_dir: Path, limits, lease):
    """(reference file, None) or (None, why not): the sandbox's reference child."""
    from farm.server.jobs.reference import skip_reason
    from farm.server.jobs.runner import _blob_limit_of
    from farm.server.jobs.sandbox import reference_in_child
    from farm.server.memory import release_free_memory

    model_bytes = sum(path.stat().st_size for path in prepared.files.values())
    too_large = skip_reason(model_bytes, limits.memory_bytes)
    if too_large:
        return None, too_large
    release_free_memory()
    return reference_in_child(
        prepared.files,
        CompileSpec.from_canonical(blob.target, blob.spec),
        work_dir / "reference",
        blob.cache_key,
        inputs_path=prepared.inputs,
        timeout_seconds=limits.max_run_seconds,
        memory_bytes=limits.memory_bytes,
        max_reference_bytes=_blob_limit_of(model_bytes, limits),
        compile_user=limits.compile_user,
        compile_launcher=limits.compile_launcher,
        should_stop=lease.lost.is_set,
        source=prepared.source,
    )


def _record(
    session: Session,
    blob_id: int,
    attempt: int,
    stored: StoredObject | None,
    note: str | None,
    signer: Signer | None = None,
    phase: JobPhase | None = None,
) -> str | None:
    """The run's end on the blob row, if the claim is still this run's: `ready` and signed,
    or `skipped` with `note`; the job's log gains the line, its phases `phase`, in the same
    transaction. None: the claim was lost."""
    blob = session.get(Blob, blob_id, populate_existing=True)
    if blob is None or blob.reference_state != PENDING or blob.reference_attempts != attempt:
        session.rollback()
        return None
    if stored is not None:
        blob.reference_sha256, blob.reference_size_bytes = stored.sha256, stored.size
        blob.reference_note, blob.reference_state = None, READY
        sign_reference(blob, signer)
        line = f"reference outputs: {stored.key}, {stored.size} bytes, sha256 {stored.sha256}"
    else:
        blob.reference_note = note or "no reference outputs"
        blob.reference_state = SKIPPED
        line = blob.reference_note
    blob.reference_lease_expires_at = None
    if blob.job_id is not None:
        job = session.get(Job, blob.job_id)
        if job is not None:
            job.log = f"{job.log or ''}\n{line}".lstrip("\n")
    if phase is not None:
        session.add(phase)
    session.commit()
    return str(blob.reference_state)


def record_skipped(session: Session, blob: Blob, note: str) -> None:
    """A pending reference that will not come (the reconciler, past its attempts); the caller
    holds the row and commits."""
    blob.reference_state, blob.reference_note = SKIPPED, note
    blob.reference_lease_expires_at = None


def _release(sessions: sessionmaker[Session], blob_id: int, attempt: int) -> None:
    """Give the claim back after an infrastructure error: the reconciler sends it again."""
    try:
        with sessions() as session:
            rows_changed(
                session,
                update(Blob)
                .where(
                    Blob.id == blob_id,
                    Blob.reference_state == PENDING,
                    Blob.reference_attempts == attempt,
                )
                .values(reference_lease_expires_at=None),
            )
            session.commit()
    except Exception:
        log.warning("could not release blob %s's reference run", blob_id, exc_info=True)


def pending_runs(session: Session, at, resend_after: timedelta) -> list[tuple[Blob, str]]:
    """Pending references whose run is lost, with their job's queue: a lease that expired, or
    never claimed `resend_after` after the blob was recorded (a run that never started)."""
    lost = or_(
        Blob.reference_lease_expires_at < at,
        Blob.reference_lease_expires_at.is_(None) & (Blob.created_at < at - resend_after),
    )
    query = (
        select(Blob, Job.queue)
        .outerjoin(Job, Job.id == Blob.job_id)
        .where(Blob.reference_state == PENDING, lost)
    )
    if session.get_bind().dialect.name == "postgresql":
        query = query.with_for_update(of=Blob, skip_locked=True)
    return [(blob, queue or EMBEDDED_QUEUE) for blob, queue in session.execute(query)]


def grant(blob: Blob, at) -> int:
    """Count a send of `blob`'s run as its next attempt (the caller commits); its number."""
    blob.reference_attempts += 1
    blob.reference_lease_expires_at = at + SEND_LEASE
    return blob.reference_attempts


_DETACHED: list[subprocess.Popen] = []
"""The runs this process started: held so that none is collected while it runs (Python warns
of a running child it forgets), reaped when the next one starts."""


def detach(blob_id: int, granted: int | None = None) -> subprocess.Popen:
    """Run the reference in a process of its own that outlives this one (the embedded farm:
    `farm submit` returns when the blob is stored). Its output goes to nowhere: what it
    records is on the blob row and in the job's log."""
    command = [sys.executable, "-m", "farm.server.jobs.reference_run", str(blob_id)]
    if granted is not None:
        command.append(str(granted))
    _DETACHED[:] = [process for process in _DETACHED if process.poll() is None]
    process = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # not killed with the submitter's terminal or process group
        close_fds=True,
    )
    _DETACHED.append(process)
    return process


def _lease(sessions, blob_id: int, attempt: int, lease_seconds: float) -> Renewing:
    """The run's lease on the blob row; lost when the row is no longer this run's."""

    def renew() -> bool:
        with sessions() as session:
            changed = rows_changed(
                session,
                update(Blob)
                .where(
                    Blob.id == blob_id,
                    Blob.reference_state == PENDING,
                    Blob.reference_attempts == attempt,
                )
                .values(reference_lease_expires_at=now() + timedelta(seconds=lease_seconds)),
            )
            session.commit()
        return bool(changed)

    return Renewing(renew, lease_seconds / 3, f"the reference run of blob {blob_id}")


def main(argv: list[str]) -> int:
    """``python -m farm.server.jobs.reference_run BLOB_ID [ATTEMPT]``: the detached run."""
    from farm.core.config import get_settings
    from farm.server.context import FarmContext

    blob_id, granted = int(argv[0]), int(argv[1]) if len(argv) > 1 else None
    farm = FarmContext(get_settings(), worker=f"{socket.gethostname()}:{os.getpid()}")
    state = run_reference(
        farm.sessions,
        farm.store,
        blob_id,
        farm.run_limits,
        farm.signer,
        model_cache=farm.model_cache,
        granted=granted,
    )
    log.info("blob %s's reference: %s", blob_id, state or "not ours to run")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
