"""The fleet as a test lab for rollouts: a revision goes past its first stage only when the
edges' verifications of its blobs say it may (docs/architecture.md §16).

A revision's blobs are those of its entries' models and specs, for every toolchain the farm
has built them for. The gate refuses while any of them is quarantined (a quarantine halts the
rollout) or has a failed verification, or while an entry has fewer than `min_passed` passed
verifications on devices of its target.
"""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from farm.core.channels import Entry
from farm.core.hashing import canonical_json, model_digest
from farm.server.db.models import Blob, Model, Verification


def blobs_of(session: Session, entry: Entry) -> list[Blob]:
    """The blobs built for `entry`'s model and spec, any toolchain."""
    spec = canonical_json(entry.spec.canonical())
    rows = session.scalars(
        select(Blob)
        .join(Model, Model.id == Blob.model_id)
        .where(Model.digest == model_digest(entry.model), Blob.target == entry.spec.target.name)
    )
    return [blob for blob in rows if canonical_json(blob.spec) == spec]


def gate_problems(session: Session, entries: Iterable[Entry], min_passed: int) -> list[str]:
    """Why a revision running `entries` may not go further; empty: it may."""
    problems = []
    for entry in entries:
        label = f"{entry.name or 'model'} ({entry.spec.summary()})"
        blobs = blobs_of(session, entry)
        passed = 0
        for blob in blobs:
            if blob.quarantined_at is not None:
                problems.append(
                    f"{label}: blob {blob.cache_key[:16]} is quarantined ({blob.quarantine_reason})"
                )
            counts = session.execute(
                select(Verification.passed, func.count())
                .where(Verification.blob_id == blob.id)
                .group_by(Verification.passed)
            ).all()
            by_outcome = {bool(ok): count for ok, count in counts}
            if by_outcome.get(False):
                problems.append(
                    f"{label}: blob {blob.cache_key[:16]} has {by_outcome[False]} failed "
                    "verification(s)"
                )
            passed += (
                session.scalar(
                    select(func.count()).where(
                        Verification.blob_id == blob.id,
                        Verification.passed,
                        Verification.target == entry.spec.target.name,
                    )
                )
                or 0
            )
        if passed < min_passed:
            problems.append(
                f"{label}: {passed} passed verification(s) on {entry.spec.target.name} devices, "
                f"FARM_CHANNEL_MIN_VERIFICATIONS={min_passed} needed (`farm agent sync --verify` "
                "on edges of the first stage)"
            )
    return problems
