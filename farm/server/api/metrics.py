"""`GET /metrics`: Prometheus metrics from counters the database keeps as rows are written.

Every number comes from the database, not from counters in this process, so each API replica
answers the same and a restart loses nothing. The counts (jobs by state, target and queue,
compile times, blobs and bytes, quarantined blobs, pulls, verifications) are kept by triggers
in the table metric_counts (migration 0022), in the transaction that writes the rows they count:
a scrape sums a few hundred rows instead of aggregating 1.1M jobs and 5M pulls (3.4 s cold at
that scale). Pull and verification counts only grow: a pull deleted by `farm gc` stays counted.
Live workers are counted from the workers table (a few hundred rows).

Each process still computes the text at most every `FARM_METRICS_CACHE_SECONDS`, in the
background (`farm.server.api.cached`); a computation now costs milliseconds.
"""

from __future__ import annotations

from collections import defaultdict
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
from sqlalchemy import func, select, text
from sqlalchemy.orm import Session, sessionmaker

from farm.core.clock import now
from farm.core.vocabulary import JOB_STATES, JobState
from farm.server.api.cached import Cached
from farm.server.api.deps import caller_with, farm_of
from farm.server.context import FarmContext
from farm.server.db.models import MetricCount, Worker
from farm.server.routing import MISSED_HEARTBEATS
from farm.server.tokens import Caller

COMPILE_SECONDS_BUCKETS = (1, 5, 15, 60, 300, 900, 1800, 3600, 3 * 3600)
"""Upper bounds of the compile time histogram, seconds: tiny CPU models to large NPU ones. The
triggers of migration 0022 count each job in its bucket: changing these needs a migration."""

router = APIRouter()
any_role = Depends(caller_with("pull"))

Counts = dict[tuple[str, str, str, str], tuple[int, float]]
"""(family, label1, label2, label3) -> (count, sum): see the table metric_counts."""


def fold(session: Session) -> None:
    """Sum metric_counts into one row per label set (and commit). PostgreSQL: the migration's
    function (one statement, one snapshot; skipped while another fold runs). SQLite: one
    writer at a time, so the rows up to the highest id are summed and deleted."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SELECT farm_fold_metric_counts()"))
    else:
        top = session.scalar(select(func.max(MetricCount.id)))
        if top is not None:
            labels = (
                MetricCount.family,
                MetricCount.label1,
                MetricCount.label2,
                MetricCount.label3,
            )
            summed = session.execute(
                select(*labels, func.sum(MetricCount.n), func.sum(MetricCount.total))
                .where(MetricCount.id <= top)
                .group_by(*labels)
            ).all()
            session.query(MetricCount).filter(MetricCount.id <= top).delete()
            session.add_all(
                MetricCount(family=f, label1=a, label2=b, label3=c, n=n, total=t)
                for f, a, b, c, n, t in summed
                if n or t
            )
    session.commit()


def read_counts(session: Session) -> Counts:
    """Every counter, folding first so the rows read stay few."""
    fold(session)
    labels = (MetricCount.family, MetricCount.label1, MetricCount.label2, MetricCount.label3)
    rows = session.execute(
        select(*labels, func.sum(MetricCount.n), func.sum(MetricCount.total)).group_by(*labels)
    )
    return {(f, a, b, c): (int(n), float(t)) for f, a, b, c, n, t in rows if n or t}


class FarmCollector(Collector):
    def __init__(self, sessions: sessionmaker[Session], heartbeat_seconds: int) -> None:
        self.sessions = sessions
        self.heartbeat_seconds = heartbeat_seconds

    def collect(self) -> Iterator[Metric]:
        with self.sessions() as session:
            counts = read_counts(session)
            yield from self._jobs(counts)
            yield self._compile_seconds(counts)
            yield from self._blobs(counts)
            yield self._pulls(counts)
            yield from self._verifications(counts)
            yield self._workers(session)

    def _jobs(self, counts: Counts) -> Iterator[Metric]:
        jobs = GaugeMetricFamily(
            "farm_jobs", "Jobs by state and target.", labels=["state", "target"]
        )
        depth = GaugeMetricFamily(
            "farm_queue_depth", "Queued jobs by queue and target.", labels=["queue", "target"]
        )
        seen: dict[tuple[str, str], int] = defaultdict(int)
        for (family, state, target, queue), (n, _) in sorted(counts.items()):
            if family == "jobs":
                seen[(state, target)] += n
                if state == JobState.QUEUED:
                    depth.add_metric([queue, target], n)
        targets = sorted({target for _, target in seen})
        for state in JOB_STATES:  # zeros too, so a state that empties drops to 0 on graphs
            for target in targets:
                jobs.add_metric([state, target], seen.get((state, target), 0))
        yield jobs
        yield depth

    def _compile_seconds(self, counts: Counts) -> Metric:
        histogram = HistogramMetricFamily(
            "farm_compile_seconds",
            "OpenVINO compile time of succeeded jobs, seconds.",
            labels=["target"],
        )
        per_bucket: dict[str, dict[str, int]] = defaultdict(dict)
        totals: dict[str, float] = defaultdict(float)
        for (family, target, bound, _), (n, total) in counts.items():
            if family == "compile_seconds":
                per_bucket[target][bound] = n
                totals[target] += total
        for target in sorted(per_bucket):
            buckets, running = [], 0
            for bound in [str(float(b)) for b in COMPILE_SECONDS_BUCKETS] + ["+Inf"]:
                running += per_bucket[target].get(bound, 0)
                buckets.append((bound, running))
            histogram.add_metric([target], buckets, totals[target])
        return histogram

    def _blobs(self, counts: Counts) -> Iterator[Metric]:
        count = GaugeMetricFamily("farm_blobs", "Stored blobs by target.", labels=["target"])
        size = GaugeMetricFamily(
            "farm_blob_bytes", "Bytes of stored blobs by target.", labels=["target"]
        )
        for (family, target, _, _), (n, total) in sorted(counts.items()):
            if family == "blobs":
                count.add_metric([target], n)
                size.add_metric([target], int(total))
        yield count
        yield size

    def _pulls(self, counts: Counts) -> Metric:
        pulls = CounterMetricFamily(
            "farm_pulls", "Pull reports from edges, by target and outcome.", labels=["target", "ok"]
        )
        for (family, target, ok, _), (n, _) in sorted(counts.items()):
            if family == "pulls":
                pulls.add_metric([target, ok], n)
        return pulls

    def _verifications(self, counts: Counts) -> Iterator[Metric]:
        """Verifications are never deleted (a deleted blob's keep a null blob_id): a counter."""
        verified = CounterMetricFamily(
            "farm_verifications",
            "Edge verifications of blobs against their reference outputs, by target and result.",
            labels=["target", "result"],
        )
        quarantined = GaugeMetricFamily(
            "farm_blobs_quarantined", "Blobs quarantined now, by target.", labels=["target"]
        )
        for (family, target, result, _), (n, _) in sorted(counts.items()):
            if family == "verifications":
                verified.add_metric([target, result], n)
            elif family == "quarantined":
                quarantined.add_metric([target], n)
        yield verified
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
    """This process's `/metrics` text, made on first use."""
    if getattr(app.state, "metrics_text", None) is None:
        registry = registry_for(farm.sessions, farm.settings.worker_heartbeat_seconds)
        app.state.metrics_text = Cached(
            lambda: generate_latest(registry), farm.settings.metrics_cache_seconds
        )
    return app.state.metrics_text
