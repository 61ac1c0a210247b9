"""A folder as blob store, for the embedded farm on one machine.

Note: for one machine only; several hosts need S3 (`farm.storage.s3`). Objects are written to a
temporary file in the same folder, flushed, then given its name (a hard link, then the
temporary name removed), so a reader never sees a half-written object and a crash leaves at
most a `.partial` file behind. Objects are written once, as in S3 (`If-None-Match: *`): a
name that holds an object already keeps it, and other bytes for it are a ChecksumMismatch
(`_place`), so a row never names bytes that replaced the ones it recorded.

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
  flushed, and renamed into place. A blob of another user's (the compile user's) is copied and
  the copy hashed, in one pipelined pass (`_copy_hashed`).

The embedded `farm submit` starts that copy early, on a thread: while a new file is hashed,
before its digest names it (`prestage_unnamed`), or right after (`prestage`), so the kernel
copies and flushes it while the command hashes, imports OpenVINO, checks the model and opens
the database; `put_version` then finds the copy made, checks the versions as above and renames
it into place. A copy nobody took (a hit, an error) is deleted (`discard_prestaged`). Issue 30,
item 3; bench/README.md "submit_overhead".

When the job's compile child can read the user's file where it is (`sandbox.readable_in_place`)
the copy is *uncached*: written with direct I/O, around the page cache (`_copy_uncached`). The
user's file is in memory already (it was just hashed); a second 512 MB of page cache for the
copy, which this command never reads, was the slowest part of the copy on a VM. The compile
then reads the user's file (`copied_from` tells the runner where it was, and at which version;
the sandbox checks that version before and after the compile).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import logging
import mmap
import os
import shutil
import stat
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import BinaryIO

from farm.core.emptied import pwrite_all
from farm.core.errors import AlreadyStored
from farm.core.filecache import same_file
from farm.core.hashing import sha256_file, sha256_stream
from farm.core.identity import FileVersion, version_now, version_of
from farm.server.storage import (
    AbortsStaleUploads,
    BlobStore,
    ListsObjects,
    LocalPaths,
    ObjectWriter,
    StorageError,
    StoredObject,
    check_digest,
    check_key,
)

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20
COPY_PIECE_BYTES = 64 << 20
"""How much of a file `_copy` copies before it starts the disk writing it."""


class LocalStore(BlobStore, LocalPaths, ListsObjects, AbortsStaleUploads):
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).resolve()

    def _path(self, key: str) -> Path:
        path = (self.root / check_key(key)).resolve()
        if not path.is_relative_to(self.root):
            raise ValueError(f"storage key {key!r} escapes the store")
        return path

    def writer(self, key: str, expected_sha256: str | None = None) -> ObjectWriter:
        return _LocalWriter(self._path(key), key, expected_sha256)

    def prestage(
        self, key: str, path: str | Path, version: FileVersion, *, uncached: bool = False
    ) -> None:
        """Start copying `path` (at `version`) towards `key` on a thread, for the
        `put_version` that follows, or give that name to the copy `prestage_unnamed` started;
        nothing if the object is stored (a copy started is then stopped). `uncached`: around
        the page cache, for a file this process reads where it is (`copied_from`)."""
        target = self._path(key)
        staged = _PRESTAGED.pop(str(path), None)
        if target.is_file():
            if staged is not None:
                staged.discard()
            return
        if staged is None or not staged.name(target):
            if staged is not None:
                staged.discard()
            target.parent.mkdir(parents=True, exist_ok=True)
            staged = _Prestaged(Path(path), target.parent, version, target, uncached)
        _PRESTAGED[str(path)] = staged

    def prestage_unnamed(
        self, folder: str, path: str | Path, version: FileVersion, *, uncached: bool = False
    ) -> None:
        """Start copying `path` (at `version`) into `folder` before its key is known: while
        the file is hashed. `prestage` names the copy."""
        if str(path) not in _PRESTAGED:
            directory = self._path(folder)
            directory.mkdir(parents=True, exist_ok=True)
            _PRESTAGED[str(path)] = _Prestaged(Path(path), directory, version, uncached=uncached)

    def copied_from(self, key: str) -> tuple[Path, FileVersion] | None:
        """The file this process copied into `key` around the page cache (`prestage`,
        uncached), and the version it was copied at: the same bytes, in memory, while that
        file keeps that version (its reader checks)."""
        return _COPIED_FROM.get(self._path(key))

    def put_version(
        self, key: str, path: str | Path, sha256: str, version: FileVersion
    ) -> StoredObject:
        target = self._path(key)
        staged = _PRESTAGED.pop(str(path), None)
        if staged is not None:
            stored = staged.take(target, version, sha256)
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
            _place(Path(temporary), target, sha256)
        finally:
            Path(temporary).unlink(missing_ok=True)
        return StoredObject(key, size, sha256)

    def adopt_ahead(
        self, folder: str, path: str | Path, stop: threading.Event | None = None
    ) -> CopiedAhead | None:
        """Copy the file `path` (a blob a compile child wrote, given up) into `folder` of the
        store, and hash the copy, before its key is known: on the caller's thread, while the
        command goes on (the embedded `farm submit`, as its compile child given its request
        ahead ends). The copy is the caller's to `claim` for the file once it has taken it
        (moved it out of the child's box), after which `adopt_file` of that file names the
        copy instead of making its own; or to `discard`. `stop`, once set, ends the copy.
        Nothing of the file is punched out: an `adopt_file` without the copy copies it whole.
        None: nothing copied (not a regular file with one name, a file written as it was
        copied, stopped)."""
        copy = CopiedAhead(self._path(folder))
        _COPIED_AHEAD.append(copy)
        if not copy.copy(Path(path), stop):
            copy.discard()
            return None
        return copy

    def adopt_file(
        self, key: str, path: str | Path, expected_sha256: str | None = None
    ) -> StoredObject:
        target = self._path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        ahead = _claimed_copy(Path(path), target)
        if ahead is not None:
            if ahead.temporary.exists():
                return ahead.place(key, target, expected_sha256)
            ahead.discard()  # swept as a dead writer's (abort_stale_uploads): copied again
        descriptor = _open_given_up(path)
        temporary = _partial_name(target)
        try:
            info = os.fstat(descriptor)
            if not stat.S_ISREG(info.st_mode):
                raise StorageError(f"{path} is not a regular file; not stored")
            # A file another user (the compile user) owns could still be written by a process
            # of theirs holding it open; one with a second name, through that name: copied,
            # and the copy hashed, never the file.
            if info.st_uid == os.geteuid() and info.st_nlink == 1 and _moved(path, temporary):
                if not same_file(descriptor, temporary):  # `path` named another file by then
                    raise StorageError(f"{path} changed while it was stored; not stored")
                return self._commit_own(key, temporary, target, expected_sha256)
            with open(temporary, "x+b") as sink:  # read too: the copy is hashed
                os.fchmod(sink.fileno(), 0o600)
                # No other name may see the file given up emptied as it is copied.
                release = info.st_nlink == 1 and _writable(descriptor)
                sha256 = _copy_hashed(descriptor, sink.fileno(), info.st_size, release)
                check_digest(key, sha256, expected_sha256)
                os.fsync(sink.fileno())
            _place(temporary, target, sha256)
        finally:
            os.close(descriptor)
            temporary.unlink(missing_ok=True)
        return StoredObject(key, info.st_size, sha256)

    def _commit_own(
        self, key: str, temporary: Path, target: Path, expected_sha256: str | None
    ) -> StoredObject:
        """Hash, flush and put into place a partial file no one else can write."""
        try:
            with open(temporary, "rb", buffering=0) as partial:
                _start_writeback(partial.fileno())  # the disk writes while we hash
                sha256 = sha256_stream(partial)
                check_digest(key, sha256, expected_sha256)
                os.fchmod(partial.fileno(), 0o600)
                os.fsync(partial.fileno())
                size = os.fstat(partial.fileno()).st_size
            _place(temporary, target, sha256)
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

    def abort_stale_uploads(self, older_than: timedelta) -> list[str]:
        """Delete the partial files of writers that died (an upload, a model's copy, a blob
        copied ahead: a `.partial` beside its object, which a process killed outright, or a
        machine that stopped, leaves behind): those neither written nor renamed (mtime and
        ctime) for `older_than`, as S3's multipart uploads idle that long are aborted. Returns
        their paths in the store. It reads every folder of the store, so it does so at most
        once in half of `older_than` (the reconciler calls it far more often); a file it
        cannot delete is logged and left."""
        now = time.time()
        marker = self.root / SWEPT_MARKER
        with contextlib.suppress(FileNotFoundError):
            if now - marker.stat().st_mtime < older_than.total_seconds() / 2:
                return []
        with contextlib.suppress(FileNotFoundError):
            marker.touch()
        cutoff = now - older_than.total_seconds()
        removed = []
        for partial in _partial_files(self.root):
            try:
                info = partial.lstat()
                if stat.S_ISREG(info.st_mode) and max(info.st_mtime, info.st_ctime) < cutoff:
                    partial.unlink()
                    removed.append(partial.relative_to(self.root).as_posix())
            except FileNotFoundError:
                continue
            except OSError as error:
                log.warning("left %s, a partial file it could not delete: %s", partial, error)
        return sorted(removed)

    def check(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise StorageError(
                f"cannot use {self.root} as store (FARM_STORAGE_URL): {error}"
            ) from error


class _Prestaged:
    """A model file being copied into the store on a thread (`LocalStore.prestage`), towards
    `target` (None: not known yet, `prestage_unnamed`)."""

    def __init__(
        self,
        source: Path,
        folder: Path,
        version: FileVersion,
        target: Path | None = None,
        uncached: bool = False,
    ) -> None:
        self.source, self.version, self.target = source, version, target
        self.uncached = uncached
        self.temporary = folder / f".{uuid.uuid4().hex}.partial"
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
                size = None
                if self.uncached:
                    size = _copy_uncached(source.fileno(), sink.fileno(), self.temporary, self.stop)
                if size is None:
                    size = _copy(source.fileno(), sink.fileno(), self.stop)
                if self.stop.is_set():
                    return
                os.fsync(sink.fileno())
                self.after = version_of(os.fstat(source.fileno()))
                self.size = size
        except Exception:
            self.size = None  # put_version copies the file itself

    def name(self, target: Path) -> bool:
        """Make `target` this copy's place; False where it cannot be renamed there."""
        if self.target is None and target.parent == self.temporary.parent:
            self.target = target
        return self.target == target

    def take(self, target: Path, version: FileVersion, sha256: str) -> int | None:
        """Put the finished copy at `target`, its place, if the source kept `version` (whose
        bytes have digest `sha256`) throughout; its size, or None (the caller copies again)."""
        self.thread.join()
        try:
            if self.size is None or self.target != target:
                return None
            # The source as it is now too: a file written after the copy was hashed anew,
            # and its digest is not this copy's.
            if not self.version == self.after == version == version_now(self.source):
                return None
            if not self.temporary.exists():  # swept as a dead writer's (abort_stale_uploads)
                return None
            _place(self.temporary, target, sha256)
            if self.uncached:
                _COPIED_FROM[target] = (self.source, self.version)
            return self.size
        finally:
            self.temporary.unlink(missing_ok=True)

    def discard(self) -> None:
        self.stop.set()
        try:
            self.thread.join()
        finally:  # a second Ctrl-C while it waits leaves no model-sized file in the store
            self.temporary.unlink(missing_ok=True)


_PRESTAGED: dict[str, _Prestaged] = {}
"""This process's model copies started by `LocalStore.prestage`, by the source's path."""
_COPIED_FROM: dict[Path, tuple[Path, FileVersion]] = {}
"""The uncached copies this process stored, by their place: where from, at which version."""


SWEPT_MARKER = ".partials-swept"
"""In the store's root: when `abort_stale_uploads` last read the store."""


def _partial_files(folder: Path) -> Iterator[Path]:
    """The writers' partial files (``.<name>.partial``) under `folder`, one entry at a time,
    never through a link."""
    try:
        entries = os.scandir(folder)
    except (FileNotFoundError, NotADirectoryError):
        return
    with entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                yield from _partial_files(Path(entry.path))
            elif entry.name.startswith(".") and entry.name.endswith(".partial"):
                yield Path(entry.path)


def discard_prestaged() -> None:
    """Stop and delete the copies `prestage` started that no `put_version` took, and those
    `adopt_ahead` made that no `adopt_file` took."""
    while _PRESTAGED:
        _PRESTAGED.popitem()[1].discard()
    for copy in list(_COPIED_AHEAD):
        with contextlib.suppress(OSError):  # the others still go
            copy.discard()


class CopiedAhead:
    """A file given up, copied into the store and hashed before its key is known
    (`LocalStore.adopt_ahead`)."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.temporary = folder / f".{uuid.uuid4().hex}.partial"
        self.of: tuple[int, int, int, int] | None = None
        """The file copied, as it was throughout the copy: device, inode, size, mtime."""
        self.claimed: Path | None = None
        self.claimed_as: tuple[int, int, int, int] | None = None
        """The file claimed, as it was then (a copy of it in the box, or it, moved)."""
        self.sha256 = ""
        self.size = 0
        self.discarded = False

    def copy(self, path: Path, stop: threading.Event | None) -> bool:
        """Copy and hash the file at `path`; whether it was copied, unchanged throughout."""
        try:
            descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return False
        try:
            before = os.fstat(descriptor)
            if not stat.S_ISREG(before.st_mode) or before.st_nlink != 1:
                return False
            with open(self.temporary, "x+b") as sink:
                os.fchmod(sink.fileno(), 0o600)
                sha256 = _copy_hashed(descriptor, sink.fileno(), before.st_size, False, stop)
                after = os.fstat(descriptor)
                if version_of(after) != version_of(before):  # written meanwhile (the ctime too)
                    return False
                os.fsync(sink.fileno())
        except (OSError, StorageError):
            return False
        finally:
            os.close(descriptor)
        self.of, self.sha256, self.size = _copied_as(before), sha256, before.st_size
        return True

    def matches(self, path: Path) -> bool:
        """Whether the file at `path` is the one copied, unchanged since (device, inode, size,
        mtime: a file the compile user still wrote would differ); if not, the copy is
        discarded."""
        if not self.discarded and _stat_of(path, self.of):
            return True
        self.discard()
        return False

    def claim(self, path: Path) -> bool:
        """Make this the copy of the file now at `path`, for its `adopt_file`: the file that
        `matches` found, since moved or copied there (its size this copy's); else the copy
        is discarded."""
        try:
            now = os.lstat(path)
        except OSError:
            now = None
        if self.discarded or now is None or not _a_file_of(now, self.size):
            self.discard()
            return False
        self.claimed, self.claimed_as = path, _copied_as(now)
        return True

    def place(self, key: str, target: Path, expected_sha256: str | None) -> StoredObject:
        """Name the copy `key` (at `target`, in the copy's folder)."""
        try:
            check_digest(key, self.sha256, expected_sha256)
            _place(self.temporary, target, self.sha256)
        finally:
            self.discard()
        return StoredObject(key, self.size, self.sha256)

    def discard(self) -> None:
        """Delete the copy, not taken (or taken: `place` has linked it)."""
        self.discarded = True
        self.temporary.unlink(missing_ok=True)
        with contextlib.suppress(ValueError):
            _COPIED_AHEAD.remove(self)


def _copied_as(info: os.stat_result) -> tuple[int, int, int, int]:
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)


def _a_file_of(info: os.stat_result, size: int) -> bool:
    return stat.S_ISREG(info.st_mode) and info.st_size == size


def _stat_of(path: Path, expected: tuple[int, int, int, int] | None) -> bool:
    """Whether `path` is a regular file whose device, inode, size and mtime are `expected`."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(info.st_mode) and _copied_as(info) == expected


_COPIED_AHEAD: list[CopiedAhead] = []
"""This process's copies made by `LocalStore.adopt_ahead` not yet placed or discarded."""


def _claimed_copy(path: Path, target: Path) -> CopiedAhead | None:
    """The copy made ahead and claimed for the file at `path`, if that file is still the one
    claimed and the copy lies where `target` goes (one store, one folder); None otherwise (a
    copy claimed but not taken is discarded)."""
    for copy in list(_COPIED_AHEAD):
        if copy.claimed == path:
            if copy.temporary.parent == target.parent and _stat_of(path, copy.claimed_as):
                return copy
            copy.discard()
    return None


def _place(temporary: Path, target: Path, sha256: str) -> None:
    """Give the finished file `temporary` (bytes of digest `sha256`) its place `target`,
    unless an object is stored there already: objects are written once, as S3's
    `If-None-Match: *` keeps them, so a row that recorded an object's digest never names
    bytes put there after it. The same bytes there already are fine; other bytes are a
    ChecksumMismatch. `temporary` is left for the caller to remove.

    A hard link names the file only where no object is there; a file system without hard
    links (FAT, exFAT, some shared folders and FUSE mounts) gets a check, then a rename: this
    store is one machine's, and a rename over an object written in between is all it risks."""
    try:
        os.link(temporary, target)
    except FileExistsError:
        _check_stored(target, sha256)
    except OSError as error:
        if error.errno not in NO_HARD_LINKS:
            raise
        if target.exists():
            _check_stored(target, sha256)
        else:
            os.replace(temporary, target)
    _sync_folder(target.parent)  # the name on the disk too, before a row records it


NO_HARD_LINKS = (errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK)
"""What `link` answers on a file system that makes no (more) hard links."""


def _check_stored(target: Path, sha256: str) -> None:
    found = sha256_file(target)
    if found != sha256:
        raise AlreadyStored(
            f"{target.name} is already stored with sha256 {found}, not {sha256}; objects are "
            "write-once, so this is a conflict to investigate"
        )


def _sync_folder(folder: Path) -> None:
    """Flush a folder's entries: a file flushed and then named can lose its name in a crash
    until the folder is flushed too. File systems that cannot flush a folder (CIFS, some FUSE
    mounts) say so, and are left as they are: the object is stored either way."""
    descriptor = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(descriptor)
    except OSError as error:
        if error.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
            raise
    finally:
        os.close(descriptor)


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


def _start_writeback(descriptor: int, offset: int = 0, count: int = 0) -> None:
    """Ask Linux to start writing the file's dirty pages (`count` bytes from `offset`; 0: to
    the end) now, without waiting for them (sync_file_range, SYNC_FILE_RANGE_WRITE), so the
    fsync that follows finds them written; elsewhere a no-op."""
    if _LIBC is not None and hasattr(_LIBC, "sync_file_range"):
        _LIBC.sync_file_range(descriptor, offset, count, _SYNC_FILE_RANGE_WRITE)


def _punch_out(descriptor: int, offset: int, count: int) -> None:
    """Free a range of a file given up (fallocate PUNCH_HOLE, the size kept): its pages are
    dropped from memory unwritten, to be handed out again. Best effort."""
    if _LIBC is not None and hasattr(_LIBC, "fallocate"):
        _LIBC.fallocate(descriptor, _PUNCH_HOLE | _KEEP_SIZE, offset, count)


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    with contextlib.suppress(AttributeError):
        libc.sync_file_range.argtypes = (
            ctypes.c_int,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_uint,
        )
    with contextlib.suppress(AttributeError):
        libc.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
    return libc


_LIBC = _libc()
_SYNC_FILE_RANGE_WRITE = 2
_KEEP_SIZE, _PUNCH_HOLE = 0x01, 0x02
HASHED_COPY_CHUNK = 32 << 20
"""What `_copy_hashed` copies while it hashes the chunk before (measured: 8-64 MiB alike)."""


def _copy_hashed(
    source: int,
    sink: int,
    size: int,
    release_source: bool,
    stop: threading.Event | None = None,
) -> str:
    """Copy the first `size` bytes of `source` into the empty `sink` (open to read and write)
    and return the sha256 of
    the copy, hashed as it is made: a thread copies each next chunk (in the kernel) while this
    one hashes the last through a read-only map of `sink` (the bytes stored, which no one else
    can write) and starts its writeback. `release_source`: each chunk copied is punched out of
    `source`, whose pages then serve the copy's (new page cache was the slow half of the copy
    on a VM, 0.15-0.9 s for 512 MB; 0.36 s in all for copy and hash with it, bench/README.md
    "submit_overhead"). A source that ends early fails the copy; `stop`, once set, fails it
    at its next chunk."""
    digest = hashlib.sha256()
    if size == 0:
        return digest.hexdigest()
    os.ftruncate(sink, size)

    def copy(offset: int) -> int:
        count = min(HASHED_COPY_CHUNK, size - offset)
        _copy_range(source, sink, offset, count)
        if release_source:
            _punch_out(source, offset, count)
        return count

    with (
        mmap.mmap(sink, size, prot=mmap.PROT_READ) as mapped,
        ThreadPoolExecutor(1, thread_name_prefix="farm-copy") as copier,
    ):
        view = memoryview(mapped)
        try:
            offset, copying = 0, copier.submit(copy, 0)
            while offset < size:
                count = copying.result()
                if stop is not None and stop.is_set():
                    raise StorageError("the copy into the store was stopped")
                if offset + count < size:
                    copying = copier.submit(copy, offset + count)
                digest.update(view[offset : offset + count])
                mapped.madvise(mmap.MADV_DONTNEED, offset, count)  # unmapped; still cached
                _start_writeback(sink, offset, count)
                offset += count
        finally:
            view.release()
    return digest.hexdigest()


def _copy_range(source: int, sink: int, offset: int, count: int) -> None:
    """Copy `count` bytes at `offset` of `source` to the same place in `sink`."""
    end = offset + count
    while offset < end:
        try:
            copied = os.copy_file_range(source, sink, end - offset, offset, offset)
        except OSError as error:
            # No copy_file_range here (old kernel, another file system, a FUSE mount).
            if error.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                raise
            data = os.pread(source, min(end - offset, CHUNK_BYTES), offset)
            copied = os.pwrite(sink, data, offset) if data else 0
        if copied == 0:
            raise StorageError("the file ended while it was being copied into the store")
        offset += copied


def _open_given_up(path: str | Path) -> int:
    """The file at `path` (never through a link), opened for writing too where this process
    may write it, so that a file given up can be punched out as it is copied; read-only
    elsewhere (a worker that is not root, copying the compile user's blob)."""
    # O_NONBLOCK: a FIFO in the file's place opens at once (and is refused as not a regular
    # file) instead of waiting for a writer.
    try:
        return os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as error:
        if error.errno not in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ETXTBSY, errno.EISDIR):
            raise
    return os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)


