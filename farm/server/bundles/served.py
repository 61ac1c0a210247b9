"""A worker's side of served pipeline bundles (§17): claim a part, compile it in the sandboxed
child, store its files, and publish every bundle it completes.

A part is claimed with a conditional UPDATE (queued, or running under an expired lease → running
with this worker and a lease), so a duplicate or late message finds it taken or done and does
nothing; the lease is renewed while the child compiles, and a part whose lease was taken over
stops. The last part of a bundle to finish publishes it: its files are already under
`bundle-files/<sha256>`, the folder's own files are copied there from `models/`, and the signed
manifest goes to `bundles/<bundle_key>.json` last. The first manifest written stays (objects are
written once), so two workers that race are harmless.

What a worker signs never comes from the database or the store as they are (the API can write
both and holds no signing key): it computes the bundle and part keys from the rows' own fields
before compiling and before publishing, compiles only with its own toolchain, and builds the
manifest from the parts' signed listings (`farm.server.bundles.parts.stored_part`).
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import update
from sqlalchemy.orm import Session, sessionmaker

from farm.core.bundles import BundleFile, BundleManifest, sign
from farm.core.clock import now
from farm.core.errors import FarmError, IntegrityMismatch, KeyFileError, Kind, PipelineError
from farm.core.pipelines import bundle_key
from farm.core.signing import Signer, TrustedKeys
from farm.core.spec import Target
from farm.server.bundles.builds import (
    DONE,
    FAILED,
    QUEUED,
    RUNNING,
    builds_of_part,
    fail_builds,
    parts_of,
    stage_folder,
)
from farm.server.bundles.compile import PART_OPTION
from farm.server.bundles.parts import (
    WHOLE,
    AssembledCheck,
    Part,
    PartOutput,
    StoredPart,
    listing_keys,
    part_keys,
    publish_part,
    sandboxed_check,
    stored_part,
)
from farm.server.bundles.storage import file_storage_key, manifest_storage_key, published
from farm.server.db.models import BundleBuild, BundlePart
from farm.server.db.session import rows_changed
from farm.server.jobs.runner import RunLimits
from farm.server.jobs.sandbox import pipeline_in_child
from farm.server.leases import Renewing
from farm.server.storage import BlobStore, model_storage_key

log = logging.getLogger(__name__)

NO_SIGNING_KEY = "this worker has no signing key (FARM_SIGNING_KEY) to sign bundle manifests with"
UNSIGNED_LISTING = "no listing of it is signed by a key this farm trusts: it is compiled again"
UNTRUSTED_CLAIMS = 3
"""Claims after which a part still without a trusted listing fails (FARM_MAX_ATTEMPTS' default)."""
MIXED_KEYS = (
    "the workers do not trust each other's keys; give every worker the same FARM_SIGNING_KEY, "
    "or each other's public keys in FARM_TRUSTED_KEYS"
)

Sessions = sessionmaker[Session]


def run_part(
    sessions: Sessions,
    store: BlobStore,
    part_id: int,
    *,
    worker: str,
    limits: RunLimits,
    signer: Signer | None,
    trusted: TrustedKeys | None = None,
) -> str | None:
    """Compile part `part_id` here if it is there to take; publish what it completes. The
    part's state afterwards (None: no such part). A part whose listing `signer` or one of
    `trusted` signed is not compiled again."""
    with sessions() as session:
        part = session.get(BundlePart, part_id)
        if part is None:
            return None
        if not _claim(session, part_id, worker, limits.lease_seconds):
            session.refresh(part)
            if part.state == DONE:  # a re-send, or a bundle whose parts were all done
                publish_ready(session, store, signer, part_id, trusted, limits=limits)
            return part.state
        session.refresh(part)
        build = session.get(BundleBuild, part.bundle_build_id)
        assert build is not None
        for other in builds_of_part(session, part_id):
            if other.state == QUEUED:
                other.state, other.updated_at = RUNNING, now()
        session.commit()
        fields = _KeyFields.of(build)
        unit = Part(part.name, part.part_key, fields.files, part.memory_bytes)
    started = time.monotonic()
    try:
        if signer is None:  # its bundles could never be published: fail before compiling
            raise KeyFileError(NO_SIGNING_KEY)
        # A listing signed under a key the part is not would poison that key.
        fields.check([(unit.name, unit.key)], whole=False)
        convert_task = fields.convert_task
        found = stored_part(store, unit.key, listing_keys(signer, trusted))
        if found is not None:  # compiled before (by the embedded farm on this store)
            entries, metrics = found
        else:
            _check_toolchain(fields)
            with tempfile.TemporaryDirectory(prefix="farm-part-") as scratch:
                root = Path(scratch) / "folder"
                stage_folder(store, fields.files, root, full=True)
                with _lease(sessions, part_id, worker, limits.lease_seconds) as lease:
                    done = pipeline_in_child(
                        {path: root / path for path in fields.files},
                        fields.kind,
                        fields.target.name,
                        fields.compile_options | {PART_OPTION: unit.name},
                        Path(scratch) / "out",
                        unit.key,
                        timeout_seconds=limits.max_run_seconds,
                        memory_bytes=limits.memory_bytes,
                        compile_user=limits.compile_user,
                        compile_launcher=limits.compile_launcher,
                        should_stop=lease.should_stop,
                        convert_task=convert_task,
                    )
                if lease.lost.is_set():
                    log.warning("bundle part %s was taken over; its output is dropped", part_id)
                    return RUNNING
                output = PartOutput(dict(done.outputs), {"reference": done.reference})
                entries, metrics = publish_part(store, unit, output, signer)
        outputs = {e.path: {"sha256": e.sha256, "size": e.size} for e in entries}
    except FarmError as error:
        if error.kind is not Kind.INFRASTRUCTURE:  # the part's own failure: not retried
            _fail(sessions, part_id, worker, str(error))
            return FAILED
        _release(sessions, part_id, worker)
        raise
    except BaseException:
        _release(sessions, part_id, worker)  # the retry (or the reconciler) takes it again
        raise
    seconds = time.monotonic() - started
    with sessions() as session:
        finished = rows_changed(
            session,
            update(BundlePart)
            .where(
                BundlePart.id == part_id, BundlePart.state == RUNNING, BundlePart.worker == worker
            )
            .values(
                state=DONE,
                output_files=outputs,
                metrics={**metrics, "seconds": round(seconds, 3)},
                seconds=seconds,
                finished_at=now(),
                lease_expires_at=None,
                error=None,
            ),
        )
        session.commit()
        if finished:
            publish_ready(session, store, signer, part_id, trusted, limits=limits)
        return DONE if finished else RUNNING


def _ours(part_id: int, worker: str) -> tuple:
    """The part is running under this worker's claim."""
    return (BundlePart.id == part_id, BundlePart.state == RUNNING, BundlePart.worker == worker)


def _claim(session: Session, part_id: int, worker: str, lease_seconds: int) -> bool:
    at = now()
    taken = rows_changed(
        session,
        update(BundlePart)
        .where(
            BundlePart.id == part_id,
            (BundlePart.state == QUEUED)
            | ((BundlePart.state == RUNNING) & (BundlePart.lease_expires_at < at)),
        )
        .values(
            state=RUNNING,
            worker=worker,
            attempts=BundlePart.attempts + 1,
            lease_expires_at=at + timedelta(seconds=lease_seconds),
            started_at=at,
            error=None,
        ),
    )
    session.commit()
    return taken == 1


def _fail(sessions: Sessions, part_id: int, worker: str, reason: str) -> None:
    with sessions() as session:
        failed = rows_changed(
            session,
            update(BundlePart)
            .where(
                BundlePart.id == part_id, BundlePart.state == RUNNING, BundlePart.worker == worker
            )
            .values(state=FAILED, error=reason[:4000], finished_at=now(), lease_expires_at=None),
        )
        if failed:
            part = session.get(BundlePart, part_id)
            assert part is not None
            session.refresh(part)
            fail_builds(session, part, reason)
        session.commit()


def _release(sessions: Sessions, part_id: int, worker: str) -> None:
    """Give the part back to its queue (an infrastructure error: the task is retried)."""
    try:
        with sessions() as session:
            session.execute(
                update(BundlePart)
                .where(
                    BundlePart.id == part_id,
                    BundlePart.state == RUNNING,
                    BundlePart.worker == worker,
                )
                .values(state=QUEUED, lease_expires_at=None)
            )
            session.commit()
    except Exception:  # the database itself failed: the lease expires and the reconciler acts
        log.warning("could not give bundle part %s back", part_id, exc_info=True)


# --- publishing ------------------------------------------------------------------------------


def publish_ready(
    session: Session,
    store: BlobStore,
    signer: Signer | None,
    part_id: int,
    trusted: TrustedKeys | None = None,
    *,
    limits: RunLimits,
) -> list[str]:
    """Publish every bundle of part `part_id` whose parts are all done; their keys. What the
    manifest lists comes from the build's row (checked against its key) and the parts'
    listings that `signer` or one of `trusted` signed, never from the rows' outputs: the API
    can write the database, and holds no signing key. A part done without such a listing (an
    older farm's, or one removed) is queued again, for the reconciler to send; its bundles
    wait for it. A bundle of sub-model parts is opened whole in a child with `limits`."""
    keys = []
    for build in builds_of_part(session, part_id):
        if build.state in (DONE, FAILED) and published(store, build.bundle_key) is not None:
            continue
        parts = parts_of(session, build.id)
        if not parts or any(p.state != DONE for p in parts):
            continue
        try:
            if signer is None:
                raise KeyFileError(NO_SIGNING_KEY)
            fields = _KeyFields.of(build)
            fields.check([(p.name, p.part_key) for p in parts], whole=True)
            trust = listing_keys(signer, trusted)
            listings = {p.id: stored_part(store, p.part_key, trust) for p in parts}
            unsigned = [p for p in parts if listings[p.id] is None]
            if unsigned:
                _compile_again(session, unsigned)
                continue
            publish(store, signer, build, parts, listings, fields, sandboxed_check(limits))
        except FarmError as error:
            if error.kind is Kind.INFRASTRUCTURE:  # the task is retried, and publishes again
                raise
            at = now()
            build.state, build.finished_at, build.updated_at = FAILED, at, at
            build.error = f"publishing the bundle failed: {error}"[:4000]
            session.commit()
            continue
        at = now()
        build.state, build.error, build.finished_at, build.updated_at = DONE, None, at, at
        session.commit()
        keys.append(build.bundle_key)
    return keys


def publish(
    store: BlobStore,
    signer: Signer,
    build: BundleBuild,
    parts: list[BundlePart],
    listings: Mapping[int, StoredPart | None],
    fields: _KeyFields,
    check: AssembledCheck,
) -> dict[str, Any]:
    """Store the folder's files beside the parts' outputs (`listings`: each part's signed
    listing, by part id) and the signed manifest last (a bundle exists only when all its files
    do); an existing manifest is kept. `fields`: the build's, checked against its key;
    `check`: opens a pipeline of sub-model parts whole (`check_parts`)."""
    existing = published(store, build.bundle_key)
    if existing is not None:
        return existing
    entries: dict[str, BundleFile] = {}
    if fields.convert_task is None:  # a Hugging Face folder ships its exported folder instead
        for path, sha in sorted(build.files.items()):
            stored = _copy_model_file(store, sha)
            entries[path] = BundleFile(path, sha, stored)
    reference: dict[str, Any] = {}
    compiled: list[BundleFile] = []
    for part in parts:
        listing = listings[part.id]
        assert listing is not None  # publish_ready queues a part without one again
        files, metrics = listing
        for file in sorted(files, key=lambda f: f.path):
            if file.path in entries:
                raise PipelineError(f"bundle part {part.name}: an output is named like {file.path}")
            entries[file.path] = file
            compiled.append(file)
        if part.name == WHOLE:
            reference = dict(metrics.get("reference") or {})
    if all(part.name != WHOLE for part in parts):  # sub-models compiled apart: assemble them
        reference = _check_assembled(store, fields, compiled, check)
    manifest = BundleManifest(
        bundle_key=build.bundle_key,
        pipeline=fields.kind,
        target=fields.target.name,
        options=fields.compile_options,
        toolchain=fields.toolchain,
        files=tuple(entries[path] for path in sorted(entries)),
        reference=reference,
    )
    signed = sign(manifest, signer)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as out:
        json.dump(signed, out)
    try:
        store.put_file(manifest_storage_key(build.bundle_key), out.name)
    finally:
        Path(out.name).unlink(missing_ok=True)
    return signed


@dataclass(frozen=True)
class _KeyFields:
    """What a build's row says its key is made of: what the worker compiles and signs."""

    bundle_key: str
    kind: str
    files: dict[str, str]
    target: Target
    options: dict[str, Any]
    toolchain: dict[str, str]

    @classmethod
    def of(cls, build: BundleBuild) -> _KeyFields:
        return cls(
            build.bundle_key,
            build.pipeline,
            dict(build.files),
            Target.parse(build.target),
            dict(build.options),
            dict(build.toolchain),
        )

    @property
    def compile_options(self) -> dict[str, Any]:
        """The GenAI options: the key's, without the conversion."""
        return {name: value for name, value in self.options.items() if name != "convert"}

    @property
    def convert_task(self) -> str | None:
        """The Hugging Face export's task, from the key's options (never the row's column)."""
        convert = self.options.get("convert")
        return str(convert["task"]) if isinstance(convert, dict) else None

    def check(self, parts: list[tuple[str, str]], *, whole: bool) -> None:
        """IntegrityMismatch unless the bundle key is that of these fields, and each part key
        (`parts`: name, key) that of its part; when `whole`, each of the key's parts once. The
        worker signs under these keys what the fields say: rows altered in the database must
        not make it sign one folder's files under another's key."""
        fields = (self.kind, self.files, self.target, self.options, self.toolchain)
        if bundle_key(*fields) != self.bundle_key:
            raise IntegrityMismatch(
                f"bundle {self.bundle_key}: its row's files, target, options or toolchain are "
                "not those of its key"
            )
        expected = part_keys(*fields)
        names = sorted(name for name, _ in parts)
        if whole and names != sorted(expected):
            raise IntegrityMismatch(
                f"bundle {self.bundle_key}: its parts are {names}, its key's {sorted(expected)}"
            )
        for name, key in parts:
            if expected.get(name) != key:
                raise IntegrityMismatch(
                    f"bundle part {key}: not the {name} part of bundle {self.bundle_key}"
                )


def _check_toolchain(fields: _KeyFields) -> None:
    """A worker compiles a part only with the releases its key names (a part the database sent
    to another toolchain's queue would be signed as compiled by these)."""
    from farm.genai import toolchain  # GenAI: a worker that compiles bundles has it

    own = toolchain(fields.target)
    if own != fields.toolchain:
        raise IntegrityMismatch(
            f"bundle {fields.bundle_key} is keyed for the toolchain {fields.toolchain}; this "
            f"worker compiles with {own}: the part was sent to the wrong queue"
        )


def _compile_again(session: Session, parts: list[BundlePart]) -> None:
    """Parts done without a listing a trusted key signed: queued again, unsent, for the
    reconciler to send, and the bundles that have them wait. A part claimed
    `UNTRUSTED_CLAIMS` times already fails with its bundles instead: its workers do not trust
    each other's keys. Only rows still done change (another worker may have claimed one
    since); committed here."""
    at = now()
    for part in parts:
        done = (BundlePart.id == part.id, BundlePart.state == DONE)
        if part.attempts >= UNTRUSTED_CLAIMS:
            reason = f"{UNSIGNED_LISTING} after {part.attempts} claims: {MIXED_KEYS}"
            values: dict[str, Any] = {"state": FAILED, "error": reason, "finished_at": at}
            if rows_changed(session, update(BundlePart).where(*done).values(**values)):
                session.refresh(part)
                fail_builds(session, part, reason)
            continue
        log.warning("bundle part %s: %s", part.part_key, UNSIGNED_LISTING)
        rows_changed(
            session,
            update(BundlePart)
            .where(*done)
            .values(
                state=QUEUED,
                sent_at=None,
                finished_at=None,
                output_files=None,
                metrics=None,
                worker=None,
                seconds=None,
            ),
        )
    session.commit()


def _check_assembled(
    store: BlobStore, fields: _KeyFields, compiled: list[BundleFile], check: AssembledCheck
) -> dict[str, Any]:
    """Open the pipeline on exactly its parts' cache entries and check it compiles nothing
    (`farm.server.bundles.parts.check_parts`): the bundle's reference run."""
    from farm.server.bundles.builds import recognise
    from farm.server.bundles.parts import check_parts, options_of

    with tempfile.TemporaryDirectory(prefix="farm-bundle-check-") as scratch:
        root = Path(scratch) / "folder"
        stage_folder(store, fields.files, root, full=True)
        folder = recognise(root, fields.kind)
        options = options_of(folder.kind, fields.target, fields.compile_options)
        return check_parts(store, folder, options, compiled, check)


def _copy_model_file(store: BlobStore, sha: str) -> int:
    """`models/<sha>` → `bundle-files/<sha>` (the edge fetches every file of a bundle from
    there); its size."""
    target = file_storage_key(sha)
    found = store.stat(target)
    if found is not None:
        return found.size
    with store.open_read(model_storage_key(sha)) as source, store.writer(target, sha) as writer:
        while chunk := source.read(writer.chunk_bytes):
            writer.write(chunk)
        stored = writer.commit()
    return stored.size


def _lease(sessions: Sessions, part_id: int, worker: str, lease_seconds: int) -> Renewing:
    """A running part's lease; lost once the part is no longer this worker's."""

    def renew() -> bool:
        with sessions() as session:
            changed = rows_changed(
                session,
                update(BundlePart)
                .where(
                    BundlePart.id == part_id,
                    BundlePart.state == RUNNING,
                    BundlePart.worker == worker,
                )
                .values(lease_expires_at=now() + timedelta(seconds=lease_seconds)),
            )
            session.commit()
        return bool(changed)

    return Renewing(renew, max(lease_seconds / 3, 0.2), f"bundle part {part_id}")
