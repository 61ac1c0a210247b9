"""Blob and model storage: one small interface, one class per URL scheme.

Keys are relative, slash-separated: ``models/<sha256>``, ``blobs/<cache_key>.blob``.
"""

from __future__ import annotations

import abc
import hashlib
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from farm.core.errors import ChecksumMismatch, InvalidKey, StorageError

if TYPE_CHECKING:
    from farm.core.config import Settings
    from farm.core.identity import FileVersion


MODELS_FOLDER = "models"


def model_storage_key(sha256: str) -> str:
    """Model files are content-addressed: one object per file digest, uploaded once."""
    return f"{MODELS_FOLDER}/{sha256}"


BLOBS_FOLDER = "blobs"


def blob_storage_key(cache_key: str) -> str:
    return f"{BLOBS_FOLDER}/{cache_key}.blob"


def reference_storage_key(cache_key: str, sha256: str) -> str:
    """The blob's reference outputs (`farm.core.reference`): inputs and CPU f32 outputs, under
    their own digest. Two compiles of one key may make references that differ in their last
    bits (another CPU, other inputs); the store is write-once, so a leftover of an earlier one
    must never block the next. `farm gc` builds the same key in SQL (farm/server/blobs/gc.py)."""
    return f"references/{cache_key}/{sha256}.npz"


@dataclass(frozen=True)
class StoredObject:
    key: str
    size: int
    sha256: str


_SEGMENT = re.compile(r"^[A-Za-z0-9._-]+$")


def check_key(key: str) -> str:
    """A key is slash-separated plain segments: no `..`, no absolute path, no odd bytes."""
    segments = key.split("/")
    if not key or any(s in ("", ".", "..") or not _SEGMENT.match(s) for s in segments):
        raise InvalidKey(f"invalid storage key {key!r}")
    return key


def check_digest(key: str, sha256: str, expected: str | None) -> None:
    """Refuse bytes of digest `sha256` for `key` when they are not the `expected` ones
    (ChecksumMismatch), before anything is stored; None expects nothing."""
    if expected is not None and sha256 != expected:
        raise ChecksumMismatch(
            f"{key}: the bytes have sha256 {sha256}, expected {expected}; nothing stored"
        )


class ObjectWriter(abc.ABC):
    """One object written as a stream of bytes, hashed as they pass: `write` them in order,
    then `commit`. Nothing is visible under the key before `commit`; leaving the `with` block
    without it (or a failed commit) discards what was written.

    With `expected_sha256`, `commit` refuses bytes with another digest (ChecksumMismatch) and
    stores nothing.
    """

    chunk_bytes: int = 1 << 20
    """The write size this store handles best (callers reading a file use it)."""

    def __init__(self, key: str, expected_sha256: str | None) -> None:
        self.key = check_key(key)
        self.expected_sha256 = expected_sha256
        self.size = 0
        self._digest = hashlib.sha256()
        self._done = False

    def write(self, data: bytes) -> None:
        self._digest.update(data)
        self.size += len(data)
        self._write(data)

    def commit(self) -> StoredObject:
        sha256 = self._digest.hexdigest()
        check_digest(self.key, sha256, self.expected_sha256)
        stored = self._commit(sha256)
        self._done = True
        return stored

    def close(self) -> None:
        """Discard what was written, unless committed."""
        if not self._done:
            self._done = True
            self._discard()

    def __enter__(self) -> ObjectWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @abc.abstractmethod
    def _write(self, data: bytes) -> None: ...

    @abc.abstractmethod
    def _commit(self, sha256: str) -> StoredObject:
        """Make the object visible under its key; `sha256` is the digest of all its bytes."""

    @abc.abstractmethod
    def _discard(self) -> None:
        """Drop what was written; must not block for long (it may run on an event loop)."""


