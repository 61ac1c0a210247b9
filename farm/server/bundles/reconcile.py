"""The reconciler's share of served pipeline bundles (§17): parts whose worker died (lease
expired) go back to their queue, or fail once they used up FARM_MAX_ATTEMPTS claims; queued
parts whose message may be lost are sent again. Runs with the jobs' reconciler (the beat's
`farm.reconcile`, `farm reconcile`); on PostgreSQL rows are taken FOR UPDATE SKIP LOCKED."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import timedelta

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from farm.core.clock import now
from farm.core.config import Settings
from farm.server.bundles.builds import FAILED, QUEUED, RUNNING, fail_builds, record_sent, send_part
from farm.server.db.models import BundlePart
from farm.server.jobs.dispatch import Dispatcher

log = logging.getLogger(__name__)


@dataclass
class PartsReport:
    failed: list[int] = field(default_factory=list)
    taken_back: list[int] = field(default_factory=list)
    resent: list[int] = field(default_factory=list)


def reconcile_parts(
    session: Session, settings: Settings, dispatcher: Dispatcher | None
) -> PartsReport:
    """Parts whose worker died (lease expired) go back to their queue, or fail once they used
    up FARM_MAX_ATTEMPTS; queued parts whose message may be lost are sent again."""
    report = PartsReport()
    at = now()
    expired = _lock(
        session,
        select(BundlePart).where(BundlePart.state == RUNNING, BundlePart.lease_expires_at < at),
    )
    for part in expired:
        if part.attempts >= settings.max_attempts:
            reason = (
                f"gave up after {part.attempts} attempts (FARM_MAX_ATTEMPTS): each ended "
                "without a result (the worker died); see the workers' logs"
            )
            part.state, part.error, part.finished_at, part.lease_expires_at = (
                FAILED,
                reason,
                at,
                None,
            )
            fail_builds(session, part, reason)
            report.failed.append(part.id)
            continue
        log.warning("bundle part %s: lease of %s expired; taking it back", part.id, part.worker)
        part.state, part.lease_expires_at = QUEUED, None
        report.taken_back.append(part.id)
    session.commit()
    resend_before = at - timedelta(seconds=settings.resend_after_seconds)
    stale = _lock(
        session,
        select(BundlePart).where(
            BundlePart.state == QUEUED,
            or_(
                BundlePart.sent_at.is_(None),
                BundlePart.sent_at < resend_before,
                BundlePart.id.in_(report.taken_back),
            ),
        ),
    )
    resend = [(p.id, p.queue) for p in stale]
    session.commit()
    if dispatcher is not None:
        try:
            for part_id, queue in resend:
                send_part(dispatcher, part_id, queue)
                report.resent.append(part_id)
        finally:
            record_sent(session, report.resent)
    return report


def _lock(session: Session, query) -> list[BundlePart]:
    if session.get_bind().dialect.name == "postgresql":
        query = query.with_for_update(skip_locked=True)
    return list(session.scalars(query))
