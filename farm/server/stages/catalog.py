"""The `stage_outputs` rows: claim a stage (single flight), renew, finish, fail, look up.

One row per stage key (a unique index). A job that needs a stage:
- finds it ``done``: reuses its output model, forever (never recomputed while it exists);
- finds none, a ``failed`` one, or a ``running`` one whose lease expired: claims it (the row
  ``running`` with this job's id and lease) and runs the stage;
- finds it ``running`` under a live lease: waits (`Claim.wait`), polling, and then reuses it,
  or fails with its reason if it failed meanwhile.
Only a finished stage's output model is ever recorded: nothing half-converted is reused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from farm.core.clock import now
from farm.server.db.models import StageOutput
from farm.server.db.session import rows_changed

RUNNING, DONE, FAILED = "running", "done", "failed"


@dataclass(frozen=True)
class Claim:
    """What a job does about a stage: ``run`` it (claimed), ``reuse`` it, or ``wait``."""

    action: Literal["run", "reuse", "wait"]
    row: StageOutput


def claim(
    session: Session,
    stage_key: str,
    kind: str,
    args: Mapping[str, Any],
    *,
    input_model_id: int | None,
    input_stage_key: str | None,
    job_id: int,
    lease_seconds: int,
) -> Claim:
    """The job's part in a stage (committed): see the module's docstring."""
    for _ in range(3):  # a lost race re-reads the row; the third read settles it
        row = find(session, stage_key)
        at = now()
        lease = at + timedelta(seconds=lease_seconds)
        if row is None:
            row = StageOutput(
                stage_key=stage_key,
                kind=kind,
                input_model_id=input_model_id,
                input_stage_key=input_stage_key,
                args=dict(args),
                state=RUNNING,
                job_id=job_id,
                lease_expires_at=lease,
                created_at=at,
            )
            session.add(row)
            try:
                session.commit()
            except IntegrityError:  # another job inserted it first: look again
                session.rollback()
                continue
            return Claim("run", row)
        if row.state == DONE:
            return Claim("reuse", row)
        live = row.state == RUNNING and row.lease_expires_at is not None
        if live and row.job_id != job_id and row.lease_expires_at > at:  # type: ignore[operator]
            return Claim("wait", row)
        # Failed before, its job died (lease expired), or this job's own earlier attempt.
        taken = rows_changed(
            session,
            update(StageOutput)
            .where(
                StageOutput.id == row.id,
                StageOutput.state == row.state,
                StageOutput.job_id.is_(None)
                if row.job_id is None
                else StageOutput.job_id == row.job_id,
            )
            .values(state=RUNNING, job_id=job_id, lease_expires_at=lease, error=None),
        )
        session.commit()
        if taken:
            session.refresh(row)
            return Claim("run", row)
    row = find(session, stage_key)
    assert row is not None
    return Claim("wait", row)


def renew(session: Session, stage_key: str, job_id: int, lease_seconds: int) -> bool:
    """Extend the lease of a stage this job runs; False: it is no longer this job's."""
    changed = rows_changed(
        session,
        update(StageOutput)
        .where(
            StageOutput.stage_key == stage_key,
            StageOutput.job_id == job_id,
            StageOutput.state == RUNNING,
        )
        .values(lease_expires_at=now() + timedelta(seconds=lease_seconds)),
    )
    session.commit()
    return changed == 1


def finish(
    session: Session,
    stage_key: str,
    job_id: int,
    *,
    output_model_id: int,
    output_files: Mapping[str, str],
    tool_versions: Mapping[str, str],
    metrics: Mapping[str, Any],
    seconds: float,
) -> bool:
    """Record the stage done with its output (committed); False: another job took it over
    (its output, the same bytes by content, is the one kept)."""
    changed = rows_changed(
        session,
        update(StageOutput)
        .where(
            StageOutput.stage_key == stage_key,
            StageOutput.job_id == job_id,
            StageOutput.state == RUNNING,
        )
        .values(
            state=DONE,
            output_model_id=output_model_id,
            output_files=dict(output_files),
            tool_versions=dict(tool_versions),
            metrics=dict(metrics),
            seconds=seconds,
            finished_at=now(),
            lease_expires_at=None,
            error=None,
        ),
    )
    session.commit()
    return changed == 1


def fail(session: Session, stage_key: str, job_id: int, error: str) -> None:
    """Record the stage failed with its reason: the jobs waiting on it fail with it; the next
    job that needs it tries again."""
    session.execute(
        update(StageOutput)
        .where(
            StageOutput.stage_key == stage_key,
            StageOutput.job_id == job_id,
            StageOutput.state == RUNNING,
        )
        .values(state=FAILED, error=error[:4000], finished_at=now(), lease_expires_at=None)
    )
    session.commit()


def find(session: Session, stage_key: str) -> StageOutput | None:
    return session.scalar(
        select(StageOutput)
        .where(StageOutput.stage_key == stage_key)
        .execution_options(populate_existing=True)
    )


def done_output(session: Session, stage_key: str) -> StageOutput | None:
    """The finished stage of this key, or None."""
    row = find(session, stage_key)
    return row if row is not None and row.state == DONE else None
