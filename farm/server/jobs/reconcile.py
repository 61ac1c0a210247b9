"""The reconciler: what slipped through the queue is picked up from the database.

Runs periodically (Celery beat → the `control` queue) or as `farm reconcile`. Each pass:
- fails jobs that used up their attempts (every claim counts: a worker that died, an
  infrastructure error) or waited in the queue past the maximum;
- takes back running jobs whose lease expired (their worker died) and re-sends them;
- re-sends queued jobs whose message is older than `resend_after_seconds` (a lost message);
- aborts multipart uploads idle past `stale_upload_seconds` (no part received for that long).
On PostgreSQL, rows are taken with FOR UPDATE SKIP LOCKED so two reconcilers never collide.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import timedelta

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from farm.core.clock import now
from farm.core.config import Settings
from farm.core.vocabulary import JobState
from farm.server.db.models import Job
from farm.server.jobs.dispatch import Dispatcher, dispatch
from farm.server.storage import AbortsStaleUploads, BlobStore

log = logging.getLogger(__name__)


@dataclass
class ReconcileReport:
    failed: list[int] = field(default_factory=list)
    taken_back: list[int] = field(default_factory=list)
    resent: list[int] = field(default_factory=list)
    cancelled: list[int] = field(default_factory=list)
    """Running jobs whose cancel was requested and whose worker died: ended as cancelled."""
    aborted_uploads: list[str] = field(default_factory=list)


def reconcile(
    session: Session,
    store: BlobStore,
    settings: Settings,
    dispatcher: Dispatcher | None,
) -> ReconcileReport:
    """One pass; lost messages are re-sent through `dispatcher` (None: nowhere to send)."""
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

    stale = _lock(
        session,
        select(Job).where(
            Job.state == JobState.QUEUED,
            Job.queue != "embedded",
            or_(
                Job.sent_at.is_(None),
                Job.sent_at < at - timedelta(seconds=settings.resend_after_seconds),
                Job.id.in_(report.taken_back),
            ),
        ),
    )
    resend = [(job.id, job.queue) for job in stale]
    session.commit()
    if dispatcher is not None:
        for job_id, queue in resend:
            dispatch(session, dispatcher, job_id, queue)
            report.resent.append(job_id)

    if isinstance(store, AbortsStaleUploads):
        report.aborted_uploads = store.abort_stale_uploads(
            timedelta(seconds=settings.stale_upload_seconds)
        )
    return report


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
