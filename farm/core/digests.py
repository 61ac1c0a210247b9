"""A cache of file digests keyed by path and version (inode, size, mtime, ctime), so an
unchanged 1 GB model is not hashed again on every submit. Edge-safe: standard library only.

The ctime is what makes a hit trustworthy: a file rewritten and given its old mtime back
(`touch -d`, `rsync -t`, `cp -p`) has a new ctime, which no one can set by hand. The embedded
store relies on it: it copies a model file without hashing it again when the file still has the
version its digest was taken at."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from farm.core.hashing import sha256_file

MAX_ENTRIES = 10_000


class DigestCache:
    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.entries: dict[str, dict] = json.loads(path.read_text())
        except (OSError, ValueError):
            self.entries = {}

    def sha256(self, file: Path, progress: Callable[[int], None] | None = None) -> str:
        stat = file.stat()
        key = str(file.resolve())
        entry = self.entries.get(key)
        version = {
            "size": stat.st_size,
            "mtime_ns": stat.st_mtime_ns,
            "ctime_ns": stat.st_ctime_ns,
            "inode": stat.st_ino,
        }
        if entry and all(entry.get(field) == value for field, value in version.items()):
            if progress:
                progress(stat.st_size)
            return entry["sha256"]
        digest = sha256_file(file, progress)
        # A file still being written could change after we read it: its mtime would then
        # differ from the one we record, and the next lookup hashes it again.
        self.entries[key] = {**version, "sha256": digest}
        self._save()
        return digest

    def _save(self) -> None:
        if len(self.entries) > MAX_ENTRIES:
            self.entries = dict(list(self.entries.items())[-MAX_ENTRIES:])
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            partial = self.path.with_suffix(f".{os.getpid()}.partial")
            partial.write_text(json.dumps(self.entries))
            partial.replace(self.path)
        except OSError:
            pass  # a cache that cannot be written only costs time


def digest_cache(cache_dir: Path) -> DigestCache:
    """The digest cache `farm submit`, `farm pull MODEL` and the edge SDK share: one file under
    `FARM_CACHE_DIR`, so a model hashed by one is not hashed again by the others."""
    return DigestCache(cache_dir / "digests.json")
