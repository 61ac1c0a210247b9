"""Write a file from nothing: open it without `O_TRUNC`, and write every byte asked for.

ext4 (with its default `auto_da_alloc`) marks a file that is truncated to nothing, and when
it is next closed it starts the writeback of everything the file then holds, while the
closing thread waits. A 512 MB download written into a file that already existed (the edge
agent's lock file, a worker's `mkstemp` name) thus paid a flush at its close, 0.1 s on the
edge, and left the worker's freshly fetched model under writeback while the compile read it
and wrote its blob (the blob write took 1.2 s instead of 0.2 s; bench/README.md "free page
reporting"). An empty file needs no truncation, so it gets none.

A file sized first (`ftruncate` to its whole length, then parts written in place) reads as
zeros wherever a write fell short: `pwrite` returns a short count instead of failing when
the disk fills part-way through it, so every write here goes on until all is written or the
kernel says why not.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path


def open_emptied(path: Path) -> int:
    """A descriptor of `path` open to write, the file empty: created, left as it is when
    empty, emptied when it holds bytes (which still pays ext4's flush). Anything but a
    regular file is refused with OSError, before it can block or be written through: a
    symbolic link, a FIFO (opening one to write waits for a reader), a device."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o666)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        if info.st_size:
            os.ftruncate(fd, 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    """Write all of `data` at `offset`: a short write goes on from where it stopped, so a
    disk that fills fails with its own error (ENOSPC) instead of leaving a tail unwritten."""
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written
