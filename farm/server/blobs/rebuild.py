"""`farm submit --rebuild`: replace a quarantined blob with a fresh compile.

Only a quarantined blob is replaced: a blob the fleet trusts is never thrown away by a
submitter. Its objects are deleted first (the new job's upload goes to the same keys, and the
store is write-once), then its row moves to `blob_deletions` with the reason, its pulls with
it as `farm gc` does, while its verifications stay (their `blob_id` set null): the history of
why it was replaced outlives it. The new job is then an ordinary submission. A quarantined blob
is refused by every edge, so deleting its objects before the row harms no one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from sqlalchemy import case, delete, func, select, update
from sqlalchemy.orm import Session

from farm.core.clock import now
from farm.core.errors import Conflict
from farm.core.identity import key_for
from farm.core.spec import CompileSpec, Toolchain
from farm.core.stages import Recipe
from farm.server.blobs.service import require, resolve
from farm.server.db.models import Blob, BlobDeletion, Pull, Verification
from farm.server.db.session import rows_changed
from farm.server.storage import BlobStore, reference_storage_key


def retire_quarantined(
    session: Session,
    store: BlobStore,
    identity: Mapping[str, str],
    specs: Sequence[CompileSpec],
    toolchain: Toolchain,
    recipe: Recipe = (),
) -> list[str]:
    """Retire the quarantined blobs of these specs so that a submit compiles them again; the
    cache keys retired. A spec whose blob is not quarantined refuses the whole rebuild before
    anything is deleted (Conflict); a spec without a blob needs nothing."""
    blobs = []
    for spec in specs:
        blob = resolve(session, key_for(identity, spec, toolchain, recipe))
        if blob is None:
            continue
        if blob.quarantined_at is None:
            raise Conflict(
                f"blob {blob.cache_key} ({spec.target.name}) is not quarantined: --rebuild "
                "replaces only a quarantined blob (an admin quarantines one with "
                "`farm blobs quarantine KEY --reason ...`)"
            )
        blobs.append(blob)
    for blob in blobs:
        _retire(session, store, blob, "rebuilt after quarantine")
    return [blob.cache_key for blob in blobs]


def delete_quarantined(session: Session, store: BlobStore, cache_key: str, by: str) -> None:
    """An admin's `farm blobs delete KEY`: a quarantined blob only (Conflict otherwise); its
    history is kept as for a rebuild."""
    blob = require(session, cache_key)
    if blob.quarantined_at is None:
        raise Conflict(
            f"blob {cache_key} is not quarantined: only a quarantined blob is deleted by hand "
            "(`farm blobs quarantine KEY --reason ...` first; unused blobs go with `farm gc`)"
        )
    _retire(session, store, blob, f"deleted by {by} after quarantine")


def _retire(session: Session, store: BlobStore, blob: Blob, why: str) -> None:
    """Retire one quarantined blob. The conditional UPDATE re-checks the quarantine and holds
    the row (a concurrent `release` waits, then finds no row) while its objects are deleted."""
    still_quarantined = rows_changed(
        session,
        update(Blob)
        .where(Blob.id == blob.id, Blob.quarantined_at.is_not(None))
        .values(quarantine_reason=Blob.quarantine_reason),
    )
    if not still_quarantined:
        session.rollback()
        raise Conflict(f"blob {blob.cache_key} was released meanwhile; nothing was deleted")
    store.delete(blob.storage_key)
    if blob.reference_sha256 is not None:
        store.delete(reference_storage_key(blob.cache_key, blob.reference_sha256))
    pulls, last_pulled_at, failed = session.execute(
        select(
            func.count(),
            func.max(Pull.created_at),
            func.coalesce(func.sum(case((Pull.ok, 0), else_=1)), 0),
        ).where(Pull.blob_id == blob.id)
    ).one()
    at = now()
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
            reason=f"{why}: {blob.quarantine_reason}",
            deleted_at=at,
            state="deleted",
            object_deleted_at=at,
            reference_storage_key=(
                reference_storage_key(blob.cache_key, blob.reference_sha256)
                if blob.reference_sha256
                else None
            ),
        )
    )
    session.execute(
        update(Verification).where(Verification.blob_id == blob.id).values(blob_id=None)
    )
    session.execute(delete(Pull).where(Pull.blob_id == blob.id))
    session.execute(delete(Blob).where(Blob.id == blob.id))
    session.commit()
