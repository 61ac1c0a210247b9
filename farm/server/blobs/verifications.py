"""The fleet's verdicts on blobs: record an edge's verification, quarantine, release.

A verification is an edge's run of a blob against the reference outputs its worker computed
(`farm verify`). One whose outputs are outside tolerance quarantines the blob for its whole
target: a blob is built for one device class, so one device that catches it wrong is enough to
stop it spreading; edges refuse a quarantined blob until an admin releases it. A verification
that could not judge the blob (an `error`: no memory to import it, a missing device library,
reference inputs that do not fit) is recorded and counts against nothing. The quarantine is a
conditional UPDATE (only a blob not quarantined yet), so two failing reports at once keep the
first one's reason. A blob recorded again with the bytes of one retired while quarantined starts
quarantined (`inherited_quarantine`): a rebuild never lifts a quarantine, only an admin does.
docs/architecture.md §14.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from farm.core.clock import now
from farm.core.errors import Conflict, NotFound, TooManyReports
from farm.core.spec import Target
from farm.core.tolerance import default_tolerance
from farm.server.blobs.service import require, resolve
from farm.server.db.models import Blob, BlobDeletion, Verification
from farm.server.db.session import rows_changed

log = logging.getLogger(__name__)

REPORT_FIELDS = (
    "agent_id",
    "device_name",
    "openvino_version",
    "driver_version",
    "passed",
    "max_abs_error",
    "mean_abs_error",
    "min_cosine",
    "tolerance",
    "outputs",
    "runs",
    "latency_p50_ms",
    "latency_p90_ms",
    "latency_min_ms",
    "import_seconds",
    "peak_rss_bytes",
    "error",
)
"""What an edge reports (`POST /v1/blobs/{key}/verifications`): every column it fills."""


@dataclass(frozen=True)
class ReportLimits:
    """How many verification reports one blob keeps (FARM_MAX_REPORTS_PER_BLOB) and one agent
    id may make about one blob (FARM_MAX_REPORTS_PER_AGENT); 0: no bound."""

    per_blob: int = 0
    per_agent: int = 0


def record_verification(
    session: Session,
    cache_key: str,
    blob_sha256: str,
    report: Mapping[str, Any],
    quarantine_on_failure: bool = True,
    limits: ReportLimits | None = None,
) -> tuple[Verification, bool]:
    """Append an edge's report; one with outputs outside tolerance quarantines the blob (unless
    `quarantine_on_failure` is off, FARM_QUARANTINE_ON_FAILURE, or the report applied a
    tolerance stricter than the target's default: a failure by a rule of the edge's own says
    nothing the fleet must act on). A report with an `error` (the edge could not judge the
    blob) never quarantines. Returns the row and whether this report quarantined it. A
    report about other bytes than the blob recorded now (a blob since rebuilt) is refused: it
    says nothing about this one. Past `limits`: TooManyReports."""
    blob = require(session, cache_key)
    if blob.sha256 != blob_sha256:
        raise Conflict(
            f"the report is about bytes with sha256 {blob_sha256}; blob {cache_key} is now "
            f"{blob.sha256} (rebuilt since?): verify it again"
        )
    passed = bool(report["passed"]) and report.get("error") is None
    if limits is not None:
        _check_report_count(session, blob, str(report["agent_id"]), passed, limits)
    verification = Verification(
        blob_id=blob.id,
        cache_key=cache_key,
        blob_sha256=blob_sha256,
        target=blob.target,
        created_at=now(),
        **{key: report.get(key) for key in REPORT_FIELDS if key != "passed"},
        passed=passed,
    )
    session.add(verification)
    session.flush()
    quarantined = False
    outside_tolerance = not passed and report.get("error") is None
    if outside_tolerance and quarantine_on_failure and not _stricter(report, blob.target):
        quarantined = _quarantine(session, blob, _failure_reason(verification))
    session.commit()
    return verification, quarantined


def _check_report_count(
    session: Session, blob: Blob, agent_id: str, passed: bool, limits: ReportLimits
) -> None:
    """Refuse a report past the blob's bounds. Agent ids are the edges' own words, so the
    per-blob bound is what holds against one token inventing agents; a failure about a blob
    not quarantined yet is taken past it (it quarantines the blob: a flood of passes cannot
    keep a wrong blob spreading)."""
    if not passed and blob.quarantined_at is None:
        return
    counted = select(func.count()).select_from(Verification).where(Verification.blob_id == blob.id)
    if limits.per_agent:
        mine = session.scalar(counted.where(Verification.agent_id == agent_id)) or 0
        if mine >= limits.per_agent:
            raise TooManyReports(
                f"agent {agent_id!r} already reported {mine} verifications of blob "
                f"{blob.cache_key}",
                setting="FARM_MAX_REPORTS_PER_AGENT",
                limit=limits.per_agent,
            )
    if limits.per_blob:
        every = session.scalar(counted) or 0
        if every >= limits.per_blob:
            raise TooManyReports(
                f"blob {blob.cache_key} already has {every} verification reports",
                setting="FARM_MAX_REPORTS_PER_BLOB",
                limit=limits.per_blob,
            )


def quarantine(session: Session, cache_key: str, reason: str) -> Blob:
    """An admin's quarantine; a blob quarantined already keeps its first reason."""
    blob = require(session, cache_key)
    _quarantine(session, blob, reason)
    session.commit()
    session.refresh(blob)
    return blob


