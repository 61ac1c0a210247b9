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

Scale (bench/catalog.py: half a million candidates among a million blobs and five million
pulls): gc works a batch of `batch_size` blobs at a time, in constant memory. Candidates are
streamed by blob id, only the columns the report needs, each one's pulls answered from the index
on pulls(blob_id, created_at, ok); a batch's rows go in one transaction of set statements (lock,
re-check, record, delete), and pending objects are handled a batch at a time too. Whoever wants
every candidate listed passes `on_blob`; the report itself keeps only totals then.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, case, delete, exists, func, insert, literal, or_, select, update
from sqlalchemy.orm import Session

from farm.core.clock import now
from farm.core.errors import StorageError
from farm.core.hashing import canonical_json
from farm.core.vocabulary import ACTIVE_STATES
from farm.server.channels.service import kept_by_channels
from farm.server.db.models import Blob, BlobDeletion, Job, Model, Pull, UTCDateTime
from farm.server.storage import BlobStore, ListsObjects, model_storage_key

MODEL_GRACE_SECONDS = 24 * 3600
"""How old an unreferenced model file must be before gc deletes it (FARM_MODEL_GRACE_SECONDS)."""
RECHECK_MARGIN = timedelta(minutes=10)
"""Before each delete, models registered since gc began looking (less this, for clocks of other
hosts) are read again."""
BATCH_SIZE = 1000
"""Blobs (and pending objects) per batch: per transaction, and the most gc holds in memory."""
MAX_STORE_ERRORS = 10
"""Failed object deletes after which gc stops trying (the store is likely down): the objects
left stay pending for the next run."""


@dataclass(frozen=True)
class Candidate:
    """A blob that gc deletes (or, in a dry run, would delete)."""

    cache_key: str
    target: str
    size_bytes: int
    created_at: datetime
    last_pulled_at: datetime | None
    pulls: int
    blob_id: int = 0


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
    """Blobs whose rows were deleted in this run (in a dry run: would be); empty when the
    caller took them one by one (`collect(on_blob=...)`): `blob_count` counts them all."""
    objects_deleted: int = 0
    objects_kept: int = 0
    pending: list[str] = field(default_factory=list)
    """Cache keys whose objects are still in storage (a failed delete; the next gc retries)."""
    errors: list[str] = field(default_factory=list)
    model_grace_seconds: int = MODEL_GRACE_SECONDS
    models: list[ModelFileCandidate] = field(default_factory=list)
    """Model files no job names, older than the grace period, deleted in this run (in a dry run:
    that would be)."""
    blob_count: int = 0
    """Blobs whose rows were deleted (in a dry run: would be)."""
    blob_bytes: int = 0
    """Their bytes."""
    bundles: list[Any] = field(default_factory=list)
    """Pipeline bundles whose stale manifests were removed (would be), `StaleBundle`s
    (farm.server.bundles.gc)."""
    bundle_files: list[Any] = field(default_factory=list)
    """Bundle files no manifest lists, deleted (would be), `BundleFileCandidate`s."""

    @property
    def bytes(self) -> int:
        return self.blob_bytes

    @property
    def model_bytes(self) -> int:
        return sum(model.size_bytes for model in self.models)

    @property
    def bundle_file_bytes(self) -> int:
        return sum(f.size_bytes for f in self.bundle_files)

    def as_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "bytes": self.bytes,
            "model_bytes": self.model_bytes,
            "bundle_file_bytes": self.bundle_file_bytes,
        }

    def count(self, blob: Candidate, on_blob: Callable[[Candidate], None] | None) -> None:
        self.blob_count += 1
        self.blob_bytes += blob.size_bytes
        if on_blob is None:
            self.blobs.append(blob)
        else:
            on_blob(blob)


def _unused_since(cutoff: datetime, low: int, high: int | None = None):
    """The candidate rule on a `blobs` row whose id is over `low` (and at most `high`): no
    pull report after `cutoff`, and either pulled at all (the last report is older) or
    recorded before `cutoff` (never pulled). Any pull report counts, failed imports too: the
    same rule as `blob_usage.idle_days`.

    The id range is repeated on the pulls side on purpose: PostgreSQL runs the NOT EXISTS as
    a merge anti-join, and without the bound it walks the pulls index from the first blob on
    every batch (4.6 s a batch at 1M blobs and 5M pulls, against 30 ms with it)."""
    ours = [Pull.blob_id > low] + ([] if high is None else [Pull.blob_id <= high])
    pulled_since = exists().where(Pull.blob_id == Blob.id, Pull.created_at > cutoff, *ours)
    pulled = exists().where(Pull.blob_id == Blob.id)
    return and_(~pulled_since, or_(Blob.created_at <= cutoff, pulled))


