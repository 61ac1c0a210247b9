"""Open a file to write it from nothing, without `O_TRUNC`.

ext4 (with its default `auto_da_alloc`) marks a file that is truncated to nothing, and when
it is next closed it starts the writeback of everything the file then holds, while the
closing thread waits. A 512 MB download written into a file that already existed (the edge
agent's lock file, a worker's `mkstemp` name) thus paid a flush at its close, 0.1 s on the
edge, and left the worker's freshly fetched model under writeback while the compile read it
and wrote its blob (the blob write took 1.2 s instead of 0.2 s; bench/README.md "free page
reporting"). An empty file needs no truncation, so it gets none.
"""

from __future__ import annotations

import os
from pathlib import Path


def open_emptied(path: Path) -> int:
    """A descriptor of `path` open to write, the file empty: created, left as it is when
    empty, emptied when it holds bytes (which still pays ext4's flush); never through a
    symbolic link (OSError)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o666)
    try:
        if os.fstat(fd).st_size:
            os.ftruncate(fd, 0)
    except BaseException:
        os.close(fd)
        raise
    return fd
