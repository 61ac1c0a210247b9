"""`farm submit` hashes the model in a forked child while it loads what it needs next
(`farm.cli.hash_ahead`): the same digests, remembered; a file written meanwhile is hashed again
as it is; a child cut short leaves nothing running."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from farm.cli import hash_ahead
from farm.cli.hash_ahead import HashAhead
from farm.core.digests import DigestCache
from farm.core.hashing import sha256_file


def files_in(tmp_path: Path, sizes: dict[str, int]) -> dict[str, Path]:
    made = {}
    for role, size in sizes.items():
        path = tmp_path / f"model.{role}"
        path.write_bytes(os.urandom(size))
        made[role] = path
    return made


def test_the_childs_digests_are_the_files_and_are_remembered(tmp_path):
    files = files_in(tmp_path, {"xml": 1000, "bin": 3 << 20})
    cache = DigestCache(tmp_path / "digests.json")
    ahead = HashAhead.start(files, "model", True, cache)
    assert ahead is not None
    for path in files.values():
        assert ahead.digest(path) == sha256_file(path)
        assert cache.knows(path)
    assert sorted(ahead._results()) == sorted(map(str, files.values()))  # the child's
    assert DigestCache(tmp_path / "digests.json").knows(files["bin"])  # saved for the next run
    # Every file known as it is: nothing to fork.
    assert HashAhead.start(files, "model", True, cache) is None


def test_a_file_written_while_it_was_hashed_is_hashed_again_as_it_is(tmp_path):
    files = files_in(tmp_path, {"xml": 1000, "bin": 1 << 20})
    ahead = HashAhead.start(files, "model", True, DigestCache(tmp_path / "digests.json"))
    assert ahead is not None
    stat = files["bin"].stat()
    files["bin"].write_bytes(os.urandom(1 << 20))  # same size and mtime, new bytes
    os.utime(files["bin"], ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert ahead.digest(files["bin"]) == sha256_file(files["bin"])


def test_a_child_that_failed_leaves_the_hash_to_this_process(tmp_path):
    files = files_in(tmp_path, {"xml": 1000, "bin": 1 << 20})
    unreadable = tmp_path / "a-folder"  # sha256_file fails on it: the child ends with an error
    unreadable.mkdir()
    ahead = HashAhead.start({**files, "x": unreadable}, "model", True, DigestCache(tmp_path / "d"))
    assert ahead is not None
    assert ahead.digest(files["xml"]) == sha256_file(files["xml"])
    assert ahead._results() == {}  # nothing came back: hashed here


def test_close_stops_a_child_still_hashing(tmp_path):
    big = tmp_path / "model.bin"
    with open(big, "wb") as stream:
        stream.truncate(8 << 30)  # sparse: hashing it takes seconds
    ahead = HashAhead.start({"bin": big}, "model", True, DigestCache(tmp_path / "d.json"))
    assert ahead is not None
    pid = ahead._pid
    started = time.monotonic()
    ahead.close()
    assert time.monotonic() - started < 2
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass  # collected by close: no zombie left
    else:
        raise AssertionError("the hashing child was not collected")


def test_a_file_written_right_after_its_check_is_not_remembered_under_its_new_version(
    tmp_path, monkeypatch
):
    files = files_in(tmp_path, {"bin": 1 << 20})
    cache = DigestCache(tmp_path / "digests.json")
    ahead = HashAhead.start(files, "model", True, cache)
    assert ahead is not None
    checked = hash_ahead.version_of

    def checked_then_written(stat):
        version = checked(stat)
        files["bin"].write_bytes(os.urandom(1 << 20))  # a writer right after the check
        monkeypatch.setattr(hash_ahead, "version_of", checked)
        return version

    monkeypatch.setattr(hash_ahead, "version_of", checked_then_written)
    ahead.digest(files["bin"])
    # The digest is of the bytes before the write: never taken for the file as it is now.
    assert DigestCache(tmp_path / "digests.json").sha256(files["bin"]) == sha256_file(files["bin"])


def test_an_interrupted_wait_still_closes_cleanly(tmp_path, monkeypatch):
    files = files_in(tmp_path, {"bin": 1 << 20})
    ahead = HashAhead.start(files, "model", True, DigestCache(tmp_path / "digests.json"))
    assert ahead is not None
    waitpid = os.waitpid

    def interrupted(*args):
        monkeypatch.setattr(os, "waitpid", waitpid)
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "waitpid", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ahead._results()
    pid = ahead._pid
    ahead.close()  # the pipe is closed once, the child collected once
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