def _pulls_of_blob(*columns):
    return select(*columns).where(Pull.blob_id == Blob.id).scalar_subquery()


def candidates(
    session: Session,
    unpulled_days: int,
    at: datetime | None = None,
    *,
    batch_size: int = BATCH_SIZE,
) -> Iterator[Candidate]:
    """Blobs whose last pull (or, never pulled, whose creation) is `unpulled_days` or more
    ago, by blob id (about their age), read `batch_size` at a time: each batch is one query
    that walks the blobs' primary key from where the last stopped, so memory and a query's
    cost stay the same however many there are."""
    cutoff = (at or now()) - timedelta(days=unpulled_days)
    kept = kept_by_channels(session)
    query = (
        select(
            Blob.model_id,
            Blob.spec,
            Blob.id,
            Blob.cache_key,
            Blob.target,
            Blob.size_bytes,
            Blob.created_at,
            _pulls_of_blob(func.max(Pull.created_at)),
            _pulls_of_blob(func.count()),
        )
        .order_by(Blob.id)
        .limit(batch_size)
    )
    after = 0
    while True:
        batch = query.where(Blob.id > after, _unused_since(cutoff, after))
        rows = session.execute(batch).all()
        session.rollback()  # no snapshot or lock held between batches
        for model_id, spec, blob_id, cache_key, target, size, created_at, last, pulls in rows:
            if (model_id, target, canonical_json(spec)) in kept:
                continue  # a revision a channel runs or may roll back to names it
            yield Candidate(cache_key, target, size, created_at, last, pulls or 0, blob_id)
        if len(rows) < batch_size:
            return
        after = rows[-1][2]


def _batches(items: Iterator[Candidate], size: int) -> Iterator[list[Candidate]]:
    batch: list[Candidate] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


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
    from farm.server.bundles.gc import named_model_files  # a bundle's folder (§17)

    bundles = named_model_files(session)
    return named | bundles | {sha256 for sha256 in session.scalars(inputs) if sha256}


def collect(
    session: Session,
    store: BlobStore,
    unpulled_days: int,
    dry_run: bool = False,
    model_grace_seconds: int = MODEL_GRACE_SECONDS,
    *,
    on_blob: Callable[[Candidate], None] | None = None,
    batch_size: int = BATCH_SIZE,
) -> GcReport:
    """Delete the blobs unpulled that long, finish the object deletions pending (this run's
    and those a previous run left), then delete the model files no job names that are older
    than `model_grace_seconds`. `on_blob`: called with each blob deleted (would be, in a dry
    run) as gc goes, instead of keeping them all in the report."""
    began = now()
    report = GcReport(unpulled_days, dry_run, model_grace_seconds=model_grace_seconds)
    found = candidates(session, unpulled_days, began, batch_size=batch_size)
    if dry_run:
        for blob in found:
            report.count(blob, on_blob)
        report.pending = list(
            session.scalars(select(BlobDeletion.cache_key).where(BlobDeletion.state == "pending"))
        )
        report.models = _model_files_or_error(session, store, model_grace_seconds, began, report)
        _collect_bundles(session, store, report, began)
        return report
    cutoff = began - timedelta(days=unpulled_days)
    for batch in _batches(found, batch_size):
        for blob in _remove_rows(session, batch, cutoff, unpulled_days):
            report.count(blob, on_blob)
    _delete_pending_objects(session, store, report, batch_size)
    for model in _model_files_or_error(session, store, model_grace_seconds, began, report):
        _delete_model_file(session, store, model, began, report)
    _collect_bundles(session, store, report, began)
    return report


def _collect_bundles(session: Session, store: BlobStore, report: GcReport, at: datetime) -> None:
    """Pipeline bundles' stale manifests and unlisted files (farm.server.bundles.gc)."""
    from farm.server.bundles.gc import collect_bundles

    found = collect_bundles(
        session, store, report.unpulled_days, report.model_grace_seconds, report.dry_run, at
    )
    report.bundles, report.bundle_files = found.bundles, found.files
    report.errors += found.errors


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


