"""A worker host's cache of model files: each fetched from storage and verified once, then
linked into every job that compiles that model (another spec, another target, a retry).

Shares the edge's `BlobCache` (content-addressed files, LRU under a cap, atomic renames);
jobs get hard links, so evicting a file never pulls it from under a running compile.

The cache holds every submitter's models, so its folder is the worker's alone (0700): the
compile child, another user, reaches only the files its own job links into its box.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

from farm.core.errors import IntegrityMismatch
from farm.core.filecache import BlobCache
from farm.core.hashing import sha256_file
from farm.server.storage import BlobStore

log = logging.getLogger(__name__)


def open_model_cache(root: Path, max_bytes: int) -> BlobCache:
    """The worker's model cache at `root`, closed to every other user (the compile user)."""
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o700)
    return BlobCache(root, max_bytes)


def link_model_file(
    cache: BlobCache, store: BlobStore, storage_key: str, sha256: str, dest: Path
) -> None:
    """Put the model file `sha256` at `dest`, from the cache or fetched into it first."""
    for _ in range(2):  # a second try if the file is evicted between lookup and link
        cached = cache.get(sha256) or _fetch(cache, store, storage_key, sha256)
        try:
            os.link(cached, dest)
        except FileNotFoundError:
            continue
        except OSError:  # another file system than the job's work dir: copy
            shutil.copyfile(cached, dest)
        return
    raise FileNotFoundError(f"model file {sha256} keeps leaving the worker's cache")


def _fetch(cache: BlobCache, store: BlobStore, storage_key: str, sha256: str) -> Path:
    # A name of our own: other worker processes on this host may fetch the same file now.
    handle, name = tempfile.mkstemp(dir=cache.partial_dir, prefix=f"{sha256}.")
    os.close(handle)
    partial = Path(name)
    try:
        store.get_file(storage_key, partial)
        actual = sha256_file(partial)
        if actual != sha256:
            raise IntegrityMismatch(
                f"model file {storage_key} in storage has sha256 {actual}; not cached, not used"
            )
        log.info("fetched model file %s (%d bytes) into the worker cache", sha256, _size(partial))
        return cache.put(sha256, partial)
    finally:
        partial.unlink(missing_ok=True)


def _size(path: Path) -> int:
    return path.stat().st_size
