"""A worker's model fetch from S3 (the real SeaweedFS): ranged GETs in parallel, hashed in order
as they arrive (`model_cache.download_hashed`), so the sha256 overlaps the transfer; every
byte lands where it belongs, whatever the part boundaries, and a stored object whose bytes
are not its digest is never cached."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time

import pytest

from farm.core.errors import IntegrityMismatch
from farm.core.filecache import BlobCache
from farm.server.jobs import model_cache
from farm.server.storage import model_storage_key


def stored_model(s3_store, tmp_path, size: int) -> tuple[bytes, str, str]:
    """`size` random bytes stored as a model file in S3: the bytes, their digest, their key."""
    data = os.urandom(size)
    digest = hashlib.sha256(data).hexdigest()
    source = tmp_path / "source"
    source.write_bytes(data)
    key = model_storage_key(digest)
    s3_store.put_file(key, source, expected_sha256=digest)
    return data, digest, key


@pytest.mark.parametrize("size", [0, 1, 3 * 2**20, 5 * 2**20 + 12345])
def test_parts_land_in_place_and_the_digest_is_the_whole_files(
    s3_store, tmp_path, monkeypatch, size
):
    monkeypatch.setattr(model_cache, "FETCH_PART_BYTES", 2**20)  # many parts, one short
    data, digest, key = stored_model(s3_store, tmp_path, size)
    dest = tmp_path / "fetched"
    assert model_cache.download_hashed(s3_store, key, dest) == digest
    assert dest.read_bytes() == data


def test_a_corrupt_object_is_refused_and_not_cached(s3_store, tmp_path, monkeypatch):
    monkeypatch.setattr(model_cache, "FETCH_PART_BYTES", 2**20)
    data = os.urandom(3 * 2**20 + 7)
    source = tmp_path / "source"
    source.write_bytes(data)
    claimed = hashlib.sha256(b"other bytes").hexdigest()
    key = model_storage_key(claimed)
    s3_store.put_file(key, source)  # stored under a digest that is not its own
    cache = model_cache.open_model_cache(tmp_path / "cache", 2**30)
    with pytest.raises(IntegrityMismatch, match="not cached, not used"):
        model_cache.link_model_file(cache, s3_store, key, claimed, tmp_path / "job" / "m.bin")
    assert BlobCache.get(cache, claimed) is None


def test_the_fetch_into_its_mkstemp_file_never_opens_it_to_truncate(
    s3_store, tmp_path, monkeypatch, file_opens
):
    """`O_TRUNC` on the existing name made ext4 flush the whole model at its close, under the
    compile that reads it next (farm/core/emptied.py)."""
    data, digest, key = stored_model(s3_store, tmp_path, 3 * 2**20 + 5)
    modes_seen = []

    def recording_open(file, mode="r", *args, **kwargs):
        modes_seen.append(mode)  # "w" truncates as O_TRUNC does
        return open(file, mode, *args, **kwargs)

    monkeypatch.setattr(model_cache, "open", recording_open, raising=False)
    cache = model_cache.open_model_cache(tmp_path / "cache", 2**30)
    model_cache.link_model_file(cache, s3_store, key, digest, tmp_path / "m.bin")
    assert (tmp_path / "m.bin").read_bytes() == data
    flags_seen = file_opens["flags"]
    assert flags_seen and not any(flags & os.O_TRUNC for flags in flags_seen)
    assert not any("w" in mode for mode in modes_seen)


def test_a_fetch_killed_midway_leaves_no_file_behind_once_the_cache_opens_again(tmp_path):
    """A worker killed mid-fetch (the OOM killer, a container stopped) left its partial file for
    good, where the cache's cap never counts it; a fetch another process is making stays."""
    cache = model_cache.open_model_cache(tmp_path / "cache", 2**30)
    abandoned = cache.partial_dir / f"{'a' * 64}.killed"
    in_progress = cache.partial_dir / f"{'b' * 64}.fetching"
    older_version = cache.partial_dir / f"{'c' * 64}.unlocked"  # a fetch that takes no lock
    an_hour_ago = time.time() - 3600
    for path in (abandoned, in_progress, older_version):
        path.write_bytes(b"\0" * 4096)
    for path in (abandoned, in_progress):
        os.utime(path, (an_hour_ago, an_hour_ago))
    holder = subprocess.Popen(  # holds its file as `_fetch` does: locked until it ends
        [sys.executable, "-c", HOLD_LOCKED, str(in_progress)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
        model_cache.open_model_cache(tmp_path / "cache", 2**30)
        left = sorted(p.name for p in cache.partial_dir.iterdir())
        assert left == sorted([in_progress.name, older_version.name])
    finally:
        holder.kill()
        holder.communicate()
    model_cache.open_model_cache(tmp_path / "cache", 2**30)
    assert [p.name for p in cache.partial_dir.iterdir()] == [older_version.name]  # written lately


def test_a_fetch_holds_its_file_until_it_is_cached(s3_store, tmp_path, monkeypatch):
    """So that another worker process opening the cache meanwhile leaves it."""
    data, digest, key = stored_model(s3_store, tmp_path, 3 * 2**20 + 5)
    cache = model_cache.open_model_cache(tmp_path / "cache", 2**30)
    swept_during = []
    fetch = model_cache.download_hashed

    def download_hashed(store, storage_key, dest):
        answer = fetch(store, storage_key, dest)
        swept_during.append(model_cache.remove_abandoned_fetches(cache.partial_dir))
        return answer

    monkeypatch.setattr(model_cache, "download_hashed", download_hashed)
    monkeypatch.setattr(model_cache, "ABANDONED_AFTER_SECONDS", 0)  # only the lock keeps it
    model_cache.link_model_file(cache, s3_store, key, digest, tmp_path / "m.bin")
    assert swept_during == [[]]
    assert (tmp_path / "m.bin").read_bytes() == data


HOLD_LOCKED = """
import fcntl, os, sys, time
descriptor = os.open(sys.argv[1], os.O_RDWR)
fcntl.flock(descriptor, fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(600)
"""


def test_model_files_fetched_before_the_host_restarted_are_fetched_again(tmp_path, monkeypatch):
    """A fetch is not flushed, and a cached file is never hashed again: after a crash one
    could come back with ranges of zeros. A job's own link keeps its bytes."""
    cache = model_cache.open_model_cache(tmp_path / "cache", 2**30)
    fetched = tmp_path / "fetched"
    fetched.write_bytes(b"model bytes")
    digest = hashlib.sha256(b"model bytes").hexdigest()
    os.link(cache.put(digest, fetched), tmp_path / "job-link")
    assert model_cache.open_model_cache(tmp_path / "cache", 2**30).get(digest) is not None
    monkeypatch.setattr(model_cache, "boot_id", lambda: "a boot after a crash")
    reopened = model_cache.open_model_cache(tmp_path / "cache", 2**30)
    assert reopened.get(digest) is None
    assert (tmp_path / "job-link").read_bytes() == b"model bytes"
    assert (tmp_path / "cache" / "boot").read_text() == "a boot after a crash"
    assert model_cache.forget_another_boots_files(reopened) == []  # once per boot
