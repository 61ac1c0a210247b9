"""A model's sha256, computed in a forked process while `farm submit` loads what it needs next.

Hashing a 512 MB model takes 0.34 s of one core here; loading what the submit needs after it
(OpenVINO for the model check, the database layer, the job service: 0.46 s) takes another.
Neither needs the other, but in one process they cannot overlap: every chunk of the hash gives
up the GIL, and an import holding it makes the hash wait (measured: the pair was no faster on a
thread; bench/README.md "submit_overhead"). So the hash runs in a child forked before those
imports (nothing loaded yet holds a thread or a library that forbids fork), which draws the
hashing progress bar and hands the digests back through a pipe (`HashAhead.digest`).

A digest is taken only for a file that kept the version (inode, size, mtime, ctime) it had
before the fork, as the digest cache does: a file written while it was hashed is hashed again,
here. Where the child failed, a file is hashed here too; a file already in the digest cache is
not hashed at all (no child is forked when all are).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

from farm.cli.common import progress_bar
from farm.core.digests import DigestCache
from farm.core.hashing import sha256_file
from farm.core.identity import FileVersion, file_version


class HashAhead:
    """The sha256 of `files`, hashed by a forked child from now on (`start`)."""

    def __init__(
        self, pid: int, pipe: int, versions: Mapping[str, FileVersion], cache: DigestCache
    ):
        self._pid, self._pipe, self.versions, self._cache = pid, pipe, dict(versions), cache
        self._found: dict[str, str] | None = None

    @classmethod
    def start(
        cls, files: Mapping[str, Path], label: str, quiet: bool, cache: DigestCache
    ) -> HashAhead | None:
        """Fork the hashing child; None when there is nothing to hash (every file is in
        `cache` as it is) or no fork here."""
        paths = [path for path in files.values() if not cache.knows(path)]
        if not paths or not hasattr(os, "fork"):
            return None
        versions = {str(path): file_version(path) for path in paths}
        total = sum(version[2] for version in versions.values())
        read, write = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if (
            pid == 0
        ):  # the child: hash, answer, and end without running any of the parent's exit code
            code = 1
            try:
                os.close(read)
                with progress_bar(f"hashing {label}", total, quiet) as advance:
                    found = {str(path): sha256_file(path, advance) for path in paths}
                with os.fdopen(write, "wb") as answer:
                    answer.write(json.dumps(found).encode())
                code = 0
            finally:
                sys.stderr.flush()
                os._exit(code)
        os.close(write)
        return cls(pid, read, versions, cache)

    def digest(self, file: Path, progress: Callable[[int], None] | None = None) -> str:
        """`file`'s sha256: the child's, while `file` kept its version; else hashed here (a
        `farm.core.identity.Digest`)."""
        found = self._results().get(str(file))
        if found is None or file_version(file) != self.versions[str(file)]:
            return self._cache.sha256(file, progress)
        self._cache.remember(file, found)
        return found

    def _results(self) -> dict[str, str]:
        if self._found is None:
            with os.fdopen(self._pipe, "rb") as answer:
                data = answer.read()  # to its end before waiting: the child may fill the pipe
            _, status = os.waitpid(self._pid, 0)
            self._found = json.loads(data) if os.waitstatus_to_exitcode(status) == 0 else {}
        return self._found

    def close(self) -> None:
        """Stop the child if it is still hashing (the submit ended early) and collect it."""
        if self._found is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self._pid, signal.SIGKILL)
        os.waitpid(self._pid, 0)
        os.close(self._pipe)
        self._found = {}
