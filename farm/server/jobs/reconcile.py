"""The reconciler: what slipped through the queue is picked up from the database.

Runs periodically (Celery beat → the `control` queue) or as `farm reconcile`. Each pass:
- fails jobs that used up their attempts (every claim counts: a worker that died, an
  infrastructure error) or waited in the queue past the maximum;
- takes back running jobs whose lease expired (their worker died) and re-sends them;
- re-sends queued jobs whose message may be lost (below);
- aborts multipart uploads idle past `stale_upload_seconds` (no part received for that long),
  and in a local store deletes the partial files of writers that died, idle as long;
- sends again the reference runs that were lost (`reference_run`): a blob's reference still
  `pending` whose run's lease expired (its worker or detached process died), or that no run
  claimed `resend_after_seconds` after the blob was recorded. Each send is one of the job's
  attempts; past them the reference is recorded `skipped`, saying so. A pending reference is
  never a failure of its job: the job succeeded when its blob was stored.
On PostgreSQL, rows are taken with FOR UPDATE SKIP LOCKED so two reconcilers never collide.

Which queued jobs are re-sent. A message is lost only when the broker loses it (a Redis restart
without its AOF, a flushed queue); a job that is merely waiting behind a backlog still has its
message in the queue, and re-sending it every `resend_after_seconds` re-sent the whole backlog
on every beat (measured: 2,617 queued jobs, 27 s of publishes and commits per pass, and as many
duplicate messages each time). The broker could be asked what its queue holds, but that ties
the rule to Redis and reads the whole backlog per pass. So the rule backs off per job, from the
columns it already has: a job is re-sent when its last message (`sent_at`) is older than the
job was when that message was sent (`sent_at - created_at`), at least `resend_after_seconds`
and at most `RESEND_BACKOFF_MAX` — the intervals double, 5, 5, 10, 20, 40 min... then hourly.
A lost message is still found (within an hour, at worst), a never-sent job or one taken back
is sent at once, and a waiting backlog of N jobs costs about log2 of its wait in re-sends per
job instead of one per beat. Sends are recorded with one UPDATE per pass, not a commit each.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session

from farm.core.clock import now
from farm.core.config import Settings
from farm.core.vocabulary import EMBEDDED_QUEUE, REFERENCE_TASK, JobState
from farm.server.db.models import Job
from farm.server.jobs import reference_run
from farm.server.jobs.dispatch import CeleryDispatcher, Dispatcher
from farm.server.storage import AbortsStaleUploads, BlobStore

log = logging.getLogger(__name__)

RESEND_BACKOFF_MAX = timedelta(hours=1)
"""The longest a queued job waits between re-sends of its message (the backoff's ceiling)."""


@dataclass
class ReconcileReport:
    failed: list[int] = field(default_factory=list)
    taken_back: list[int] = field(default_factory=list)
    resent: list[int] = field(default_factory=list)
    cancelled: list[int] = field(default_factory=list)
    """Running jobs whose cancel was requested and whose worker died: ended as cancelled."""
    aborted_uploads: list[str] = field(default_factory=list)
    references_resent: list[int] = field(default_factory=list)
    """Blobs whose lost reference run was sent again."""
    references_skipped: list[int] = field(default_factory=list)
    """Blobs whose reference runs were lost past their attempts: recorded skipped."""


SendReference = Callable[[int, int, str], None]
"""Sends blob `blob_id`'s reference run, attempt `attempt`, to `queue`."""


def reconcile(
    session: Session,
    store: BlobStore,
    settings: Settings,
    dispatcher: Dispatcher | None,
    send_reference: SendReference | None = None,
) -> ReconcileReport:
    """One pass; lost messages are re-sent through `dispatcher` (None: nowhere to send).
    Lost reference runs go to `send_reference` (default `reference_sender(dispatcher)`)."""
    report = ReconcileReport()
    at = now()

    exhausted = _lock(
        session,
        select(Job).where(
            Job.state.in_((JobState.QUEUED, JobState.RUNNING)),
            Job.attempts >= Job.max_attempts,
            or_(Job.state == JobState.QUEUED, Job.lease_expires_at < at),
        ),
    )
    for job in exhausted:
        _fail(
            job,
            f"gave up after {job.attempts} attempts (FARM_MAX_ATTEMPTS): each ended without a "
            "result (the worker died, or storage, database or broker failed); see the workers' "
            "logs",
        )
        report.failed.append(job.id)

    waited = _lock(
        session,
        select(Job).where(
            Job.state == JobState.QUEUED,
            Job.created_at < at - timedelta(seconds=settings.max_queue_seconds),
        ),
    )
    for job in waited:
        _fail(
            job,
            f"waited in queue {job.queue} longer than {settings.max_queue_seconds} s; "
            "no live worker took it (farm workers)",
        )
        report.failed.append(job.id)
    session.commit()

    expired = _lock(
        session, select(Job).where(Job.state == JobState.RUNNING, Job.lease_expires_at < at)
    )
    for job in expired:
        if job.cancel_requested:  # no claim would take it: end it as its cancel asked
            job.state, job.error = JobState.CANCELLED, "cancelled while running"
            job.finished_at, job.lease_expires_at = now(), None
            report.cancelled.append(job.id)
            continue
        log.warning("job %s: lease of %s expired; taking it back", job.id, job.worker)
        job.state, job.lease_expires_at = JobState.QUEUED, None
        report.taken_back.append(job.id)
    session.commit()

    resend_after = timedelta(seconds=settings.resend_after_seconds)
    stale = _lock(
        session,
        select(Job).where(
            Job.state == JobState.QUEUED,
            Job.queue != "embedded",
            or_(
                Job.sent_at.is_(None),
                Job.sent_at < at - resend_after,
                Job.id.in_(report.taken_back),
            ),
        ),
    )
    resend = [
        (job.id, job.queue)
        for job in stale
        if job.id in report.taken_back or may_be_lost(job, at, resend_after)
    ]
    session.commit()
    if dispatcher is not None and resend:
        try:
            for job_id, queue in resend:
                dispatcher.send(job_id, queue)
                report.resent.append(job_id)
        finally:  # what was sent is recorded, even if the broker failed part way
            if report.resent:
                session.execute(update(Job).where(Job.id.in_(report.resent)).values(sent_at=now()))
                session.commit()

    _lost_references(session, settings, send_reference or reference_sender(dispatcher), report)

    if isinstance(store, AbortsStaleUploads):
        report.aborted_uploads = store.abort_stale_uploads(
            timedelta(seconds=settings.stale_upload_seconds)
        )
    return report


def resend_lost_references(session: Session, settings: Settings) -> ReconcileReport:
    """Only the reconciler's reference step, for the embedded farm (its lost runs go to
    detached processes on this host); what it resent or skipped."""
    report = ReconcileReport()
    _lost_references(session, settings, reference_sender(None), report)
    return report


def _lost_references(
    session: Session, settings: Settings, send: SendReference, report: ReconcileReport
) -> None:
    """Pending references whose run is lost: sent again, or past their attempts skipped.
    The send is recorded (as the next attempt) before it goes out: a run that starts before
    the commit would find its attempt not yet granted and do nothing."""
    at = now()
    lost = reference_run.pending_runs(session, at, timedelta(seconds=settings.resend_after_seconds))
    sends = []
    for blob, queue in lost:
        job = session.get(Job, blob.job_id) if blob.job_id is not None else None
        attempts = job.max_attempts if job is not None else settings.max_attempts
        if blob.reference_attempts >= attempts:
            reference_run.record_skipped(
                session,
                blob,
                f"no reference outputs: {blob.reference_attempts} runs ended without a result "
                "(their worker died, or storage or the database failed); see the workers' logs",
            )
            report.references_skipped.append(blob.id)
            continue
        sends.append((blob.id, reference_run.grant(blob, at), queue))
    session.commit()
    for blob_id, attempt, queue in sends:
        try:
            send(blob_id, attempt, queue)
        except Exception:  # the lease granted expires and the next pass sends it again
            log.warning("could not send blob %s's reference run", blob_id, exc_info=True)
            continue
        report.references_resent.append(blob_id)


def reference_sender(dispatcher: Dispatcher | None) -> SendReference:
    """Where a lost reference run goes: the embedded farm's to a detached process on this
    host; a served farm's to its job's queue, through the broker (`farm.reference`)."""

    def send(blob_id: int, attempt: int, queue: str) -> None:
        if queue == EMBEDDED_QUEUE:
            reference_run.detach(blob_id, attempt)
        elif isinstance(dispatcher, CeleryDispatcher):
            dispatcher.app.send_task(REFERENCE_TASK, args=[blob_id, attempt], queue=queue)
        else:
            raise RuntimeError("no broker to send the reference run to")

    return send


def may_be_lost(job: Job, at: datetime, resend_after: timedelta) -> bool:
    """Whether a queued job's message is due for a re-send at `at` (the module's rule): never
    sent, or sent longer ago than the job's age at that send, bounded by `resend_after` and
    `RESEND_BACKOFF_MAX`."""
    if job.sent_at is None:
        return True
    age_when_sent = max(job.sent_at - job.created_at, timedelta(0))
    wait = min(max(age_when_sent, resend_after), max(RESEND_BACKOFF_MAX, resend_after))
    return at - job.sent_at >= wait


def _lock(session: Session, query) -> list[Job]:
    if session.get_bind().dialect.name == "postgresql":
        query = query.with_for_update(skip_locked=True)
    return list(session.scalars(query))


def _fail(job: Job, reason: str) -> None:
    job.state, job.error, job.finished_at, job.lease_expires_at = (
        JobState.FAILED,
        reason,
        now(),
        None,
    )