class BlobStore(abc.ABC):
    """Where model files and blobs live. Writes are all-or-nothing."""

    @abc.abstractmethod
    def writer(self, key: str, expected_sha256: str | None = None) -> ObjectWriter:
        """A writer for a new object under `key` (see ObjectWriter)."""

    def put_file(
        self, key: str, path: str | Path, expected_sha256: str | None = None
    ) -> StoredObject:
        """Store the file at `path` under `key`, hashing it on the way (one pass over it);
        refuse a mismatch with `expected_sha256`."""
        with self.writer(key, expected_sha256) as writer, open(path, "rb") as source:
            while chunk := source.read(writer.chunk_bytes):
                writer.write(chunk)
            return writer.commit()

    def put_version(
        self, key: str, path: str | Path, sha256: str, version: FileVersion
    ) -> StoredObject:
        """Store the file at `path`, whose bytes had digest `sha256` while the file had
        `version` (`farm.core.identity.file_version`, taken before the digest). A store that
        copies without reading the bytes (a local folder) checks the version instead of
        hashing them again; the others hash them on the way, as `put_file`."""
        return self.put_file(key, path, expected_sha256=sha256)

    def adopt_file(
        self, key: str, path: str | Path, expected_sha256: str | None = None
    ) -> StoredObject:
        """Store the file at `path` under `key`; the caller gives the file up: a local store
        moves it into place, or copies it and empties the file as it goes (another user's), so
        what was stored is read from the store afterwards, never from `path`. With
        `expected_sha256`, bytes with another digest are refused (ChecksumMismatch) and
        nothing is stored."""
        return self.put_file(key, path, expected_sha256=expected_sha256)

    @abc.abstractmethod
    def get_file(self, key: str, dest: str | Path) -> None:
        """Copy the object to `dest`."""

    @abc.abstractmethod
    def open_read(self, key: str) -> BinaryIO: ...

    @abc.abstractmethod
    def stat(self, key: str) -> StoredObject | None:
        """Size and sha256 of the object, or None when it does not exist."""

    @abc.abstractmethod
    def exists(self, key: str) -> bool: ...

    @abc.abstractmethod
    def delete(self, key: str) -> None: ...

    @abc.abstractmethod
    def check(self) -> None:
        """Raise StorageError with one line naming the setting to fix if the store is unusable."""


# Optional capabilities. A store declares one by deriving from it; callers ask
# `isinstance(store, Presigning)` instead of probing for attributes.


class Presigning(abc.ABC):
    """Hands out time-limited URLs that fetch an object without the store's credentials."""

    @abc.abstractmethod
    def presigned_url(self, key: str, expires_seconds: int = 900) -> str: ...


def presign_seconds(longest: int, token_expires_at: datetime | None) -> int:
    """How long a presigned URL handed to a token may live: `longest` (FARM_PRESIGN_SECONDS),
    and never past the token's expiry (at least 1 s: a token past it was refused already). A
    URL is a bearer credential of its own: revoking the token does not recall it, so a short
    `longest` bounds what a leaked URL or a revoked token can still fetch."""
    if token_expires_at is None:
        return longest
    left = math.floor((token_expires_at - datetime.now(UTC)).total_seconds())
    return max(1, min(longest, left))


class LocalPaths(abc.ABC):
    """Objects are files on this host's disk, which readers may open (or link) in place."""

    @abc.abstractmethod
    def local_path(self, key: str) -> Path:
        """The object's own file (read it, never write it)."""

    def copied_from(self, key: str) -> tuple[Path, FileVersion] | None:
        """A file elsewhere that this process copied into `key` and reads instead, with the
        version it had then (`LocalStore.prestage`); None for most objects."""
        return None


class AbortsStaleUploads(abc.ABC):
    """A dead writer leaves its write unfinished (S3: a multipart upload; the local folder: a
    partial file); the reconciler aborts them."""

    @abc.abstractmethod
    def abort_stale_uploads(self, older_than: timedelta) -> list[str]:
        """Abort unfinished writes idle (nothing received) for `older_than`; returns what they
        were (S3: their keys; the local folder: the partial files' paths)."""


class ListsObjects(abc.ABC):
    """Lists the objects under a key prefix, with when each was written (`farm gc` finds the
    model files no job names)."""

    @abc.abstractmethod
    def list_objects(self, prefix: str) -> Iterator[tuple[str, int, datetime]]:
        """(key, size, last written) of each whole object under `prefix` (e.g. ``models/``)."""


def _local(url: str, settings: Settings | None) -> BlobStore:
    from farm.server.storage.local import LocalStore  # imports this module

    return LocalStore(url.removeprefix("file://"))


def _s3(url: str, settings: Settings | None) -> BlobStore:
    from farm.server.storage.s3 import S3Settings, S3Store  # boto3: only for an s3:// store

    options = {}
    if settings is not None:
        options = {
            "endpoint_url": settings.s3_endpoint_url,
            "region": settings.s3_region,
            "access_key_id": settings.s3_access_key_id,
            "secret_access_key": settings.s3_secret_access_key,
            "checksums": settings.s3_checksums,
        }
    return S3Store(S3Settings.from_url(url, **options))


_SCHEMES = {"file": _local, "s3": _s3}


def scheme_of(url: str) -> str:
    """A storage URL's scheme: ``file`` for a bare path."""
    return url.split("://", 1)[0] if "://" in url else "file"


def open_store(url: str, settings: Settings | None = None) -> BlobStore:
    """`file:///path` or a bare path → LocalStore, `s3://bucket/prefix` → S3Store."""
    scheme = scheme_of(url)
    if scheme not in _SCHEMES:
        raise StorageError(
            f"unknown storage URL scheme {scheme!r} in {url!r}; known: {', '.join(_SCHEMES)}"
        )
    return _SCHEMES[scheme](url, settings)
