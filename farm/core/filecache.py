"""The edge's local blob cache: verified blobs by cache key, a size cap, LRU eviction.

Layout under the root (``FARM_CACHE_DIR/blobs``):
  ``<cache_key>.blob``      complete, verified blobs, read-only; mtime = last use (LRU) when
                            the blob has no manifest
  ``<cache_key>.manifest``  what the blob was verified against (the edge: its signed
                            manifest), bound to the very file by a stamp; mtime = last use
  ``partial/<cache_key>``   a download in progress or broken off, resumed from its size
  ``partial/<cache_key>.parts``  a download in signed parts, never resumed
  ``partial/<cache_key>.lock``   held (``flock``) by the one process downloading the blob
                            into this cache (`farm.edge.agent`); gone when it is done

Only verified files are ever renamed into place (``os.replace``), so a reader never sees a
half-written blob. The cache may sit in a folder others can write: no write follows a link
someone planted. ``partial/`` is this user's alone (0700, checked, links in it removed), every
other file is written to a new temporary name (``O_EXCL``) and renamed over the target (which
replaces a link instead of writing through it), and times and modes are set on the file
itself, never through a link (`write_atomically`).

A blob in use is held open with a shared ``flock``; eviction takes an exclusive non-blocking
lock first and skips any blob it cannot lock, in this process or any other. Standard library
only (edge-safe).

The stamp is the file's (device, inode, size, mtime, ctime) taken when it was verified. Any
change to the file through the file system changes it: a write or truncate changes mtime and
ctime, a chmod ctime, a file renamed or copied into its place has another inode, and no call
sets ctime back. So a stamp that still matches means the bytes are the ones that were hashed,
for the price of one ``stat`` instead of hashing the whole blob on every use. A blob with a
manifest is never touched after the stamp is taken: its last use goes on the manifest file.
The stamp also names the machine's boot (`boot_id`): downloads are not flushed to the disk
(that would cost them a second pass over the disk), and a file written just before a crash or
a power loss can come back its full size, stamp unchanged, with ranges of zeros. After a
restart every blob is hashed once more before its first use.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import re
import stat
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from farm.core.errors import CacheError

_KEY = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class CachedBlob:
    cache_key: str
    path: Path
    size_bytes: int
    last_used: float


class BlobCache:
    def __init__(self, root: str | Path, max_bytes: int | None = None) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.partial_dir = self.root / "partial"
        private_dir(self.partial_dir)

    def path(self, cache_key: str) -> Path:
        return self.root / f"{_checked(cache_key)}.blob"

    def manifest_path(self, cache_key: str) -> Path:
        return self.root / f"{_checked(cache_key)}.manifest"

    def partial_path(self, cache_key: str) -> Path:
        """Where the download of `cache_key` goes (resumed from its size); anything there but
        a regular file is removed first."""
        path = self.partial_dir / _checked(cache_key)
        with contextlib.suppress(FileNotFoundError):
            if not stat.S_ISREG(os.lstat(path).st_mode):
                path.unlink()
        return path

    def get(self, cache_key: str) -> Path | None:
        """The cached blob for `cache_key`, marked as just used; None if not cached."""
        path = self.path(cache_key)
        if not path.exists():
            return None
        try:  # never the blob: that would break its stamp
            os.utime(self.manifest_path(cache_key), follow_symlinks=False)
        except FileNotFoundError:
            try:
                os.utime(path, follow_symlinks=False)
            except FileNotFoundError:
                return None  # evicted meanwhile
        return path

    def put(
        self, cache_key: str, verified: Path, manifest: Mapping[str, Any] | None = None
    ) -> Path:
        """Move a verified file into the cache (atomically), then evict down to the cap.

        `manifest`: what the file was verified against (JSON-able), kept beside it and bound to
        this very file (`manifest` returns it only while the file is unchanged).
        """
        path = self.path(cache_key)
        _read_only(verified)
        if manifest is None:
            self.manifest_path(cache_key).unlink(missing_ok=True)
        os.replace(verified, path)
        os.utime(path, follow_symlinks=False)
        if manifest is not None:
            self.bind(cache_key, manifest)
        self.evict(keep=cache_key)
        return path

    def bind(self, cache_key: str, manifest: Mapping[str, Any]) -> None:
        """Keep `manifest` beside the blob as it is now: call only after verifying the file."""
        stamp = _stamp(self.path(cache_key))
        with write_atomically(self.manifest_path(cache_key), self.partial_dir) as sink:
            sink.write(json.dumps({"stamp": stamp, "manifest": dict(manifest)}).encode())

    def manifest(self, cache_key: str) -> dict[str, Any] | None:
        """The manifest kept beside the blob, if the blob file is still the very file it was
        bound to (same stamp); None when there is none, it is unreadable, or the file changed."""
        try:
            kept = json.loads(self.manifest_path(cache_key).read_bytes())
            stamp = _stamp(self.path(cache_key))
        except (OSError, ValueError):
            return None
        if not isinstance(kept, dict) or kept.get("stamp") != stamp:
            return None
        manifest = kept.get("manifest")
        return manifest if isinstance(manifest, dict) else None

    def discard(self, cache_key: str) -> None:
        """Forget the blob's manifest, so it is verified again before any use."""
        self.manifest_path(cache_key).unlink(missing_ok=True)

    def hold(self, cache_key: str) -> BinaryIO:
        """Open the blob with a shared lock: eviction skips it until the file is closed."""
        handle = open(self.path(cache_key), "rb")  # noqa: SIM115 - the caller owns it
        fcntl.flock(handle, fcntl.LOCK_SH)
        return handle

    def entries(self) -> list[CachedBlob]:
        found = []
        for path in self.root.glob("*.blob"):
            try:
                stat = path.stat()
            except FileNotFoundError:
                continue  # evicted meanwhile
            used = stat.st_mtime
            with contextlib.suppress(FileNotFoundError):
                used = path.with_suffix(".manifest").stat().st_mtime
            found.append(CachedBlob(path.stem, path, stat.st_size, used))
        return sorted(found, key=lambda entry: entry.last_used)

    def total_bytes(self) -> int:
        return sum(entry.size_bytes for entry in self.entries())

    def evict(self, keep: str | None = None) -> list[str]:
        """Remove least recently used blobs until the cache fits its cap; returns their keys.

        Note: a blob in use (held open by `hold`) is never evicted, so the cache may stay
        over its cap while it is.
        """
        if self.max_bytes is None:
            return []
        entries = self.entries()
        total = sum(entry.size_bytes for entry in entries)
        evicted = []
        for entry in entries:
            if total <= self.max_bytes:
                break
            if entry.cache_key != keep and _remove_unless_held(entry.path):
                entry.path.with_suffix(".manifest").unlink(missing_ok=True)
                total -= entry.size_bytes
                evicted.append(entry.cache_key)
        return evicted


