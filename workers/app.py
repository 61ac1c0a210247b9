"""The Celery app, configured for long, heavy, memory-hungry tasks (docs/architecture.md §6).

The database is the source of truth and Celery only the doorbell: messages carry a job id,
results are not stored, and every setting below errs on the side of redelivering a message
(the job row makes a duplicate harmless) rather than losing one.
"""

from __future__ import annotations

from celery import Celery

from farm.core.config import Settings
from farm.core.vocabulary import CONTROL_QUEUE, RECONCILE_TASK

TIME_LIMIT_MARGIN_SECONDS = 300
"""Celery's hard limit sits this far above farm's own compile limit (the sandbox kills first)."""


def make_app(settings: Settings) -> Celery:
    app = Celery("farm", broker=settings.broker_url, include=["farm.workers.tasks"])
    hard_limit = settings.max_run_seconds + TIME_LIMIT_MARGIN_SECONDS
    app.conf.update(
        task_acks_late=True,  # a message is acknowledged when its job is done, not when taken
        task_reject_on_worker_lost=True,  # an OOM-killed worker's job is redelivered...
        worker_prefetch_multiplier=1,  # ...and a worker holds one compile, not a backlog
        task_ignore_result=True,  # outcomes live in the jobs table
        task_time_limit=hard_limit,
        task_soft_time_limit=hard_limit - 60,
        # Compiles run in a child process of their own, whose memory leaves with it, and the
        # pool process trims what its transfers freed (farm.runner.release_free_memory): a
        # pool process is replaced rarely, as a guard against slow leaks, since each
        # replacement stalled the next job by about 4 s (bench/README.md, scaleout).
        worker_max_tasks_per_child=200,
        # Redis redelivers an unacknowledged message after the visibility timeout: it must
        # exceed the longest task, or a long compile would run twice at once.
        broker_transport_options={"visibility_timeout": hard_limit + 3600},
        broker_connection_retry_on_startup=True,
        worker_cancel_long_running_tasks_on_connection_loss=True,
        task_default_queue=CONTROL_QUEUE,
        task_create_missing_queues=True,
        worker_hijack_root_logger=False,
        # The embedded beat's record of its last runs: the farm's own folder, not the cwd.
        beat_schedule_filename=str(settings.home.resolve() / "celerybeat-schedule"),
        beat_schedule={
            "reconcile": {
                "task": RECONCILE_TASK,
                "schedule": max(10.0, settings.resend_after_seconds / 2),
                "options": {"queue": CONTROL_QUEUE},
            }
        },
    )
    return app
