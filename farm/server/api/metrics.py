"""`GET /metrics`: Prometheus metrics computed from the database at scrape time.

Every number comes from the database, not from counters in this process, so each API replica
answers the same and a restart loses nothing. Counters stay monotonic because jobs are never
deleted and `farm gc` keeps the count of the pull reports it deletes (`blob_deletions.pulls`).

The numbers aggregate whole tables (a million jobs, five million pulls: seconds of database
work), so each process computes them at most every `FARM_METRICS_CACHE_SECONDS`, in the
background, and a scrape gets the last text at once (`farm.server.api.cached`).
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from sqlalchemy import case, func, select
from sqlalchemy.orm import Session, sessionmaker

from farm.core.clock import now
from farm.core.vocabulary import JOB_STATES, JobState
from farm.server.api.cached import Cached
from farm.server.api.deps import caller_with, farm_of
from farm.server.context import FarmContext
from farm.server.db.models import Blob, BlobDeletion, Job, Pull, Verification, Worker
from farm.server.routing import MISSED_HEARTBEATS
from farm.server.tokens import Caller

COMPILE_SECONDS_BUCKETS = (1, 5, 15, 60, 300, 900, 1800, 3600, 3 * 3600)
"""Upper bounds of the compile time histogram, seconds: tiny CPU models to large NPU ones."""

router = APIRouter()
any_role = Depends(caller_with("pull"))


class FarmCollector(Collector):
    def __init__(self, sessions: sessionmaker[Session], heartbeat_seconds: int) -> None:
        self.sessions = sessions
        self.heartbeat_seconds = heartbeat_seconds

    def collect(self) -> Iterator[Metric]:
        with self.sessions() as session:
            yield from self._jobs(session)
            yield self._compile_seconds(session)
            yield from self._blobs(session)
            yield self._pulls(session)
            yield from self._verifications(session)
            yield self._workers(session)

    def _jobs(self, session: Session) -> Iterator[Metric]:
        jobs = GaugeMetricFamily(
            "farm_jobs", "Jobs by state and target.", labels=["state", "target"]
        )
        counts = session.execute(
            select(Job.state, Job.target, func.count()).group_by(Job.state, Job.target)
        ).all()
        targets = sorted({target for _, target, _ in counts})
        seen = {(state, target): n for state, target, n in counts}
        for state in JOB_STATES:  # zeros too, so a state that empties drops to 0 on graphs
            for target in targets:
                jobs.add_metric([state, target], seen.get((state, target), 0))
        yield jobs
        depth = GaugeMetricFamily(
            "farm_queue_depth", "Queued jobs by queue and target.", labels=["queue", "target"]
        )
        rows = session.execute(
            select(Job.queue, Job.target, func.count())
            .where(Job.state == JobState.QUEUED)
            .group_by(Job.queue, Job.target)
        )
        for queue, target, n in rows:
            depth.add_metric([queue, target], n)
        yield depth

    def _compile_seconds(self, session: Session) -> Metric:
        histogram = HistogramMetricFamily(
            "farm_compile_seconds",
            "OpenVINO compile time of succeeded jobs, seconds.",
            labels=["target"],
        )
        bounds = [
            func.sum(case((Job.compile_seconds <= bound, 1), else_=0))
            for bound in COMPILE_SECONDS_BUCKETS
        ]
        rows = session.execute(
            select(Job.target, func.count(), func.sum(Job.compile_seconds), *bounds)
            .where(Job.state == JobState.SUCCEEDED, Job.compile_seconds.is_not(None))
            .group_by(Job.target)
        )
        for target, count, total, *cumulative in rows:
            buckets = [
                (str(float(b)), int(n))
                for b, n in zip(COMPILE_SECONDS_BUCKETS, cumulative, strict=True)
            ]
            histogram.add_metric([target], [*buckets, ("+Inf", count)], float(total or 0))
        return histogram

    def _blobs(self, session: Session) -> Iterator[Metric]:
        count = GaugeMetricFamily("farm_blobs", "Stored blobs by target.", labels=["target"])
        size = GaugeMetricFamily(
            "farm_blob_bytes", "Bytes of stored blobs by target.", labels=["target"]
        )
        rows = session.execute(
            select(Blob.target, func.count(), func.sum(Blob.size_bytes)).group_by(Blob.target)
        )
        for target, n, total in rows:
            count.add_metric([target], n)
            size.add_metric([target], int(total or 0))
        yield count
        yield size

    def _pulls(self, session: Session) -> Metric:
        pulls = CounterMetricFamily(
            "farm_pulls", "Pull reports from edges, by target and outcome.", labels=["target", "ok"]
        )
        totals: dict[tuple[str, str], int] = {}
        rows = session.execute(
            select(Blob.target, Pull.ok, func.count())
            .join(Blob, Blob.id == Pull.blob_id)
            .group_by(Blob.target, Pull.ok)
        )
        for target, ok, n in rows:
            totals[(target, str(bool(ok)).lower())] = n
        gone = session.execute(  # reports `farm gc` deleted with their blobs
            select(
                BlobDeletion.target,
                func.sum(BlobDeletion.pulls - BlobDeletion.failed_pulls),
                func.sum(BlobDeletion.failed_pulls),
            ).group_by(BlobDeletion.target)
        )
        for target, delivered, failed in gone:
            for label, n in (("true", delivered), ("false", failed)):
                totals[(target, label)] = totals.get((target, label), 0) + int(n or 0)
        for (target, label), n in sorted(totals.items()):
            pulls.add_metric([target, label], n)
        return pulls

    def _verifications(self, session: Session) -> Iterator[Metric]:
        """Verifications are never deleted (a deleted blob's keep a null blob_id): a counter."""
        verified = CounterMetricFamily(
            "farm_verifications",
            "Edge verifications of blobs against their reference outputs, by target and result.",
            labels=["target", "result"],
        )
        rows = session.execute(
            select(Verification.target, Verification.passed, func.count()).group_by(
                Verification.target, Verification.passed
            )
        )
        for target, passed, n in sorted(rows, key=lambda row: (row[0], bool(row[1]))):
            verified.add_metric([target, "passed" if passed else "failed"], n)
        yield verified
        quarantined = GaugeMetricFamily(
            "farm_blobs_quarantined", "Blobs quarantined now, by target.", labels=["target"]
        )
        counts = session.execute(
            select(Blob.target, func.count())
            .where(Blob.quarantined_at.is_not(None))
            .group_by(Blob.target)
        )
        for target, n in counts:
            quarantined.add_metric([target], n)
        yield quarantined

    def _workers(self, session: Session) -> Metric:
        since = now() - timedelta(seconds=self.heartbeat_seconds * MISSED_HEARTBEATS)
        live = session.scalar(
            select(func.count())
            .select_from(Worker)
            .where(Worker.heartbeat_at >= since, Worker.stopped_at.is_(None))
        )
        return GaugeMetricFamily(
            "farm_workers_live", "Workers with a recent heartbeat and no shutdown.", value=live
        )


def registry_for(sessions: sessionmaker[Session], heartbeat_seconds: int) -> CollectorRegistry:
    # A registry of our own, not the global one: the farm's numbers only, and no clash when
    # several apps live in one process (tests).
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FarmCollector(sessions, heartbeat_seconds))
    return registry


@router.get("/metrics", tags=["health"], response_class=Response)
def metrics(request: Request, _: Caller = any_role) -> Response:
    """Prometheus text format. Needs a token (any role): scrape with `authorization`. The
    numbers are at most `FARM_METRICS_CACHE_SECONDS` (plus one computation) old."""
    text = metrics_text(request.app, farm_of(request)).get()
    return Response(text, media_type=CONTENT_TYPE_LATEST)


def metrics_text(app: Any, farm: FarmContext) -> Cached[bytes]:
    """This process's `/metrics` text, made on first use (or at start: `Cached.warm`)."""
    if getattr(app.state, "metrics_text", None) is None:
        registry = registry_for(farm.sessions, farm.settings.worker_heartbeat_seconds)
        app.state.metrics_text = Cached(
            lambda: generate_latest(registry), farm.settings.metrics_cache_seconds
        )
    return app.state.metrics_text
