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
        known = self._known(str(file.resolve()), _version(stat))
        if known is not None:
            if progress:
                progress(stat.st_size)
            return known
        digest = sha256_file(file, progress)
        # A file still being written could change after we read it: its mtime would then
        # differ from the one we record, and the next lookup hashes it again.
        self._record(file, stat, digest)
        return digest

    def knows(self, file: Path) -> bool:
        """Whether `file`'s digest is here for the version it has now (no hash needed)."""
        try:
            return self._known(str(file.resolve()), _version(file.stat())) is not None
        except OSError:
            return False

    def remember(self, file: Path, stat: os.stat_result, digest: str) -> None:
        """Record `digest` for `file` at the version `stat` gives (the one its caller hashed)."""
        self._record(file, stat, digest)

    def _known(self, key: str, version: dict[str, int]) -> str | None:
        entry = self.entries.get(key)
        if entry and all(entry.get(field) == value for field, value in version.items()):
            return str(entry["sha256"])
        return None

    def _record(self, file: Path, stat: os.stat_result, digest: str) -> None:
        self.entries[str(file.resolve())] = {**_version(stat), "sha256": digest}
        self._save()

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


def _version(stat: os.stat_result) -> dict[str, int]:
    return {
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "ctime_ns": stat.st_ctime_ns,
        "inode": stat.st_ino,
    }


def digest_cache(cache_dir: Path) -> DigestCache:
    """The digest cache `farm submit`, `farm pull MODEL` and the edge SDK share: one file under
    `FARM_CACHE_DIR`, so a model hashed by one is not hashed again by the others."""
    return DigestCache(cache_dir / "digests.json")
