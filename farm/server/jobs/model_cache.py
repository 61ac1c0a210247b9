"""A worker host's cache of model files: each fetched from storage and verified once, then
linked into every job that compiles that model (another spec, another target, a retry).

Shares the edge's `BlobCache` (content-addressed files, LRU under a cap, atomic renames);
jobs get hard links, so evicting a file never pulls it from under a running compile.

The cache holds every submitter's models, so its folder is the worker's alone (0700): the
compile child, another user, reaches only the files its own job links into its box.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import itertools
import logging
import os
import shutil
import tempfile
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import NoReturn

from farm.core.emptied import open_emptied, pwrite_all
from farm.core.errors import IntegrityMismatch, ModelFileCorrupt, StorageError
from farm.core.filecache import BlobCache, boot_id, same_file, write_atomically
from farm.core.hashing import sha256_file, sha256_stream
from farm.server.storage import BlobStore

log = logging.getLogger(__name__)


def open_model_cache(root: Path, max_bytes: int) -> BlobCache:
    """The worker's model cache at `root`, closed to every other user (the compile user); the
    files of fetches that no process is making any more are deleted."""
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o700)
    cache = BlobCache(root, max_bytes)
    remove_abandoned_fetches(cache.partial_dir)
    forget_another_boots_files(cache)
    return cache


def forget_another_boots_files(cache: BlobCache) -> list[str]:
    """Delete the cached model files of an earlier boot of this host; their digests. A fetch
    does not flush its file to the disk (the compile reads it from memory next), so a file
    fetched just before a crash or a power loss can come back its full size with ranges of
    zeros, and nothing hashes a cached file again: it is fetched again instead. Jobs keep the
    files they linked."""
    marker = cache.root / "boot"
    with contextlib.suppress(FileNotFoundError):
        if marker.read_text() == boot_id():
            return []
    forgotten = []
    for entry in cache.entries():
        entry.path.unlink(missing_ok=True)
        forgotten.append(entry.cache_key)
    with write_atomically(marker) as sink:  # not in partial/: the sweep there takes any file
        sink.write(boot_id().encode())
    if forgotten:
        log.info("forgot %d model files fetched before this host started", len(forgotten))
    return forgotten


ABANDONED_AFTER_SECONDS = 600.0
"""How long a partial file must have gone unwritten before `remove_abandoned_fetches` takes it
when no fetch holds it (a fetch writes its file continuously)."""


def remove_abandoned_fetches(folder: Path) -> list[str]:
    """Delete the files in `folder` that no fetch holds (`_fetch` holds its file locked from
    its creation to its place in the cache); their names. A worker killed mid-fetch (the OOM
    killer, a container stopped) left its file there for good, where the cache's cap never
    counts it."""
    removed = []
    for entry in folder.iterdir():
        try:
            descriptor = os.open(entry, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue  # gone meanwhile, or not ours to open
        try:
            # Written lately: a fetch of a worker of an earlier version, which takes no lock.
            if time.time() - os.fstat(descriptor).st_mtime < ABANDONED_AFTER_SECONDS:
                continue
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if same_file(descriptor, entry):
                entry.unlink()
                removed.append(entry.name)
        except OSError:
            continue  # a fetch in progress
        finally:
            os.close(descriptor)
    if removed:
        log.info("removed %d abandoned model fetches: %s", len(removed), ", ".join(removed))
    return removed


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
    handle, partial = _fetch_file(cache.partial_dir, sha256)
    try:
        actual = download_hashed(store, storage_key, partial)
        if actual != sha256:
            raise IntegrityMismatch(
                f"model file {storage_key} in storage has sha256 {actual}; not cached, not used"
            )
        log.info("fetched model file %s (%d bytes) into the worker cache", sha256, _size(partial))
        return cache.put(sha256, partial)
    finally:
        partial.unlink(missing_ok=True)
        os.close(handle)


def _fetch_file(folder: Path, sha256: str) -> tuple[int, Path]:
    """A new file of this fetch's own (other worker processes on this host may fetch the same
    model now), held locked until the fetch ends, so that `remove_abandoned_fetches` leaves
    it; it is made again if that took it before the lock."""
    while True:
        handle, name = tempfile.mkstemp(dir=folder, prefix=f"{sha256}.")
        fcntl.flock(handle, fcntl.LOCK_EX)
        if same_file(handle, Path(name)):
            return handle, Path(name)
        os.close(handle)


FETCH_PART_BYTES = 16 * 2**20
FETCH_PARALLEL = 4
"""Ranged GETs of a model fetch: boto3 download_file's settings in `S3Store.get_file`."""


