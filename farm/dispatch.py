"""Ringing the doorbell: send a job's id to its Celery queue, after the job row is committed.

The message carries only the job id; the database holds everything else. A lost message is
re-sent by the reconciler, and a duplicate finds the job claimed or finished.
"""

from __future__ import annotations

from sqlalchemy import update
from sqlalchemy.orm import Session

from farm.config import Settings
from farm.db.models import Job
from farm.service import now

COMPILE_TASK = "farm.compile"
RECONCILE_TASK = "farm.reconcile"


class Dispatcher:
    def __init__(self, settings: Settings) -> None:
        from workers.app import make_app

        self.app = make_app(settings)

    def send(self, session: Session, job_id: int, queue: str) -> None:
        self.app.send_task(COMPILE_TASK, args=[job_id], queue=queue)
        session.execute(update(Job).where(Job.id == job_id).values(sent_at=now()))
        session.commit()

    def close(self) -> None:
        self.app.close()
