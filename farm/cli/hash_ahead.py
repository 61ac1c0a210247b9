"""A model's sha256, computed in a forked process while `farm submit` loads what it needs next.

Hashing a 512 MB model takes 0.34 s of one core here; loading what the submit needs after it
(OpenVINO for the model check, the database layer, the job service: 0.46 s) takes another.
Neither needs the other, but in one process they cannot overlap: every chunk of the hash gives
up the GIL, and an import holding it makes the hash wait (measured: the pair was no faster on a
thread; bench/README.md "submit_overhead"). So the hash runs in a child forked before those
imports, which draws the hashing progress bar and hands the digests back through a pipe
(`HashAhead.digest`). Only the `farm` process forks, and only while it runs one thread
(`farm.cli.submit`): a program calling the CLI may hold threads whose locks a forked child
would inherit held.

A digest is taken only for a file that kept the version (inode, size, mtime, ctime) it had
before the fork, as the digest cache does, and is remembered under that version: a file
written while it was hashed is hashed again, here. Where the child failed, a file is hashed
here too; a file already in the digest cache is not hashed at all (no child is forked when all
are).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from farm.cli.common import progress_bar
from farm.core.digests import DigestCache
from farm.core.hashing import sha256_file
from farm.core.identity import file_version, version_of

STOP_SECONDS = 1.0
"""How long a child asked to stop (`close`) has to put its progress bar away before it is
killed."""


class HashAhead:
    """The sha256 of some files, hashed by a forked child from `start` on."""

    def __init__(
        self, pid: int, pipe: int, stats: Mapping[str, os.stat_result], cache: DigestCache
    ) -> None:
        self._pid: int | None = pid
        self._pipe: int | None = pipe
        self._stats = dict(stats)
        self._cache = cache
        self._found: dict[str, str] | None = None

    @classmethod
    def start(
        cls, files: Mapping[str, Path], label: str, quiet: bool, cache: DigestCache
    ) -> HashAhead | None:
        """Fork the hashing child; None when there is nothing to hash (every file is in
        `cache` as it is), or no fork here."""
        paths = [path for path in files.values() if not cache.knows(path)]
        if not paths or not hasattr(os, "fork"):
            return None
        stats = {str(path): os.stat(path) for path in paths}
        total = sum(stat.st_size for stat in stats.values())
        read, write = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            pid = os.fork()
        except OSError:  # no room for a process: hashed here instead
            os.close(read)
            os.close(write)
            return None
        if pid == 0:
            os.close(read)
            _hash_and_exit(paths, write, f"hashing {label}", total, quiet)
        os.close(write)
        return cls(pid, read, stats, cache)

    @property
    def files(self) -> list[Path]:
        """The files the child hashes: those the digest cache did not know."""
        return [Path(name) for name in self._stats]

    def digest(self, file: Path, progress: Callable[[int], None] | None = None) -> str:
        """`file`'s sha256 (a `farm.core.identity.Digest`): the child's while `file` still
        has the version it had before the fork, remembered under that version; else hashed
        here."""
        found = self._results().get(str(file))
        before = self._stats.get(str(file))
        if found is None or before is None or file_version(file) != version_of(before):
            return self._cache.sha256(file, progress)
        self._cache.remember(file, before, found)
        return found

    def _results(self) -> dict[str, str]:
        if self._found is None:
            assert self._pipe is not None and self._pid is not None
            with os.fdopen(self._pipe, "rb") as answer:
                self._pipe = None  # the file object closes it
                data = answer.read()  # to its end before waiting: the child may fill the pipe
            _, status = os.waitpid(self._pid, 0)
            self._pid = None
            self._found = json.loads(data) if os.waitstatus_to_exitcode(status) == 0 else {}
        return self._found

    def close(self) -> None:
        """Stop the child if it is still hashing (the submit ended early: it puts its bar
        away first) and collect it."""
        if self._pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._pid, signal.SIGTERM)
            deadline = time.monotonic() + STOP_SECONDS
            while os.waitpid(self._pid, os.WNOHANG) == (0, 0):
                if time.monotonic() > deadline:
                    os.kill(self._pid, signal.SIGKILL)
                    os.waitpid(self._pid, 0)
                    break
                time.sleep(0.01)
            self._pid = None
        if self._pipe is not None:
            os.close(self._pipe)
            self._pipe = None


def _hash_and_exit(paths: list[Path], pipe: int, label: str, total: int, quiet: bool) -> None:
    """The child: hash `paths`, write their digests to `pipe`, and end without running any of
    the parent's exit code. SIGTERM (`HashAhead.close`) ends it through its `finally` blocks,
    so its progress bar gives the terminal its cursor back."""
    code = 1
    try:
        signal.signal(signal.SIGTERM, _stop)
        with progress_bar(label, total, quiet) as advance:
            found = {str(path): sha256_file(path, advance) for path in paths}
        with os.fdopen(pipe, "wb") as answer:
            answer.write(json.dumps(found).encode())
        code = 0
    except BaseException:
        pass
    finally:
        sys.stderr.flush()
        os._exit(code)


def _stop(signum: int, frame: object) -> None:
    raise SystemExit(1)
