"""Ringing the doorbell: hand a committed job's id to whatever runs jobs.

The message carries only the job id; the database holds everything else. A lost message is
re-sent by the reconciler, and a duplicate finds the job claimed or finished (the claim is a
conditional UPDATE), so every implementation may deliver late or twice, never for a row that
was not committed: `send` is called only after the job's insert has committed.

Implementations:
- `CeleryDispatcher`: served mode; one Celery queue per target (`farm.server.routing`).
- `InlineDispatcher`: embedded mode; the job runs in this process now (the CLI) or on one
  background thread (the embedded API).
- `StubDispatcher`: tests; records what was sent and runs nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from sqlalchemy import update
from sqlalchemy.orm import Session

from farm.core.clock import now
from farm.core.config import Settings
from farm.core.errors import BrokerUnavailable
from farm.core.vocabulary import COMPILE_TASK
from farm.server.db.models import Job


class Dispatcher(Protocol):
    def send(self, job_id: int, queue: str) -> None:
        """Deliver job `job_id` to `queue`'s workers; may block (inline) or return at once.
        A broker that does not take the message raises `BrokerUnavailable`."""
        ...

    def close(self) -> None: ...


def dispatch(session: Session, dispatcher: Dispatcher, job_id: int, queue: str) -> None:
    """Send a committed job and record when (`jobs.sent_at`, read by the reconciler)."""
    dispatcher.send(job_id, queue)
    session.execute(update(Job).where(Job.id == job_id).values(sent_at=now()))
    session.commit()


class CeleryDispatcher:
    """Publishes `farm.compile(job_id)` to the job's queue through the broker.

    A producer only: the workers' app (`farm.workers.app`) configures consumption; sending
    needs the broker URL and the task's name, nothing of the workers' code.
    """

    def __init__(self, settings: Settings) -> None:
        from celery import Celery  # only served mode needs Celery (a farm[server] install)

        self.app = Celery("farm", broker=settings.broker_url, set_as_current=False)
        self.app.conf.update(broker_connection_retry_on_startup=True)

    def send(self, job_id: int, queue: str) -> None:
        from kombu.exceptions import OperationalError

        try:
            self.app.send_task(COMPILE_TASK, args=[job_id], queue=queue)
        except OperationalError as error:
            # Celery retried the publish (about a second); the job's row stays unsent.
            raise BrokerUnavailable(
                f"the broker (FARM_BROKER_URL) did not take job {job_id}: {error}"
            ) from error

    def close(self) -> None:
        self.app.close()


class InlineDispatcher:
    """Runs each job in this process with `run(job_id)`: now, or on one background thread
    (`background=True`, the embedded API, so a request does not wait for its compile).
    One compile at a time: the embedded farm is one machine."""

    def __init__(self, run: Callable[[int], Any], *, background: bool = False) -> None:
        self.run = run
        self._executor = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="farm-inline")
            if background
            else None
        )

    def send(self, job_id: int, queue: str) -> None:
        if self._executor is None:
            self.run(job_id)
        else:
            self._executor.submit(self.run, job_id)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)


class StubDispatcher:
    """Remembers what was sent, in order; runs nothing. For rule tests."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, str]] = []
        self._lock = threading.Lock()

    def send(self, job_id: int, queue: str) -> None:
        with self._lock:
            self.sent.append((job_id, queue))

    def close(self) -> None:
        pass
