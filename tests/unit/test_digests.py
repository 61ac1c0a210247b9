"""The client's digest cache: keyed by path and version (inode, size, mtime, ctime), persisted
as JSON, never fatal."""

from __future__ import annotations

import hashlib
import json
import os

from farm.core.digests import DigestCache


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write(path, data: bytes, mtime_ns: int | None = None) -> None:
    path.write_bytes(data)
    if mtime_ns is not None:
        os.utime(path, ns=(mtime_ns, mtime_ns))


MTIME_NS = 1_700_000_000_000_000_000


def test_an_unchanged_file_is_a_hit_across_instances(tmp_path):
    model, cache_file = tmp_path / "m.bin", tmp_path / "cache" / "digests.json"
    write(model, b"weights-1", mtime_ns=MTIME_NS)
    assert DigestCache(cache_file).sha256(model) == sha256(b"weights-1")
    entry = json.loads(cache_file.read_text())[str(model.resolve())]
    info = model.stat()
    assert entry == {
        "size": 9,
        "mtime_ns": 1_700_000_000_000_000_000,
        "ctime_ns": info.st_ctime_ns,
        "inode": info.st_ino,
        "sha256": sha256(b"weights-1"),
    }
    seen: list[int] = []
    assert DigestCache(cache_file).sha256(model, seen.append) == sha256(b"weights-1")
    assert seen == [9]  # progress still reports the whole file on a hit


def test_a_file_rewritten_with_its_old_size_and_mtime_is_hashed_again(tmp_path):
    """`touch -d`, `rsync -t` or `cp -p` give a rewritten file its old mtime back; its ctime,
    which no one can set, still moves (the embedded store trusts a hit to copy it unhashed)."""
    model, cache_file = tmp_path / "m.bin", tmp_path / "digests.json"
    write(model, b"weights-1", mtime_ns=MTIME_NS)
    assert DigestCache(cache_file).sha256(model) == sha256(b"weights-1")
    before = model.stat().st_ctime_ns
    while model.stat().st_ctime_ns == before:  # a coarse clock could give the same ctime
        write(model, b"weights-2", mtime_ns=MTIME_NS)
    assert DigestCache(cache_file).sha256(model) == sha256(b"weights-2")


def test_a_change_of_size_or_mtime_hashes_again(tmp_path):
    model, cache_file = tmp_path / "m.bin", tmp_path / "digests.json"
    cache = DigestCache(cache_file)
    write(model, b"abc", mtime_ns=1_000_000_000)
    assert cache.sha256(model) == sha256(b"abc")

    write(model, b"abcd", mtime_ns=1_000_000_000)  # size changed, mtime kept
    assert cache.sha256(model) == sha256(b"abcd")

    write(model, b"wxyz", mtime_ns=2_000_000_000)  # same size, mtime changed
    assert cache.sha256(model) == sha256(b"wxyz")
    assert DigestCache(cache_file).sha256(model) == sha256(b"wxyz")  # and that was saved


def test_a_corrupt_cache_file_is_ignored_and_rewritten(tmp_path):
    model, cache_file = tmp_path / "m.bin", tmp_path / "digests.json"
    write(model, b"data")
    for garbage in (b"{not json", b"\x00\xff" * 10, b""):
        cache_file.write_bytes(garbage)
        assert DigestCache(cache_file).sha256(model) == sha256(b"data")
        saved = json.loads(cache_file.read_text())
        assert saved[str(model.resolve())]["sha256"] == sha256(b"data")


def test_a_cache_that_cannot_be_written_only_costs_time(tmp_path):
    model = tmp_path / "m.bin"
    write(model, b"data")
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder should be")
    cache = DigestCache(blocker / "digests.json")
    assert cache.sha256(model) == sha256(b"data")
    assert cache.sha256(model) == sha256(b"data")  # still answered from memory