def _remove_rows(
    session: Session, batch: Sequence[Candidate], cutoff: datetime, unpulled_days: int
) -> list[Candidate]:
    """Delete a batch of blob rows and their pulls in one transaction, recording each as a
    pending deletion; returns those deleted (not those pulled, or deleted, since gc looked).

    On PostgreSQL the rows are locked first: a pull reported meanwhile waits on its foreign
    key (and is then refused: no blob), and one reported before is seen by the re-check that
    follows the lock (each statement reads what is committed when it starts)."""
    ids = [blob.blob_id for blob in batch]
    if session.get_bind().dialect.name == "postgresql":
        session.execute(select(Blob.id).where(Blob.id.in_(ids)).with_for_update(of=Blob))
    unused = _unused_since(cutoff, min(ids) - 1, max(ids))
    still = set(session.scalars(select(Blob.id).where(Blob.id.in_(ids), unused)))
    if not still:
        session.rollback()
        return []
    failed = func.coalesce(func.sum(case((Pull.ok, 0), else_=1)), 0)
    record = select(
        Blob.cache_key,
        Blob.storage_key,
        Blob.target,
        Blob.size_bytes,
        Blob.sha256,
        Blob.created_at,
        _pulls_of_blob(func.count()),
        _pulls_of_blob(failed),
        _pulls_of_blob(func.max(Pull.created_at)),
        literal(f"unpulled for {unpulled_days} days"),
        literal(now(), UTCDateTime()),
        literal("pending"),
        # storage.reference_storage_key in SQL (null when the blob has no reference)
        literal("references/") + Blob.cache_key + "/" + Blob.reference_sha256 + ".npz",
    ).where(Blob.id.in_(still))
    columns = [
        "cache_key",
        "storage_key",
        "target",
        "size_bytes",
        "sha256",
        "blob_created_at",
        "pulls",
        "failed_pulls",
        "last_pulled_at",
        "reason",
        "deleted_at",
        "state",
        "reference_storage_key",
    ]
    session.execute(insert(BlobDeletion).from_select(columns, record))
    session.execute(delete(Pull).where(Pull.blob_id.in_(still)))
    session.execute(delete(Blob).where(Blob.id.in_(still)))
    session.commit()
    return [blob for blob in batch if blob.blob_id in still]


def _delete_pending_objects(
    session: Session, store: BlobStore, report: GcReport, batch_size: int
) -> None:
    """Delete the objects of pending records, a batch at a time, each batch's records
    updated together; a key in use again (a blob row, an active job) keeps its object."""
    after, store_errors = 0, 0
    while store_errors < MAX_STORE_ERRORS:
        batch = session.execute(
            select(
                BlobDeletion.id,
                BlobDeletion.cache_key,
                BlobDeletion.storage_key,
                BlobDeletion.reference_storage_key,
            )
            .where(BlobDeletion.state == "pending", BlobDeletion.id > after)
            .order_by(BlobDeletion.id)
            .limit(batch_size)
        ).all()
        if not batch:
            return
        after = batch[-1].id
        keys = [row.cache_key for row in batch]
        in_use = set(session.scalars(select(Blob.cache_key).where(Blob.cache_key.in_(keys))))
        in_use.update(
            session.scalars(
                select(Job.cache_key).where(Job.cache_key.in_(keys), Job.state.in_(ACTIVE_STATES))
            )
        )
        deleted, kept = [], []
        for record_id, cache_key, storage_key, reference_key in batch:
            if cache_key in in_use:
                kept.append(record_id)
                continue
            if store_errors >= MAX_STORE_ERRORS:
                break  # left pending: the next gc retries
            try:
                store.delete(storage_key)
                if reference_key:
                    store.delete(reference_key)
            except StorageError as error:
                store_errors += 1
                report.pending.append(cache_key)
                report.errors.append(str(error))
                continue
            deleted.append(record_id)
        at = now()
        for ids, state in ((deleted, "deleted"), (kept, "kept")):
            if ids:
                session.execute(
                    update(BlobDeletion)
                    .where(BlobDeletion.id.in_(ids), BlobDeletion.state == "pending")
                    .values(state=state, object_deleted_at=at)
                )
        session.commit()
        report.objects_deleted += len(deleted)
        report.objects_kept += len(kept)