def _writable(descriptor: int) -> bool:
    return fcntl.fcntl(descriptor, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDWR


def _copy(source: int, sink: int, stop: threading.Event | None = None) -> int:
    """Copy the whole file `source` to `sink` in the kernel, 64 MiB at a time, the disk
    writing each piece as the next is copied (the fsync that follows then waits for the last
    piece, not the whole file); returns the bytes copied. `stop`: set, the copy ends early."""
    copied = 0
    try:
        while count := os.copy_file_range(source, sink, COPY_PIECE_BYTES):
            _start_writeback(sink, copied, count)
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
            while (chunk := reader.read(CHUNK_BYTES)) and not (stop and stop.is_set()):
                out.write(chunk)
        copied = os.fstat(sink).st_size
    return copied


DIRECT_IO_BLOCK = 4096
"""What direct I/O needs sizes, offsets and buffer addresses to be multiples of (the largest
logical block size of common disks; a multiple of the smaller ones)."""
UNCACHED_PIECE_BYTES = 8 << 20
"""The buffer `_copy_uncached` reads into and writes from: one, reused (a bigger one is more
new memory to touch, for no faster a copy: 0.17 s for 512 MB either way here)."""


def _copy_uncached(
    source: int, sink: int, sink_path: Path, stop: threading.Event | None = None
) -> int | None:
    """Copy the whole file `source` into the empty file `sink` (open, at `sink_path`) with
    direct I/O (O_DIRECT): the copy's bytes go to the disk without a page of cache, the last
    partial block through `sink`. Returns the bytes copied, or None where the file system
    takes no direct I/O (tmpfs, some FUSE mounts): the caller copies the whole file through
    the cache instead. `stop`: set, the copy ends early. A source that ends early fails it."""
    try:
        direct = os.open(sink_path, os.O_WRONLY | os.O_DIRECT | os.O_CLOEXEC)
    except OSError as error:
        if error.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return None
        raise
    copied = 0
    try:
        size = os.fstat(source).st_size
        whole_blocks = size - size % DIRECT_IO_BLOCK
        with mmap.mmap(-1, UNCACHED_PIECE_BYTES) as buffer:  # page-aligned, as O_DIRECT needs
            while copied < whole_blocks:
                count = min(UNCACHED_PIECE_BYTES, whole_blocks - copied)
                with memoryview(buffer)[:count] as piece:  # released before the map closes
                    if os.preadv(source, [piece], copied) != count:
                        raise StorageError("the file ended while it was copied into the store")
                    try:
                        written = os.pwrite(direct, piece, copied)
                    except OSError as error:  # direct writes refused after all
                        if error.errno in (errno.EINVAL, errno.EOPNOTSUPP):
                            return None
                        raise
                if written != count:
                    raise StorageError(f"the store's disk took {written} of {count} bytes")
                copied += count
                if stop is not None and stop.is_set():
                    return copied
    finally:
        os.close(direct)
    tail = os.pread(source, size - copied, copied)
    if len(tail) != size - copied:
        raise StorageError("the file ended while it was copied into the store")
    if tail:
        pwrite_all(sink, tail, copied)
    return size


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
        try:
            _place(self.temporary, self.target, sha256)
        finally:
            self.temporary.unlink(missing_ok=True)
        return StoredObject(self.key, self.size, sha256)

    def _discard(self) -> None:
        self.sink.close()
        self.temporary.unlink(missing_ok=True)