@contextlib.contextmanager
def write_atomically(
    target: Path, work_dir: Path | None = None, mode: int = 0o600
) -> Iterator[BinaryIO]:
    """A new file to write, renamed to `target` when the block ends without an error (else
    removed). Made under a fresh name (``O_CREAT | O_EXCL``: never an existing file or a link)
    in `work_dir` (default: `target`'s folder, same file system), so a link planted at the
    target or at any name in a shared folder never redirects the write. `mode`: the file's."""
    handle, name = tempfile.mkstemp(dir=work_dir or target.parent, prefix=f".{target.name}.")
    try:
        os.fchmod(handle, mode)
        with os.fdopen(handle, "wb") as sink:
            yield sink
        os.replace(name, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)
        raise


def private_dir(path: Path) -> Path:
    """Make `path` a folder of this user's alone (0700) and check it is: not a link, owned by
    this user. A folder that was open to others loses any link planted in it."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode) or info.st_uid != os.geteuid():
        raise CacheError(
            f"{path} is a link or belongs to another user: it must be this user's own "
            "folder; give each user a FARM_CACHE_DIR of its own"
        )
    if info.st_mode & 0o077:
        path.chmod(0o700)
        for entry in path.iterdir():
            if not stat.S_ISREG(os.lstat(entry).st_mode):
                entry.unlink()
    return path


def _read_only(path: Path) -> None:
    """chmod 0444 the file itself, refusing a link (chmod would follow it)."""
    descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        os.fchmod(descriptor, 0o444)
    finally:
        os.close(descriptor)


def _remove_unless_held(path: Path) -> bool:
    try:
        with open(path, "rb") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            path.unlink()
    except BlockingIOError:
        return False  # in use
    except FileNotFoundError:
        pass  # another process evicted it
    return True


def _stamp(path: Path) -> list[int | str]:
    """What changes whenever the file does (module docstring): device, inode, size, mtime and
    ctime in nanoseconds; and this boot of the machine."""
    stat = path.stat()
    return [stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, boot_id()]


BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
"""Linux's random id of the running boot (elsewhere there is none)."""


@functools.cache
def booted_at() -> float:
    """When this boot of the machine started (seconds since the epoch; 0 where the system
    does not say): a file last written before it may have lost bytes in a crash."""
    try:
        for line in Path("/proc/stat").read_text().splitlines():
            if line.startswith("btime "):
                return float(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0.0


@functools.cache
def boot_id() -> str:
    """This boot of the machine: a file written without a flush in an earlier boot may have
    lost bytes in a crash (module docstring). "" where the system does not say."""
    try:
        return BOOT_ID.read_text().strip()
    except OSError:
        return ""


def _checked(cache_key: str) -> str:
    if not _KEY.match(cache_key):
        raise CacheError(f"{cache_key!r} is not a cache key (64 hex characters)")
    return cache_key


def same_file(descriptor: int, path: Path) -> bool:
    """Whether `path` names the file open as `descriptor` (a lock taken on a file that was
    then removed or replaced holds nothing at `path`)."""
    try:
        at_path = os.lstat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(descriptor)
    return (at_path.st_dev, at_path.st_ino) == (held.st_dev, held.st_ino)
