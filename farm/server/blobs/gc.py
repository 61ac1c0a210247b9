"""`farm gc`: delete blobs no edge has pulled for N days, from the database and from storage,
and model files no job names.

The order is what keeps readers safe. A blob is visible only through its row, so the row goes
first: in one transaction the blob row and its pulls are deleted and a `blob_deletions` row in
state 'pending' is written. Then the object is deleted and the record set to 'deleted'. If gc
dies or the store fails in between, no reader ever sees a row whose object is gone; what is
left is an invisible object with a 'pending' record, and the next `farm gc` deletes it first.

Note: a cache key can come back while its object waits for deletion (someone submits the same
model again). The object is then kept ('kept') when a blob row or an active job for the key
exists at the moment of deletion. A job created and uploaded in the few milliseconds between
that check and the delete could lose its object; compiling takes far longer than that window.

Model files are content-addressed objects (`models/<sha256>`) that a submit uploads before it
creates its job; a submit whose job is never created (refused, abandoned) leaves them behind.
gc deletes those no `models` row names (every row belongs to a job) once they are older than a
grace period (`FARM_MODEL_GRACE_SECONDS`, a day), so a model uploaded but not yet submitted
survives; an upload still in progress is no object yet. A submit that finds the file present and
registers its model in the milliseconds between gc's last look and its delete would lose it:
its job fails, and the next submit uploads the file again.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import case, delete, func, select
from sqlalchemy.orm import Session

from farm.core.clock import now
from farm.core.errors import StorageError
from farm.core.vocabulary import ACTIVE_STATES
from farm.server.db.models import Blob, BlobDeletion, Job, Model, Pull
from farm.server.storage import BlobStore, ListsObjects, model_storage_key

MODEL_GRACE_SECONDS = 24 * 3600
"""How old an unreferenced model file must be before gc deletes it (FARM_MODEL_GRACE_SECONDS)."""
RECHECK_MARGIN = timedelta(minutes=10)
"""Before each delete, models registered since gc began looking (less this, for clocks of other
hosts) are read again."""


@dataclass(frozen=True)
class Candidate:
    """A blob that gc deletes (or, in a dry run, would delete)."""

    cache_key: str
    target: str
    size_bytes: int
    created_at: datetime
    last_pulled_at: datetime | None
    pulls: int


@dataclass(frozen=True)
class ModelFileCandidate:
    """A model file that no job names: gc deletes it (or, in a dry run, would)."""

    sha256: str
    size_bytes: int
    stored_at: datetime


@dataclass
class GcReport:
    unpulled_days: int
    dry_run: bool
    blobs: list[Candidate] = field(default_factory=list)
    """Blobs whose rows were deleted in this run (in a dry run: would be)."""
    objects_deleted: int = 0
    objects_kept: int = 0
    pending: list[str] = field(default_factory=list)
    """Cache keys whose objects are still in storage (a failed delete; the next gc retries)."""
    errors: list[str] = field(default_factory=list)
    model_grace_seconds: int = MODEL_GRACE_SECONDS
    models: list[ModelFileCandidate] = field(default_factory=list)
    """Model files no job names, older than the grace period, deleted in this run (in a dry run:
    that would be)."""

    @property
    def bytes(self) -> int:
        return sum(blob.size_bytes for blob in self.blobs)

    @property
    def model_bytes(self) -> int:
        return sum(model.size_bytes for model in self.models)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "bytes": self.bytes, "model_bytes": self.model_bytes}


def candidates(session: Session, unpulled_days: int, at: datetime | None = None) -> list[Candidate]:
    """Blobs whose last pull (or, never pulled, whose creation) is `unpulled_days` or more ago.

    Any pull report counts, failed imports too: the same rule as `blob_usage.idle_days`.
    """
    cutoff = (at or now()) - timedelta(days=unpulled_days)
    usage = (
        select(
            Pull.blob_id,
            func.count().label("pulls"),
            func.max(Pull.created_at).label("last_pulled_at"),
        )
        .group_by(Pull.blob_id)
        .subquery()
    )
    last_use = func.coalesce(usage.c.last_pulled_at, Blob.created_at)
    rows = session.execute(
        select(Blob, usage.c.last_pulled_at, usage.c.pulls)
        .outerjoin(usage, usage.c.blob_id == Blob.id)
        .where(last_use <= cutoff)
        .order_by(last_use, Blob.id)
    )
    return [
        Candidate(blob.cache_key, blob.target, blob.size_bytes, blob.created_at, last, pulls or 0)
        for blob, last, pulls in rows
    ]


def unreferenced_model_files(
    session: Session, store: BlobStore, grace_seconds: int, at: datetime | None = None
) -> list[ModelFileCandidate]:
    """Model files in the store that no model row names, stored `grace_seconds` or more ago
    (none when the store cannot list its objects)."""
    if not isinstance(store, ListsObjects):
        return []
    cutoff = (at or now()) - timedelta(seconds=grace_seconds)
    named = _named_model_files(session)
    found = []
    for key, size, stored_at in store.list_objects("models/"):
        sha256 = key.removeprefix("models/")
        if sha256 not in named and stored_at <= cutoff:
            found.append(ModelFileCandidate(sha256, size, stored_at))
    return found


def _named_model_files(session: Session, since: datetime | None = None) -> set[str]:
    """Every model's files, and the reference inputs of jobs still to run (a finished job's
    are no longer needed: its reference is computed)."""
    query = select(Model.files)
    if since is not None:
        query = query.where(Model.created_at >= since)
    named = {sha256 for files in session.scalars(query) for sha256 in files.values()}
    inputs = select(Job.reference_inputs).where(
        Job.reference_inputs.is_not(None), Job.state.in_(ACTIVE_STATES)
    )
    return named | {sha256 for sha256 in session.scalars(inputs) if sha256}


def collect(
    session: Session,
    store: BlobStore,
    unpulled_days: int,
    dry_run: bool = False,
    model_grace_seconds: int = MODEL_GRACE_SECONDS,
) -> GcReport:
    """Finish deletions a previous run left pending, then delete the blobs unpulled that long,
    and the model files no job names that are older than `model_grace_seconds`."""
    began = now()
    report = GcReport(unpulled_days, dry_run, candidates(session, unpulled_days))
    report.model_grace_seconds = model_grace_seconds
    if dry_run:
        report.pending = list(
            session.scalars(select(BlobDeletion.cache_key).where(BlobDeletion.state == "pending"))
        )
        report.models = _model_files_or_error(session, store, model_grace_seconds, began, report)
        return report
    report.blobs = [c for c in report.blobs if _remove_row(session, c, unpulled_days)]
    pending = session.scalars(
        select(BlobDeletion).where(BlobDeletion.state == "pending").order_by(BlobDeletion.id)
    )
    for record in list(pending):
        _delete_object(session, store, record, report)
    for model in _model_files_or_error(session, store, model_grace_seconds, began, report):
        _delete_model_file(session, store, model, began, report)
    return report


def _model_files_or_error(
    session: Session, store: BlobStore, grace_seconds: int, at: datetime, report: GcReport
) -> list[ModelFileCandidate]:
    """`unreferenced_model_files`; a store that cannot list them is one more error."""
    try:
        return unreferenced_model_files(session, store, grace_seconds, at)
    except StorageError as error:
        report.errors.append(str(error))
        return []


def _delete_model_file(
    session: Session,
    store: BlobStore,
    model: ModelFileCandidate,
    began: datetime,
    report: GcReport,
) -> None:
    session.rollback()  # a fresh look: what was committed since
    if model.sha256 in _named_model_files(session, since=began - RECHECK_MARGIN):
        return  # a job named it since gc listed it
    try:
        store.delete(model_storage_key(model.sha256))
    except StorageError as error:
        report.errors.append(str(error))
        return
    report.models.append(model)


def _remove_row(session: Session, candidate: Candidate, unpulled_days: int) -> bool:
    """Delete the blob row and its pulls, recording a pending deletion; False if it changed."""
    query = select(Blob).where(Blob.cache_key == candidate.cache_key)
    if session.get_bind().dialect.name == "postgresql":
        # Lock the row so a pull reported meanwhile waits for us (and is then refused: no blob).
        query = query.with_for_update(of=Blob)
    blob = session.scalar(query)
    if blob is None:  # another gc got there first
        session.rollback()
        return False
    pulls, last_pulled_at, failed = session.execute(
        select(
            func.count(),
            func.max(Pull.created_at),
            func.coalesce(func.sum(case((Pull.ok, 0), else_=1)), 0),
        ).where(Pull.blob_id == blob.id)
    ).one()
    if (pulls, last_pulled_at) != (candidate.pulls, candidate.last_pulled_at):
        session.rollback()  # pulled since we looked: leave it
        return False
    session.add(
        BlobDeletion(
            cache_key=blob.cache_key,
            storage_key=blob.storage_key,
            target=blob.target,
            size_bytes=blob.size_bytes,
            sha256=blob.sha256,
            blob_created_at=blob.created_at,
            pulls=pulls,
            failed_pulls=failed,
            last_pulled_at=last_pulled_at,
            reason=f"unpulled for {unpulled_days} days",
            deleted_at=now(),
            state="pending",
        )
    )
    session.execute(delete(Pull).where(Pull.blob_id == blob.id))
    session.execute(delete(Blob).where(Blob.id == blob.id))
    session.commit()
    return True


def _delete_object(
    session: Session, store: BlobStore, record: BlobDeletion, report: GcReport
) -> None:
    in_use = session.scalar(
        select(func.count()).select_from(Blob).where(Blob.cache_key == record.cache_key)
    ) or session.scalar(
        select(func.count())
        .select_from(Job)
        .where(Job.cache_key == record.cache_key, Job.state.in_(ACTIVE_STATES))
    )
    if in_use:
        record.state = "kept"
        report.objects_kept += 1
    else:
        try:
            store.delete(record.storage_key)
        except StorageError as error:
            report.pending.append(record.cache_key)
            report.errors.append(str(error))
            session.rollback()
            return
        record.state = "deleted"
        report.objects_deleted += 1
    record.object_deleted_at = now()
    session.commit()
