"""Celery tasks: thin wrappers; the rules live in `farm.runner` and `farm.reconcile`."""

from __future__ import annotations

import logging
import os
import socket

from celery import shared_task
from sqlalchemy.exc import OperationalError

from farm.errors import WorkDiskFull
from farm.storage import StorageError

log = logging.getLogger(__name__)

WORKER_NAME_ENV = "FARM_WORKER_NAME"
"""Set by `farm worker` so jobs.worker matches the workers table (pool processes inherit it)."""

INFRASTRUCTURE_ERRORS = (
    StorageError,
    OperationalError,
    ConnectionError,
    TimeoutError,
    WorkDiskFull,
)


@shared_task(
    name="farm.compile",
    bind=True,
    acks_late=True,
    autoretry_for=INFRASTRUCTURE_ERRORS,
    retry_backoff=5,
    retry_backoff_max=300,
    retry_jitter=True,
    max_retries=10,
)
def compile_job(self, job_id: int) -> None:
    from farm.runner import RunLimits, run_job
    from workers.context import worker_context

    context = worker_context()
    settings = context.settings
    job = run_job(
        context.sessions,
        context.store,
        job_id,
        worker=os.environ.get(WORKER_NAME_ENV) or f"{socket.gethostname()}:{os.getpid()}",
        limits=RunLimits(
            settings.lease_seconds,
            settings.max_run_seconds,
            settings.resolved_compile_memory_bytes,
        ),
        signer=context.signer,
        model_cache=context.model_cache,
    )
    log.info("job %s: %s", job_id, job.state if job else "not found")


@shared_task(name="farm.reconcile", ignore_result=True)
def reconcile_jobs() -> None:
    from farm.reconcile import reconcile
    from workers.context import worker_context

    context = worker_context()
    with context.sessions() as session:
        report = reconcile(
            session,
            context.store,
            context.settings,
            lambda job_id, queue: context.dispatcher.send(session, job_id, queue),
        )
    if any(vars(report).values()):
        log.info("reconciled: %s", report)
