"""The words every tier shares: job states, submission outcomes, task and queue names.

These strings are stored in the database, sent over the broker and returned by the API; they
are defined here once so no module spells them on its own.
"""

from __future__ import annotations

import enum
from typing import Literal


class JobState(enum.StrEnum):
    """``queued → running → succeeded | failed | cancelled`` (docs/architecture.md §6)."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


JOB_STATES: tuple[str, ...] = tuple(state.value for state in JobState)
ACTIVE_STATES: tuple[str, ...] = (JobState.QUEUED, JobState.RUNNING)
"""At most one job per cache key is in these states (a partial unique index)."""
FINAL_STATES: tuple[str, ...] = (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)


class ReferenceState(enum.StrEnum):
    """A blob's reference outputs (docs §14): computed after the blob is recorded."""

    PENDING = "pending"
    """Recorded with the blob; the run follows it (a verification waits for it)."""
    READY = "ready"
    """Stored and signed: `reference_sha256`."""
    SKIPPED = "skipped"
    """None will come: `reference_note` says why."""


REFERENCE_STATES: tuple[str, ...] = tuple(state.value for state in ReferenceState)

Outcome = Literal["hit", "existing", "queued", "unavailable"]
"""A submission's answer per spec: the blob exists, a job for it is active, a new job, or (an
embedded farm, which compiles only on its own host) no job: this host cannot compile it."""

COMPILE_TASK = "farm.compile"
"""The Celery task that runs one job; its only argument is the job id."""
REFERENCE_TASK = "farm.reference"
"""The Celery task that computes a blob's pending reference outputs (docs §14); its only
argument is the blob id. Sent by the reconciler when the run after the compile was lost."""
RECONCILE_TASK = "farm.reconcile"
"""The periodic Celery task that runs one reconciler pass."""
CONTROL_QUEUE = "control"
"""The reconciler's periodic task runs here, apart from compiles."""
EMBEDDED_QUEUE = "embedded"
"""The queue name of a job the embedded farm runs in its own process (no broker)."""
