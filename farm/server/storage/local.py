"""A folder as blob store, for the embedded farm on one machine.

Note: for one machine only; several hosts need S3 (`farm.storage.s3`). Objects are written to a
temporary file in the same folder, flushed, then renamed into place, so a reader never sees a
half-written object and a crash leaves at most a `.partial` file behind.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import BinaryIO

from farm.core.hashing import sha256_file
from farm.server.storage import (
    BlobStore,
    ListsObjects,
    LocalPaths,
    ObjectWriter,
    StorageError,
    StoredObject,
    check_key,
)

CHUNK_BYTES = 1 << 20


class LocalStore(BlobStore, LocalPaths, ListsObjects):
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).resolve()

    def _path(self, key: str) -> Path:
        path = (self.root / check_key(key)).resolve()
        if not path.is_relative_to(self.root):
            raise ValueError(f"storage key {key!r} escapes the store")
        return path

    def writer(self, key: str, expected_sha256: str | None = None) -> ObjectWriter:
        return _LocalWriter(self._path(key), key, expected_sha256)

    def get_file(self, key: str, dest: str | Path) -> None:
        with self.open_read(key) as source, open(dest, "wb") as sink:
            shutil.copyfileobj(source, sink, CHUNK_BYTES)

    def open_read(self, key: str) -> BinaryIO:
        return open(self._path(key), "rb")

    def stat(self, key: str) -> StoredObject | None:
        path = self._path(key)
        if not path.is_file():
            return None
        return StoredObject(key, path.stat().st_size, sha256_file(path))

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def delete(self, key: str) -> None:
        try:
            self._path(key).unlink(missing_ok=True)
        except OSError as error:
            raise StorageError(f"cannot delete {key} from {self.root}: {error}") from error

    def local_path(self, key: str) -> Path:
        return self._path(key)

    def list_objects(self, prefix: str) -> Iterator[tuple[str, int, datetime]]:
        for path in sorted(self._path(prefix.rstrip("/")).glob("*")):
            if path.is_file() and not path.name.startswith("."):  # not a writer's .partial
                info = path.stat()
                key = path.relative_to(self.root).as_posix()
                yield key, info.st_size, datetime.fromtimestamp(info.st_mtime, UTC)

    def check(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise StorageError(
                f"cannot use {self.root} as store (FARM_STORAGE_URL): {error}"
            ) from error


class _LocalWriter(ObjectWriter):
    """Writes a temporary file beside the target, flushed to disk, renamed into place."""

    def __init__(self, target: Path, key: str, expected_sha256: str | None) -> None:
        super().__init__(key, expected_sha256)
        self.target = target
        target.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=target.parent, prefix=".", suffix=".partial")
        self.temporary = Path(temporary)
        self.sink = os.fdopen(handle, "wb")

    def _write(self, data: bytes) -> None:
        self.sink.write(data)

    def _commit(self, sha256: str) -> StoredObject:
        self.sink.flush()
        os.fsync(self.sink.fileno())
        self.sink.close()
        os.replace(self.temporary, self.target)
        return StoredObject(self.key, self.size, sha256)

    def _discard(self) -> None:
        self.sink.close()
        self.temporary.unlink(missing_ok=True)
