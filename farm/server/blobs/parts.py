"""A blob's part digests (`farm.core.signing.Parts`): hashed by the worker from the blob file it
still holds after a remote store took its copy, after the job is recorded `succeeded` (off the
job's path, as the reference run is), signed by the key that signed its manifest, and kept on
the blob's row. An edge that verified them downloads the parts on several connections and
checks each as it arrives (docs/architecture.md §10); one without them checks the whole file.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

from sqlalchemy.orm import Session, sessionmaker

from farm.core.hashing import CHUNK_BYTES
from farm.core.signing import MIN_PART_BYTES, PART_BYTES, Parts, Signer, part_count
from farm.server.db.models import Blob

log = logging.getLogger(__name__)


class PartHasher:
    """The sha256 of each `part_bytes` piece of a stream fed in any chunks, and of the whole."""

    def __init__(self, part_bytes: int = PART_BYTES) -> None:
        self.part_bytes = part_bytes
        self.whole = hashlib.sha256()
        self.digests: list[str] = []
        self._part = hashlib.sha256()
        self._in_part = 0

    def update(self, chunk: bytes | memoryview) -> None:
        view = memoryview(chunk)
        while view:
            taken = view[: self.part_bytes - self._in_part]
            self._part.update(taken)
            self.whole.update(taken)
            self._in_part += len(taken)
            view = view[len(taken) :]
            if self._in_part == self.part_bytes:
                self.digests.append(self._part.hexdigest())
                self._part, self._in_part = hashlib.sha256(), 0

    def parts(self, sha256: str) -> Parts | None:
        """The parts, if the whole was `sha256` (nothing is signed for bytes the record does
        not name) and made at least two parts (one connection does as well with one)."""
        digests = self.digests + ([self._part.hexdigest()] if self._in_part else [])
        if self.whole.hexdigest() != sha256 or len(digests) < 2:
            return None
        return Parts(self.part_bytes, tuple(digests))


def digest_parts(path: Path, sha256: str, part_bytes: int = PART_BYTES) -> Parts | None:
    """The parts of the file at `path`, hashed in one pass with the whole (`PartHasher.parts`:
    None unless the whole is `sha256`)."""
    hasher = PartHasher(part_bytes)
    buffer = bytearray(CHUNK_BYTES)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as blob:
        if part_count(os.fstat(blob.fileno()).st_size, part_bytes) < 2:
            return None
        while read := blob.readinto(buffer):
            hasher.update(view[:read])
    return hasher.parts(sha256)


def record_parts(
    sessions: sessionmaker[Session],
    blob_id: int,
    path: Path,
    signer: Signer | None,
    part_bytes: int = PART_BYTES,
) -> bool:
    """Hash the parts of blob `blob_id` from `path` (its bytes, still here) and keep them,
    signed, on its row; whether it did. Best effort: a blob without parts downloads as one
    stream, checked whole. Parts are never smaller than `MIN_PART_BYTES` (edges refuse
    smaller ones)."""
    if signer is None:
        return False
    with sessions() as session:
        blob = session.get(Blob, blob_id)
        if blob is None or blob.signing_key_id != signer.key_id:
            return False
        cache_key, sha256, size = blob.cache_key, blob.sha256, blob.size_bytes
    try:
        parts = digest_parts(path, sha256, max(part_bytes, MIN_PART_BYTES))
    except OSError:
        log.warning("blob %s: its parts were not hashed", cache_key, exc_info=True)
        return False
    if parts is None:
        return False
    signature = signer.sign_parts(cache_key, sha256, size, parts)
    with sessions() as session:
        blob = session.get(Blob, blob_id)
        if blob is None or blob.sha256 != sha256 or blob.signing_key_id != signer.key_id:
            return False  # deleted, rebuilt or re-signed by another key meanwhile
        sign_parts(blob, parts, signature)
        session.commit()
    return True


def sign_parts(blob: Blob, parts: Parts | None, signature: str | None) -> Blob:
    """Set the row's part columns (all null without parts)."""
    if parts is None or signature is None:
        blob.part_bytes = blob.part_sha256s = blob.parts_signature = None  # SQL NULL, all three
        return blob
    blob.part_bytes, blob.part_sha256s = parts.part_bytes, list(parts.sha256s)
    blob.parts_signature = signature
    return blob
