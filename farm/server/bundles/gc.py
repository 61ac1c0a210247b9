"""`farm gc` for pipeline bundles (§17): stale manifests, then the bundle files nothing lists.

A manifest `bundles/<key>.json` is stale when it was written `unpulled_days` ago or more and its
`bundle_builds` row was neither submitted nor fetched through the API since (`updated_at`,
`pulled_at`): the rule of blobs, with the manifest's fetches as its pulls. A manifest with no
row (the embedded farm publishes without one, and records no pulls) is kept: gc cannot tell
whether it is used. The order keeps readers safe: the row goes first ('failed', with gc's
reason, and its parts that no other live bundle needs failed too, so no submit or worker
publishes from outputs about to go), then the manifest object. A submit of the key afterwards
compiles it again, like any failed bundle.

A bundle file `bundle-files/<sha256>` is deleted when no manifest left in the store lists it,
no stored part lists it (`bundle-parts/<part_key>.<key id>.json`: the listings of a part gc
failed go with its manifest, and version 1's unsigned `<part_key>.json` always), no part that
is not failed produced it, and it was stored `grace_seconds` ago or more (the model files'
grace, FARM_MODEL_GRACE_SECONDS): a part uploads its outputs before it is marked done, and a
publish copies the folder's files before it writes the manifest.
Manifests and listings are read here without checking their signatures: what they list is only
kept longer, never built into a bundle (`farm.server.bundles.parts.stored_part` checks).
"""

from __future__ import annotations

import json
from collections.abc import Set
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from farm.core.clock import now
from farm.core.errors import StorageError
from farm.server.bundles.builds import DONE, FAILED, builds_of_part, parts_of
from farm.server.bundles.parts import PARTS, is_signed_name, part_key_of
from farm.server.bundles.storage import file_storage_key, manifest_storage_key
from farm.server.db.models import BundleBuild, BundlePart
from farm.server.storage import BlobStore, ListsObjects

MANIFESTS, FILES = "bundles/", "bundle-files/"


@dataclass(frozen=True)
class StaleBundle:
    """A published bundle nobody submitted or fetched for `unpulled_days`."""

    bundle_key: str
    pipeline: str
    target: str
    published_at: datetime
    last_used_at: datetime


@dataclass(frozen=True)
class BundleFileCandidate:
    """A bundle file no manifest lists and no live part produced."""

    sha256: str
    size_bytes: int
    stored_at: datetime


@dataclass
class BundleGcReport:
    bundles: list[StaleBundle] = field(default_factory=list)
    files: list[BundleFileCandidate] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def file_bytes(self) -> int:
        return sum(f.size_bytes for f in self.files)


def collect_bundles(
    session: Session,
    store: BlobStore,
    unpulled_days: int,
    grace_seconds: int,
    dry_run: bool = False,
    at: datetime | None = None,
) -> BundleGcReport:
    """Remove stale manifests, then unreferenced bundle files (module docstring); in a dry run
    only report what would go. A store that cannot list its objects: nothing to do."""
    report = BundleGcReport()
    if not isinstance(store, ListsObjects):
        return report
    began = at or now()
    cutoff = began - timedelta(days=unpulled_days)
    try:
        manifests = {
            key.removeprefix(MANIFESTS).removesuffix(".json"): stored_at
            for key, _, stored_at in store.list_objects(MANIFESTS)
            if key.endswith(".json")
        }
        report.bundles = _stale(session, manifests, cutoff)
        stale = {bundle.bundle_key for bundle in report.bundles}
        forgotten: dict[int, str] = {}  # parts failed with their bundles (would be, dry)
        for bundle in report.bundles:
            gone = _forget(session, bundle.bundle_key, unpulled_days, dry_run)
            forgotten |= gone
            if not dry_run:
                store.delete(manifest_storage_key(bundle.bundle_key))
        gone_parts = set(forgotten.values())
        listings = [key for key, _, _ in store.list_objects(PARTS)]
        # Version 1's unsigned listings (`<part_key>.json`) are read by nothing any more.
        kept = [
            key for key in listings if part_key_of(key) not in gone_parts and is_signed_name(key)
        ]
        if not dry_run:
            for key in set(listings) - set(kept):  # a stored part lists files about to go
                store.delete(key)
        listed = _listed_files(
            store, [manifest_storage_key(k) for k in manifests if k not in stale]
        ) | _listed_files(store, kept)
        live = _live_part_files(session, set(forgotten))
        file_cutoff = began - timedelta(seconds=grace_seconds)
        for key, size, stored_at in store.list_objects(FILES):
            sha = key.removeprefix(FILES)
            if sha in listed or sha in live or stored_at > file_cutoff:
                continue
            if not dry_run:
                session.rollback()  # a fresh look: a part done since gc listed
                if sha in _live_part_files(session):
                    continue
                store.delete(file_storage_key(sha))
            report.files.append(BundleFileCandidate(sha, size, stored_at))
    except StorageError as error:
        report.errors.append(str(error))
    return report


