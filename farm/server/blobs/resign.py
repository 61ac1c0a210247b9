"""`farm keys resign`: sign the manifest of every stored blob with the farm's current key.

Edges trust keys, not the farm. Retiring a signing key leaves every blob it signed refused by
edges that no longer trust it; blobs recorded before manifests were signed are refused by edges
that need manifests; and a resubmit is a hit, so nothing would ever sign them again. This signs
them again, but only what it can show is genuine, because a signature is what edges trust
instead of the farm's database and bucket:

- the row's model digests, target, spec and toolchain hash to its cache key (docs/architecture.md
  §5), and its `weightless` is its spec's: the fields an edge acts on are the ones its key names;
- its present signature verifies against a key this host trusts (``FARM_TRUSTED_KEYS``, and the
  current key), unless `accept_unverified`: the operator then vouches for the database and
  storage (a key that leaked while they did not, or a farm that never signed);
- its stored object, streamed (never held whole), has the row's size and sha256, and its header
  the row's payload offset.

The stored object's part digests are hashed in the same pass and signed with the manifest
(farm/server/blobs/parts.py), so a re-signed blob downloads in parallel parts too. A blob that
fails any of these is not signed and is reported with the reason. A blob whose
manifest the current key signed already is skipped without reading storage, so running it again
costs little. Each blob is signed in a transaction of its own, and only if its row still holds
what was checked.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from farm.core import hashing
from farm.core.blobformat import MAX_HEADER_BYTES, parse_header
from farm.core.errors import (
    BlobFormatError,
    FarmError,
    IntegrityMismatch,
    Kind,
    SignatureError,
    SpecError,
    StorageError,
)
from farm.core.signing import MIN_PART_BYTES, PART_BYTES, Manifest, Parts, Signer, TrustedKeys
from farm.core.spec import Target, Toolchain
from farm.server.blobs.parts import PartHasher, sign_parts
from farm.server.blobs.signatures import manifest_of, sign_reference, sign_row
from farm.server.db.models import Blob
from farm.server.storage import BlobStore, Presigning

PAGE = 100
"""Rows read per query: a farm of any size is walked in short transactions."""
READ_BYTES = 1 << 20
"""Bytes read from storage per step while hashing a blob (one buffer, whatever its size)."""

Sessions = Callable[[], AbstractContextManager[Session]]


@dataclass(frozen=True)
class Failure:
    cache_key: str
    reason: str
    kind: Kind


@dataclass
class ResignReport:
    key_id: str
    """The key every re-signed blob is now signed with."""
    resigned: int = 0
    skipped: int = 0
    """Already signed by the current key (or deleted while this ran)."""
    failures: list[Failure] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "key_id": self.key_id,
            "resigned": self.resigned,
            "skipped": self.skipped,
            "failed": len(self.failures),
            "failures": [
                {"cache_key": f.cache_key, "reason": f.reason, "kind": f.kind.value}
                for f in self.failures
            ],
        }


@dataclass(frozen=True)
class _Checked:
    """What was checked of a row while it was read; the update needs the row unchanged."""

    id: int
    storage_key: str
    manifest: Manifest


def resign(
    sessions: Sessions,
    store: BlobStore,
    signer: Signer,
    trusted: TrustedKeys,
    accept_unverified: bool = False,
    part_bytes: int = PART_BYTES,
) -> ResignReport:
    """Sign every blob's manifest (and v1 signature) with `signer`; see the module docstring.
    `part_bytes`: the parts a blob in a store edges download from by URL is hashed into."""
    trusted = trusted.with_key(signer.public_key)
    report = ResignReport(signer.key_id)
    last_id = 0
    while True:
        with sessions() as session:
            rows = list(
                session.scalars(select(Blob).where(Blob.id > last_id).order_by(Blob.id).limit(PAGE))
            )
            pending = []
            for row in rows:
                try:
                    checked = _check_row(row, signer, trusted, accept_unverified)
                except FarmError as error:
                    report.failures.append(Failure(row.cache_key, str(error), error.kind))
                    continue
                if checked is None:
                    report.skipped += 1
                else:
                    pending.append(checked)
        if not rows:
            return report
        last_id = rows[-1].id
        for checked in pending:  # storage is read with no transaction open
            try:
                parts = _check_object(store, checked, part_bytes)
            except FarmError as error:
                failure = Failure(checked.manifest.cache_key, str(error), error.kind)
                report.failures.append(failure)
                continue
            _sign(sessions, signer, checked, parts, report)


def _check_row(
    row: Blob, signer: Signer, trusted: TrustedKeys, accept_unverified: bool
) -> _Checked | None:
    """None when the current key signed the row's manifest already; raises why a row cannot be
    signed (a FarmError)."""
    manifest = manifest_of(row)
    if row.signing_key_id == signer.key_id and row.manifest_signature:
        with contextlib.suppress(SignatureError):
            trusted.verify_manifest(manifest, row.signing_key_id, row.manifest_signature)
            return None
    _check_identity(row)
    if not accept_unverified:
        try:
            if row.manifest_signature:
                trusted.verify_manifest(manifest, row.signing_key_id, row.manifest_signature)
            else:
                trusted.verify(row.cache_key, row.sha256, row.signing_key_id, row.signature)
            if row.reference_sha256 is not None:  # re-signed with the manifest: check it too
                trusted.verify_reference(_reference_record(row))
        except SignatureError as error:
            raise SignatureError(
                f"{error}. Not re-signed: to sign it anyway, vouching for the database and "
                "storage, pass --accept-unverified"
            ) from None
    return _Checked(row.id, row.storage_key, manifest)


def _reference_record(row: Blob) -> dict[str, Any]:
    return {
        "cache_key": row.cache_key,
        "sha256": row.sha256,
        "reference_sha256": row.reference_sha256,
        "reference_size_bytes": row.reference_size_bytes,
        "reference_signature": row.reference_signature,
        "signing_key_id": row.signing_key_id,
    }


def _check_identity(row: Blob) -> None:
    """The fields an edge acts on are the ones the cache key names (a v1 signature covers the
    key, not them; a row edited since it was signed fails here)."""
    try:
        target = Target.parse(row.target)
        toolchain = Toolchain(
            openvino=str(row.toolchain.get("openvino") or ""),
            runtime_requirements=row.toolchain.get("runtime_requirements"),
        )
        key = hashing.cache_key(row.model.files, target.name, row.spec, toolchain.key_part(target))
    except (SpecError, AttributeError, TypeError) as error:
        raise IntegrityMismatch(f"its record cannot be read: {error}; not re-signed") from None
    if key != row.cache_key:
        raise IntegrityMismatch(
            f"its model, target, spec and toolchain hash to {key}, not to its cache key: the row "
            "was changed after it was recorded; not re-signed"
        )
    if bool(row.spec.get("weightless")) != row.weightless:
        raise IntegrityMismatch(
            f"its weightless column ({row.weightless}) contradicts its spec; not re-signed"
        )


def _check_object(store: BlobStore, checked: _Checked, part_bytes: int) -> Parts | None:
    """The stored object has the row's size, sha256 and payload offset: streamed, hashed as it
    is read, one buffer at a time. Returns its part digests, hashed in the same pass, where
    edges download from the store by URL (none for a local store: read whole)."""
    manifest, key = checked.manifest, checked.storage_key
    digest, size, head = PartHasher(max(part_bytes, MIN_PART_BYTES)), 0, bytearray()
    try:
        with contextlib.closing(store.open_read(key)) as stream:
            while chunk := stream.read(READ_BYTES):
                digest.update(chunk)
                size += len(chunk)
                if len(head) < MAX_HEADER_BYTES:
                    head += chunk[: MAX_HEADER_BYTES - len(head)]
    except FarmError:
        raise
    except FileNotFoundError:
        raise StorageError(f"its object {key} is missing from storage; not re-signed") from None
    except Exception as error:  # any failure to read the object (boto3's are not OSErrors)
        raise StorageError(f"reading {key} from storage failed: {error}") from error
    actual = digest.whole.hexdigest()
    if size != manifest.size_bytes or actual != manifest.sha256:
        raise IntegrityMismatch(
            f"it is corrupt in storage: {key} has {size} bytes with sha256 {actual}, recorded "
            f"{manifest.size_bytes} bytes with sha256 {manifest.sha256}; not re-signed"
        )
    try:
        offset = parse_header(bytes(head), size, key).payload_offset
    except BlobFormatError as error:
        raise IntegrityMismatch(f"{error}; not re-signed") from None
    if offset != manifest.payload_offset:
        raise IntegrityMismatch(
            f"its header puts the payload at byte {offset}, the row says "
            f"{manifest.payload_offset}; not re-signed"
        )
    return digest.parts(actual) if isinstance(store, Presigning) else None


def _sign(
    sessions: Sessions,
    signer: Signer,
    checked: _Checked,
    parts: Parts | None,
    report: ResignReport,
) -> None:
    with sessions() as session:
        row = session.get(Blob, checked.id)
        if row is None:
            report.skipped += 1  # deleted by `farm gc` meanwhile
            return
        if manifest_of(row) != checked.manifest:
            report.failures.append(
                Failure(
                    row.cache_key,
                    "its row changed while it was being checked; run `farm keys resign` again",
                    Kind.CONFLICT,
                )
            )
            return
        sign_row(row, signer)
        sign_reference(row, signer)  # by the key that signs the manifest, or edges refuse it
        signature = None
        if parts is not None:
            signature = signer.sign_parts(row.cache_key, row.sha256, row.size_bytes, parts)
        sign_parts(row, parts, signature)
        session.commit()
    report.resigned += 1
