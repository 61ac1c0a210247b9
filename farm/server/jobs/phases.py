"""Where a job's time goes: the runner times each phase of an attempt (fetch, convert,
compress, drift, compile, reference, upload, record) and records them with the attempt's end, one
`job_phases` row each (docs/architecture.md §6). The wait in the queue is the job's own
`started_at - created_at` (the `job_durations` view). A step inside a phase may be timed as its
own phase (`step`: a compression stage's `drift`), its time then not counted in the phase's."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from farm.core.clock import now
from farm.server.db.models import Job, JobPhase


@dataclass
class PhaseClock:
    """The phases of one attempt, in the order they started."""

    timed: list[tuple[str, datetime, float]] = field(default_factory=list)
    _inner: list[float] = field(default_factory=list)
    """Per open phase, the seconds of the phases timed inside it (not counted in its own)."""

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as phase `name` (also when it raises: a failed compile took time).
        Within it, `step` times a part of it as a phase of its own."""
        started_at, began = now(), time.monotonic()
        token = _ACTIVE.set(self)
        self._inner.append(0.0)
        try:
            yield
        finally:
            _ACTIVE.reset(token)
            seconds, inner = time.monotonic() - began, self._inner.pop()
            if self._inner:
                self._inner[-1] += seconds
            self.timed.append((name, started_at, seconds - inner))

    def record(self, session: Session, job_id: int, attempt: int) -> None:
        """Add the attempt's rows to `session` (the caller commits), in the order they
        started."""
        session.add_all(
            JobPhase(job_id=job_id, attempt=attempt, phase=name, started_at=at, seconds=seconds)
            for name, at, seconds in sorted(self.timed, key=lambda timed: timed[1])
        )


_ACTIVE: ContextVar[PhaseClock | None] = ContextVar("phase_clock", default=None)
"""The clock of the phase running in this thread, if any."""


@contextlib.contextmanager
def step(name: str) -> Iterator[None]:
    """Time the block as phase `name` of the attempt whose phase is running here (its seconds
    taken out of that phase's); nothing is timed outside an attempt's phase."""
    clock = _ACTIVE.get()
    if clock is None:
        yield
        return
    with clock.phase(name):
        yield


def phases_of_page(session: Session, jobs: Sequence[Job]) -> dict[int, str]:
    """Each job's last attempt as one line ("fetch 0.10 · compile 3.20 · ..."): one query for
    a page of jobs (the dashboard)."""
    attempts = {job.id: job.attempts for job in jobs}
    lines: dict[int, list[str]] = {}
    if attempts:
        rows = session.execute(
            select(JobPhase.job_id, JobPhase.attempt, JobPhase.phase, JobPhase.seconds)
            .where(JobPhase.job_id.in_(attempts))
            .order_by(JobPhase.id)
        )
        for job_id, attempt, phase, seconds in rows:
            if attempt == attempts[job_id]:
                lines.setdefault(job_id, []).append(f"{phase} {seconds:.2f}")
    return {job_id: " · ".join(parts) for job_id, parts in lines.items()}


def phases_of(session: Session, job: Job) -> list[dict[str, Any]]:
    """The phases of a job's last attempt, in order, with the queue wait first."""
    rows: Sequence[JobPhase] = session.scalars(
        select(JobPhase)
        .where(JobPhase.job_id == job.id, JobPhase.attempt == job.attempts)
        .order_by(JobPhase.id)
    ).all()
    queued = []
    if job.started_at is not None:
        queued = [{"phase": "queued", "seconds": (job.started_at - job.created_at).total_seconds()}]
    return queued + [{"phase": row.phase, "seconds": row.seconds} for row in rows]
