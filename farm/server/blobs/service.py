"""The blob rules: resolve a cache key, copy a blob out verified, record an edge's pull, list.

A blob row exists only for a blob that is stored and verified (docs/architecture.md §7); the
rules here only read it, except `record_pull`, which appends an edge's report.
"""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import and_, insert, literal, or_, select
from sqlalchemy.orm import Session

from farm.core import hashing, keyprefix
from farm.core.clock import now
from farm.core.errors import BlobQuarantined, IntegrityMismatch, NotFound
from farm.core.spec import Target
from farm.server import pagination
from farm.server.db.models import Blob, Job, Pull
from farm.server.storage import BlobStore


def resolve(session: Session, cache_key: str) -> Blob | None:
    """The blob stored for `cache_key`, or None."""
    return session.scalar(select(Blob).where(Blob.cache_key == cache_key))


def fetch_blob(store: BlobStore, blob: Blob, output: Path) -> None:
    """Copy a stored blob to `output`, verified against its recorded sha256, atomically."""
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = output.with_name(f".{output.name}.partial")
    try:
        store.get_file(blob.storage_key, partial)
        actual = hashing.sha256_file(partial)
        if actual != blob.sha256:
            raise IntegrityMismatch(
                f"blob {blob.cache_key} is corrupt in storage: sha256 {actual}, "
                f"recorded {blob.sha256}"
            )
        partial.replace(output)
    finally:
        partial.unlink(missing_ok=True)


def record_pull(
    session: Session,
    cache_key: str,
    agent_id: str,
    ok: bool,
    import_seconds: float | None = None,
    error: str | None = None,
) -> int:
    """An edge's report of one pull: who, how long the import took, ok or why not. Returns the
    new pull's id; NotFound when no blob is stored for `cache_key`; an ok pull of a
    quarantined blob is refused (BlobQuarantined): edges refuse it, so the report is false.

    One statement (the row inserted from the blob's, with its id returned) and its commit. An
    edge fleet's pulls reach the API, which writes them in batches (farm.server.api.batches).
    """
    values = {
        "blob_id": Blob.id,
        "cache_key": literal(cache_key, Pull.cache_key.type),
        "agent_id": literal(agent_id, Pull.agent_id.type),
        "import_seconds": literal(import_seconds, Pull.import_seconds.type),
        "ok": literal(ok, Pull.ok.type),
        "error": literal(error, Pull.error.type),
        "created_at": literal(now(), Pull.created_at.type),
    }
    from_blob = select(*values.values()).where(Blob.cache_key == cache_key)
    if ok:
        from_blob = from_blob.where(Blob.quarantined_at.is_(None))
    pull_id = session.scalar(insert(Pull).from_select(list(values), from_blob).returning(Pull.id))
    if pull_id is None:
        refuse_quarantined(require(session, cache_key))  # NotFound when there is no blob
        raise AssertionError("a blob neither missing nor quarantined took no pull")
    session.commit()
    return pull_id


def list_blobs(
    session: Session,
    target: str | None = None,
    limit: int = pagination.MAX_PAGE,
    cursor: str | None = None,
) -> list[Blob]:
    """Newest first, at most `limit`; `cursor` (`pagination.blob_cursor` of the last blob of
    the page before) continues after that blob."""
    query = select(Blob).order_by(Blob.created_at.desc(), Blob.id.desc()).limit(limit)
    if target:
        query = query.where(Blob.target == Target.parse(target).name)
    if cursor:
        created_at, blob_id = pagination.after_blob(cursor)
        query = query.where(
            or_(
                Blob.created_at < created_at,
                and_(Blob.created_at == created_at, Blob.id < blob_id),
            )
        )
    return list(session.scalars(query))


def page_cursor(blobs: list[Blob], limit: int) -> str | None:
    """The cursor of the page after `blobs`, a full page of `limit`; None after the last."""
    if len(blobs) < limit:
        return None
    return pagination.blob_cursor(blobs[-1].created_at, blobs[-1].id)


def refuse_quarantined(blob: Blob) -> None:
    """BlobQuarantined (409) for a quarantined blob: the API hands it to no edge."""
    if blob.quarantined_at is not None:
        raise BlobQuarantined(
            f"blob {blob.cache_key} is quarantined: {blob.quarantine_reason}; the farm hands "
            "it to no edge until an admin releases it (`farm blobs release`)"
        )


def require(session: Session, cache_key: str) -> Blob:
    """The blob stored for `cache_key`; NotFound when there is none."""
    blob = resolve(session, cache_key)
    if blob is None:
        raise NotFound(f"no blob for cache key {cache_key}")
    return blob


def cache_keys_starting_with(
    session: Session, prefix: str, limit: int, jobs: bool = True
) -> list[str]:
    """Up to `limit` distinct cache keys of blobs (and of jobs, unless `jobs` is False: what a
    pull token may see) that start with `prefix` (lower-case hex, `farm.core.keyprefix`), in
    order: what a unique key prefix is resolved against."""
    upper = keyprefix.upper_bound(prefix)
    found: set[str] = set()
    for column in (Blob.cache_key, Job.cache_key) if jobs else (Blob.cache_key,):
        query = (
            select(column)
            .where(column >= prefix, column < upper)
            .distinct()
            .order_by(column)
            .limit(limit)
        )
        found.update(session.scalars(query))
    return sorted(found)[:limit]
