"""Celery tasks: thin wrappers; the rules live in `farm.server.jobs` (runner, reconcile).

Each pool process builds its own `FarmContext` on first use (connections made before a fork
are not shared after it), named after the worker that forked it (`serve_as`), so `jobs.worker`
matches the `workers` table.
"""

from __future__ import annotations

import logging
import os
import socket

from celery import shared_task
from sqlalchemy.exc import OperationalError

from farm.core.config import get_settings
from farm.core.errors import DatabaseUnavailable, StorageError, WorkDiskFull
from farm.core.vocabulary import COMPILE_TASK, RECONCILE_TASK, REFERENCE_TASK
from farm.server.bundles.builds import BUNDLE_PART_TASK
from farm.server.bundles.reconcile import reconcile_parts
from farm.server.context import FarmContext
from farm.server.jobs.dispatch import Dispatcher
from farm.server.jobs.reconcile import reconcile

log = logging.getLogger(__name__)

INFRASTRUCTURE_ERRORS = (
    StorageError,
    DatabaseUnavailable,
    OperationalError,  # the runner's own sessions meet the driver's errors unwrapped
    ConnectionError,
    TimeoutError,
    WorkDiskFull,
)
"""Retried with backoff: the job goes back to its queue, bounded by its attempts."""

_worker_name: str | None = None
_context: FarmContext | None = None
_dispatcher: tuple[int, Dispatcher] | None = None


def serve_as(name: str) -> None:
    """Name the jobs this worker runs; called by `farm worker` before the pool forks, so every
    pool process inherits it."""
    global _worker_name
    _worker_name = name


def context() -> FarmContext:
    """This process's context, made after the fork that created the process."""
    global _context
    if _context is None or _context.pid != os.getpid():
        name = _worker_name or f"{socket.gethostname()}:{os.getpid()}"
        _context = FarmContext(get_settings(), worker=name)
    return _context


def dispatcher() -> Dispatcher:
    """This process's producer connection to the broker, for re-sends (one per process)."""
    global _dispatcher
    if _dispatcher is None or _dispatcher[0] != os.getpid():
        _dispatcher = (os.getpid(), context().dispatcher())
    return _dispatcher[1]


RETRIED = {
    "bind": True,
    "acks_late": True,
    "autoretry_for": INFRASTRUCTURE_ERRORS,
    "retry_backoff": 5,
    "retry_backoff_max": 300,
    "retry_jitter": True,
    "max_retries": 10,
}
"""The tasks that run a job, a reference or a bundle part: acknowledged when done, and sent
again with backoff on an infrastructure error (the broker redelivers a lost worker's)."""


@shared_task(
    name=COMPILE_TASK,
    **RETRIED,
)
def compile_job(self, job_id: int) -> None:
    job = context().run(job_id)
    log.info("job %s: %s", job_id, job.state if job else "not found")


@shared_task(
    name=REFERENCE_TASK,
    ignore_result=True,
    **RETRIED,
)
def reference_blob(self, blob_id: int, attempt: int | None = None) -> None:
    """A blob's reference run that the reconciler sent again (docs §14); the run after a
    compile is the compile task's own tail. `attempt`: the one the send granted."""
    from farm.server.jobs.reference_run import run_reference

    farm = context()
    state = run_reference(
        farm.sessions,
        farm.store,
        blob_id,
        farm.run_limits,
        farm.signer,
        model_cache=farm.model_cache,
        granted=attempt,
    )
    log.info("blob %s's reference: %s", blob_id, state or "not ours to run")


@shared_task(name=RECONCILE_TASK, ignore_result=True)
def reconcile_jobs() -> None:
    farm = context()
    with farm.session() as session:
        report = reconcile(session, farm.store, farm.settings, dispatcher())
        parts = reconcile_parts(session, farm.settings, dispatcher())
    if any(vars(report).values()):
        log.info("reconciled: %s", report)
    if any(vars(parts).values()):
        log.info("reconciled bundle parts: %s", parts)


@shared_task(
    name=BUNDLE_PART_TASK,
    ignore_result=True,
    **RETRIED,
)
def bundle_part(self, part_id: int) -> None:
    """Compile one part of a pipeline bundle (§17) and publish the bundles it completes."""
    from farm.server.bundles.served import run_part

    farm = context()
    state = run_part(
        farm.sessions,
        farm.store,
        part_id,
        worker=farm.worker or socket.gethostname(),
        limits=farm.run_limits,
        signer=farm.signer,
        trusted=farm.trusted_keys,
    )
    log.info("bundle part %s: %s", part_id, state or "not found")
