"""A folder as blob store, for the embedded farm on one machine.

Note: for one machine only; several hosts need S3 (`farm.storage.s3`). Objects are written to a
temporary file in the same folder, flushed, then renamed into place, so a reader never sees a
half-written object and a crash leaves at most a `.partial` file behind.

The embedded `farm submit` puts a model into this store right after hashing it, and its blob
right after OpenVINO wrote it; neither is read twice (`put_version`, `adopt_file`):

- A model file is *copied*, by the kernel (`copy_file_range`: a reflink on file systems that
  share extents, such as XFS and Btrfs; an in-kernel copy elsewhere), never hard-linked: a link
  shares the user's inode, so saving the model again in place (`ov.save_model` truncates and
  rewrites the same file) would change the stored object under its digest. Instead of hashing
  the copy, it checks that the source kept the version (inode, size, mtime, ctime) it had
  before it was hashed: a write during the copy changes it, and then the copy is hashed after
  all (and refused if its bytes changed).
- A blob is *moved*: the file is the farm's own, hashed once (the row records its sha256),
  flushed, and renamed into place.

The embedded `farm submit` starts that copy early (`prestage`, on a thread, right after the
model was hashed), so the kernel copies and flushes it while the command imports OpenVINO,
checks the model and opens the database; `put_version` then finds the copy made, checks the
versions as above and renames it into place. A copy nobody took (a hit, an error) is deleted
(`discard_prestaged`). Issue 30, item 3; bench/README.md "submit_overhead".
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import stat
import tempfile
import threading
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import BinaryIO

from farm.core.hashing import sha256_file, sha256_stream
from farm.core.identity import FileVersion, version_of
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

    def prestage(self, key: str, path: str | Path, version: FileVersion) -> None:
        """Start copying `path` (at `version`) towards `key` on a thread, for the
        `put_version` that follows; nothing if the object is stored or being copied."""
        target = self._path(key)
        entry = (target, str(path))
        if entry in _PRESTAGED or target.is_file():
            return
        target.parent.mkdir(parents=True, exist_ok=True)
        _PRESTAGED[entry] = _Prestaged(Path(path), target, version)

    def put_version(
        self, key: str, path: str | Path, sha256: str, version: FileVersion
    ) -> StoredObject:
        target = self._path(key)
        staged = _PRESTAGED.pop((target, str(path)), None)
        if staged is not None:
            stored = staged.take(version)
            if stored is not None:
                return StoredObject(key, stored, sha256)
        target.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=target.parent, prefix=".", suffix=".partial")
        try:
            with open(path, "rb") as source, os.fdopen(handle, "wb") as sink:
                info = os.fstat(source.fileno())
                before = version_of(info)
                # Readable by whom the user's file is (a compile user can then link it into
                # its box instead of copying it); writable by no one else.
                os.fchmod(sink.fileno(), stat.S_IMODE(info.st_mode) & 0o444 | 0o600)
                size = _copy(source.fileno(), sink.fileno())
                after = version_of(os.fstat(source.fileno()))
                if before == after == version:
                    os.fsync(sink.fileno())
            if not before == after == version:  # written since it was hashed: read it again
                os.unlink(temporary)
                return self.put_file(key, path, expected_sha256=sha256)
            os.replace(temporary, target)
        finally:
            Path(temporary).unlink(missing_ok=True)
        return StoredObject(key, size, sha256)

    def adopt_file(self, key: str, path: str | Path) -> StoredObject:
        target = self._path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        temporary = _partial_name(target)
        try:
            info = os.fstat(descriptor)
            if not stat.S_ISREG(info.st_mode):
                raise StorageError(f"{path} is not a regular file; not stored")
            # A file another user (the compile user) owns could still be written by a process
            # of theirs holding it open; one with a second name, through that name: copied.
            if not (info.st_uid == os.geteuid() and info.st_nlink == 1 and _moved(path, temporary)):
                with open(temporary, "xb") as sink:
                    _copy(descriptor, sink.fileno())
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise
        finally:
            os.close(descriptor)
        return self._commit_own(key, temporary, target)

    def _commit_own(self, key: str, temporary: Path, target: Path) -> StoredObject:
        """Hash, flush and rename into place a partial file no one else can write."""
        try:
            with open(temporary, "rb", buffering=0) as partial:
                _start_writeback(partial.fileno())  # the disk writes while we hash
                sha256 = sha256_stream(partial)
                os.fchmod(partial.fileno(), 0o600)
                os.fsync(partial.fileno())
                size = os.fstat(partial.fileno()).st_size
            os.replace(temporary, target)
        finally:
            temporary.unlink(missing_ok=True)
        return StoredObject(key, size, sha256)

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


class _Prestaged:
    """A model file being copied into the store on a thread (`LocalStore.prestage`)."""

    def __init__(self, source: Path, target: Path, version: FileVersion) -> None:
        self.source, self.target, self.version = source, target, version
        self.temporary = _partial_name(target)
        self.stop = threading.Event()
        self.size: int | None = None
        self.after: FileVersion | None = None
        self.thread = threading.Thread(target=self._copy, name="farm-prestage", daemon=True)
        self.thread.start()

    def _copy(self) -> None:
        try:
            with open(self.source, "rb") as source, open(self.temporary, "xb") as sink:
                info = os.fstat(source.fileno())
                if version_of(info) != self.version:
                    return
                os.fchmod(sink.fileno(), stat.S_IMODE(info.st_mode) & 0o444 | 0o600)
                size = _copy(source.fileno(), sink.fileno(), self.stop)
                if self.stop.is_set():
                    return
                os.fsync(sink.fileno())
                self.after = version_of(os.fstat(source.fileno()))
                self.size = size
        except Exception:
            self.size = None  # put_version copies the file itself

    def take(self, version: FileVersion) -> int | None:
        """Rename the finished copy into place if the source kept `version` throughout; its
        size, or None (the caller copies again)."""
        self.thread.join()
        try:
            if self.size is None or not self.version == self.after == version:
                return None
            os.replace(self.temporary, self.target)
            return self.size
        finally:
            self.temporary.unlink(missing_ok=True)

    def discard(self) -> None:
        self.stop.set()
        self.thread.join()
        self.temporary.unlink(missing_ok=True)


_PRESTAGED: dict[tuple[Path, str], _Prestaged] = {}
"""This process's model copies started by `LocalStore.prestage`, by (target, source)."""