def condemn_model_file(store: BlobStore, key: str, sha256: str, what: str) -> NoReturn:
    """A fetched model file whose bytes do not match its digest: read the stored object once
    more, and when it really is corrupt (not a transfer gone wrong), delete it. Objects are
    write-once, so a corrupt one would otherwise stay forever: the farm would report it present
    and turn the genuine bytes away. Once deleted, `missing` names it and an upload stores it.
    `what`: the file, for the error (``the model's bin``).

    Note: an upload of the genuine bytes that lands between the check and the delete is
    deleted too; the next submit finds the file missing and uploads it again.
    """
    with contextlib.closing(store.open_read(key)) as body:
        actual = sha256_stream(body)
    if actual == sha256:
        raise StorageError(f"model file {key} changed on its way from storage; retrying")
    store.delete(key)
    log.warning("model file %s in storage has sha256 %s; deleted it", key, actual)
    raise ModelFileCorrupt(
        f"model file {key} ({what}) was corrupt in storage (its bytes have sha256 "
        f"{actual}); it was removed: submit the model again to upload it"
    )


def download_hashed(store: BlobStore, storage_key: str, dest: Path) -> str:
    """Write the object to `dest`; its sha256. From S3, parts are fetched by ranged GETs in
    parallel (as boto3's `download_file` does) and hashed in order as they arrive, so the
    hash overlaps the transfer: download then hash took 1.34x boto3's download alone for
    512 MB (bench/README.md, overhead). Other stores: `get_file`, then one hash pass."""
    from farm.server.storage.s3 import S3Store  # boto3: a worker with an S3 store has it

    if not isinstance(store, S3Store):
        store.get_file(storage_key, dest)
        return sha256_file(dest)
    found = store.stat(storage_key)
    if found is None:
        raise StorageError(f"{storage_key} is not in storage")
    size, digest = found.size, hashlib.sha256()
    # Not open(dest, "wb"): `dest` exists (mkstemp), and ext4 would then flush it all at its
    # close, under the compile that reads it next (farm/core/emptied.py).
    with os.fdopen(open_emptied(dest), "wb") as sink:
        sink.truncate(size)
        starts = iter(range(0, size, FETCH_PART_BYTES))

        def part(start: int) -> bytes:
            end = min(start + FETCH_PART_BYTES, size) - 1
            try:
                with contextlib.closing(store.read_range(storage_key, start, end)) as body:
                    data = body.read()
            except StorageError:
                raise
            except Exception as error:  # the body's own read errors (botocore, urllib3)
                raise StorageError(f"S3 read of {storage_key} failed: {error}") from error
            if len(data) != end - start + 1:
                raise StorageError(f"S3 read of {storage_key} was cut short at {start}")
            pwrite_all(sink.fileno(), data, start)
            return data

        with ThreadPoolExecutor(FETCH_PARALLEL, thread_name_prefix="model-fetch") as pool:
            # At most FETCH_PARALLEL + 1 parts in memory: the one being hashed, the rest coming.
            window: deque[Future[bytes]] = deque(
                pool.submit(part, start) for start in itertools.islice(starts, FETCH_PARALLEL + 1)
            )
            while window:
                digest.update(window.popleft().result())  # hashlib lets the GETs run meanwhile
                start = next(starts, None)
                if start is not None:
                    window.append(pool.submit(part, start))
    return digest.hexdigest()


def _size(path: Path) -> int:
    return path.stat().st_size