def release(session: Session, cache_key: str, by: str = "an admin") -> Blob:
    """Lift the quarantine (the verifications that caused it stay); logged with who and why it
    was quarantined, since the row keeps no history of its quarantines."""
    blob = require(session, cache_key)
    if blob.quarantined_at is not None:
        log.warning("%s released blob %s (quarantined: %s)", by, cache_key, blob.quarantine_reason)
    session.execute(
        update(Blob).where(Blob.id == blob.id).values(quarantined_at=None, quarantine_reason=None)
    )
    session.commit()
    session.refresh(blob)
    return blob


def verifications_of(
    session: Session, cache_key: str, limit: int = 100, before_id: int | None = None
) -> list[Verification]:
    """The newest `limit` verifications of the blobs ever stored under `cache_key` (those with
    an id below `before_id`: the next page); NotFound for a key that never had a blob."""
    query = (
        select(Verification)
        .where(Verification.cache_key == cache_key)
        .order_by(Verification.id.desc())
        .limit(limit)
    )
    if before_id is not None:
        query = query.where(Verification.id < before_id)
    rows = list(session.scalars(query))
    if not rows and before_id is None and resolve(session, cache_key) is None:
        raise NotFound(f"no blob and no verification for cache key {cache_key}")
    return rows


def _stricter(report: Mapping[str, Any], target: str) -> bool:
    """The report's tolerance is stricter than the target's default in some way."""
    default = default_tolerance(Target.parse(target).device)
    applied = report.get("tolerance") or {}
    return (
        applied.get("atol", default.atol) < default.atol
        or applied.get("rtol", default.rtol) < default.rtol
        or applied.get("min_cosine", default.min_cosine) > default.min_cosine
    )


def _quarantine(session: Session, blob: Blob, reason: str) -> bool:
    return (
        rows_changed(
            session,
            update(Blob)
            .where(Blob.id == blob.id, Blob.quarantined_at.is_(None))
            .values(quarantined_at=now(), quarantine_reason=reason),
        )
        == 1
    )


def inherited_quarantine(session: Session, cache_key: str, sha256: str) -> str | None:
    """The quarantine reason a new blob of `cache_key` with these bytes starts with: that of the
    last blob of the same key and bytes retired while quarantined (`--rebuild`, `farm blobs
    delete`). CPU compiles are deterministic: a rebuild that makes the same bytes makes the same
    blob, and only an admin lifts its quarantine. None: no such blob."""
    earlier = session.execute(
        select(BlobDeletion.quarantine_reason, BlobDeletion.deleted_at)
        .where(
            BlobDeletion.cache_key == cache_key,
            BlobDeletion.sha256 == sha256,
            BlobDeletion.quarantine_reason.is_not(None),
        )
        .order_by(BlobDeletion.id.desc())
        .limit(1)
    ).first()
    if earlier is None:
        return None
    reason, deleted_at = earlier
    return _one_line(
        f"rebuilt into the same bytes as the blob quarantined before it (retired "
        f"{deleted_at:%Y-%m-%d %H:%M} UTC): {reason}"
    )


def _failure_reason(verification: Verification) -> str:
    """One readable line: who found what, the worst output by the model's own name."""
    where = (
        f"verification {verification.id} on {verification.device_name} ({verification.agent_id})"
    )
    failing = [o for o in verification.outputs or [] if not o.get("passed", True)]
    worst = max(failing, key=lambda o: o.get("max_abs_error") or math.inf, default=None)
    what = f"output {worst.get('name')!r} " if worst else ""
    error = worst.get("max_abs_error") if worst else verification.max_abs_error
    cosine = worst.get("cosine") if worst else verification.min_cosine
    tolerance = verification.tolerance or {}
    return _one_line(
        f"{where}: {what}outside tolerance (max abs error {_figure(error)}, cosine "
        f"{_figure(cosine, '.6f')}; allowed atol={tolerance.get('atol')} "
        f"rtol={tolerance.get('rtol')} cosine>={tolerance.get('min_cosine')})"
    )


def _one_line(text: str, limit: int = 1000) -> str:
    """`text` on one line of at most `limit` characters (a reason is shown in listings)."""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def _figure(value: float | None, spec: str = ".3g") -> str:
    """None: an output that was missing, of another shape, or not finite (NaN, overflow)."""
    return "non-finite or missing" if value is None else format(value, spec)
