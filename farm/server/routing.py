"""Queues per target, and the registry of workers that serve them (the `workers` table)."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from farm.core.clock import now
from farm.core.spec import Target
from farm.core.vocabulary import EMBEDDED_QUEUE, JobState
from farm.server.db.models import Worker

MISSED_HEARTBEATS = 3
"""A worker silent for this many heartbeat intervals counts as gone."""


def queue_name(target: str | Target, large: bool = False) -> str:
    """``NPU.4000`` → ``compile.npu.4000``; ``CPU`` → ``compile.cpu``; ``.large`` for big models."""
    target = target if isinstance(target, Target) else Target.parse(target)
    name = f"compile.{target.name.lower()}"
    return f"{name}.large" if large else name


def worker_queues(compilable: list[str], memory_bytes: int, large_worker_bytes: int) -> list[str]:
    """The queues a worker consumes: its targets', plus their `.large` ones if it has the memory."""
    queues = [queue_name(t) for t in compilable]
    if memory_bytes >= large_worker_bytes:
        queues += [queue_name(t, large=True) for t in compilable]
    return queues


def register_worker(session: Session, **fields) -> None:
    at = now()
    row = session.get(Worker, fields["name"])
    if row is None:
        session.add(Worker(started_at=at, heartbeat_at=at, **fields))
    else:
        for key, value in fields.items():
            setattr(row, key, value)
        row.started_at = row.heartbeat_at = at
        row.stopped_at = None
    session.commit()


def heartbeat(session: Session, name: str) -> None:
    row = session.get(Worker, name)
    if row is not None:
        row.heartbeat_at = now()
        session.commit()


def mark_stopped(session: Session, name: str) -> None:
    row = session.get(Worker, name)
    if row is not None:
        row.stopped_at = now()
        session.commit()


def live_workers(session: Session, heartbeat_seconds: int) -> list[Worker]:
    since = now() - timedelta(seconds=heartbeat_seconds * MISSED_HEARTBEATS)
    query = select(Worker).where(Worker.heartbeat_at >= since, Worker.stopped_at.is_(None))
    return list(session.scalars(query.order_by(Worker.name)))


def all_workers(session: Session) -> list[Worker]:
    return list(session.scalars(select(Worker).order_by(Worker.heartbeat_at.desc())))


def is_served(session: Session, queue: str, heartbeat_seconds: int) -> bool:
    return any(queue in w.queues for w in live_workers(session, heartbeat_seconds))


def waiting_note(session: Session, job, heartbeat_seconds: int) -> str | None:
    """A queued job nobody can take says so, instead of waiting silently."""
    if job is None or job.state != JobState.QUEUED or job.queue == EMBEDDED_QUEUE:
        return None
    if is_served(session, job.queue, heartbeat_seconds):
        return None
    return f"no live worker serves {job.queue}; the job waits until one starts (farm workers)"
