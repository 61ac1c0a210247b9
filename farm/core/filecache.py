"""The edge's local blob cache: verified blobs by cache key, a size cap, LRU eviction.

Layout under the root (``FARM_CACHE_DIR/blobs``):
  ``<cache_key>.blob``      complete, verified blobs, read-only; mtime = last use (LRU)
  ``partial/<cache_key>``   a download in progress or broken off, resumed from its size

Only verified files are ever renamed into place (``os.replace``), so a reader never sees a
half-written blob. A blob in use is held open with a shared ``flock``; eviction takes an
exclusive non-blocking lock first and skips any blob it cannot lock, in this process or any
other. Standard library only (edge-safe).
"""

from __future__ import annotations

import fcntl
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

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
        self.partial_dir.mkdir(parents=True, exist_ok=True)

    def path(self, cache_key: str) -> Path:
        return self.root / f"{_checked(cache_key)}.blob"

    def partial_path(self, cache_key: str) -> Path:
        return self.partial_dir / _checked(cache_key)

    def get(self, cache_key: str) -> Path | None:
        """The cached blob for `cache_key`, marked as just used; None if not cached."""
        path = self.path(cache_key)
        try:
            os.utime(path)
        except FileNotFoundError:
            return None
        return path

    def put(self, cache_key: str, verified: Path) -> Path:
        """Move a verified file into the cache (atomically), then evict down to the cap."""
        path = self.path(cache_key)
        verified.chmod(0o444)
        os.replace(verified, path)
        os.utime(path)
        self.evict(keep=cache_key)
        return path

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
            found.append(CachedBlob(path.stem, path, stat.st_size, stat.st_mtime))
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
                total -= entry.size_bytes
                evicted.append(entry.cache_key)
        return evicted


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


def _checked(cache_key: str) -> str:
    if not _KEY.match(cache_key):
        raise CacheError(f"{cache_key!r} is not a cache key (64 hex characters)")
    return cache_key