def discard_prestaged() -> None:
    """Stop and delete the copies `prestage` started that no `put_version` took."""
    while _PRESTAGED:
        _PRESTAGED.popitem()[1].discard()


def _partial_name(target: Path) -> Path:
    """A fresh name for a partial file beside `target` (what `_LocalWriter` writes too)."""
    return target.with_name(f".{target.name}.{uuid.uuid4().hex}.partial")


def _moved(path: str | Path, temporary: Path) -> bool:
    """Rename `path` to `temporary`; False when they are on different file systems."""
    try:
        os.replace(path, temporary)
    except OSError as error:
        if error.errno != errno.EXDEV:
            raise
        return False
    return True


def _start_writeback(descriptor: int) -> None:
    """Ask Linux to start writing the file's dirty pages now, without waiting for them
    (sync_file_range, SYNC_FILE_RANGE_WRITE), so the fsync that follows finds them written;
    elsewhere a no-op."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        start = libc.sync_file_range
    except (OSError, AttributeError):
        return
    start.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    start(descriptor, 0, 0, _SYNC_FILE_RANGE_WRITE)


_SYNC_FILE_RANGE_WRITE = 2


def _copy(source: int, sink: int, stop: threading.Event | None = None) -> int:
    """Copy the whole file `source` to `sink` in the kernel; returns the bytes copied. `stop`:
    set, the copy ends early (at the next 64 MiB)."""
    copied = 0
    chunk = 1 << 30 if stop is None else 1 << 26
    try:
        while count := os.copy_file_range(source, sink, chunk):
            copied += count
            if stop is not None and stop.is_set():
                return copied
    except OSError as error:
        # No copy_file_range here (old kernel, another file system, a FUSE mount): read/write.
        if error.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
            raise
        os.lseek(source, 0, os.SEEK_SET)
        os.lseek(sink, 0, os.SEEK_SET)
        os.ftruncate(sink, 0)
        with open(source, "rb", closefd=False) as reader, open(sink, "wb", closefd=False) as out:
            shutil.copyfileobj(reader, out, CHUNK_BYTES)
        copied = os.fstat(sink).st_size
    return copied


def _owned_alone(info: os.stat_result) -> bool:
    return stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid() and info.st_nlink == 1


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