def _stale(session: Session, manifests: dict[str, datetime], cutoff: datetime) -> list[StaleBundle]:
    old = [key for key, stored_at in manifests.items() if stored_at <= cutoff]
    if not old:
        return []
    rows = session.scalars(select(BundleBuild).where(BundleBuild.bundle_key.in_(old)))
    stale = []
    for build in rows:
        used = max(filter(None, [build.updated_at, build.pulled_at]))
        if used <= cutoff:
            stale.append(
                StaleBundle(
                    build.bundle_key,
                    build.pipeline,
                    build.target,
                    manifests[build.bundle_key],
                    used,
                )
            )
    return sorted(stale, key=lambda bundle: bundle.bundle_key)


def _forget(session: Session, key: str, unpulled_days: int, dry_run: bool) -> dict[int, str]:
    """The build failed with gc's reason, and its parts no other live bundle needs (their ids
    and part keys); in a dry run only those."""
    build = session.scalar(select(BundleBuild).where(BundleBuild.bundle_key == key))
    if build is None:
        return {}
    forgotten = {
        part.id: part.part_key
        for part in parts_of(session, build.id)
        if part.state == DONE
        and not any(
            b.state != FAILED and b.id != build.id for b in builds_of_part(session, part.id)
        )
    }
    if dry_run:
        return forgotten
    at = now()
    reason = (
        f"removed by farm gc: not submitted or pulled for {unpulled_days} days; submit it again "
        "to compile it again"
    )
    build.state, build.error, build.finished_at, build.updated_at = FAILED, reason, at, at
    for part in parts_of(session, build.id):
        if part.id in forgotten:
            part.state, part.error, part.finished_at = FAILED, reason, at
    session.commit()
    return forgotten


def _listed_files(store: BlobStore, keys: list[str]) -> set[str]:
    """The sha256 of every file the manifests or stored parts at `keys` (storage keys) list."""
    listed: set[str] = set()
    for key in keys:
        try:
            with store.open_read(key) as stream:
                document = json.load(stream)
        except (OSError, ValueError, StorageError):
            continue  # deleted meanwhile, or not JSON: lists nothing
        if not isinstance(document, dict):
            continue
        # A signed manifest, a part's signed listing, or a listing of an older farm.
        body = document.get("manifest") or document.get("listing") or document
        files = body.get("files") if isinstance(body, dict) else None
        for entry in files if isinstance(files, list) else []:
            if isinstance(entry, dict) and isinstance(entry.get("sha256"), str):
                listed.add(entry["sha256"])
    return listed


def _live_part_files(session: Session, forgotten: Set[int] = frozenset()) -> set[str]:
    """The outputs of parts not failed (nor among `forgotten`)."""
    query = select(BundlePart.output_files).where(
        BundlePart.state != FAILED, BundlePart.output_files.is_not(None)
    )
    if forgotten:
        query = query.where(BundlePart.id.not_in(forgotten))
    outputs = session.scalars(query)
    return {
        entry["sha256"]
        for files in outputs
        for entry in (files or {}).values()
        if isinstance(entry, dict) and "sha256" in entry
    }


def named_model_files(session: Session) -> set[str]:
    """The folders' files of bundles not failed: kept in `models/` (a worker stages them)."""
    rows = session.scalars(select(BundleBuild.files).where(BundleBuild.state != FAILED))
    return {sha for files in rows for sha in (files or {}).values()}
