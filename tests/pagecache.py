"""What of a file is in memory (the page cache), for tests of copies made around it."""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path


def cached_pages(path: Path) -> int:
    """How many of the file's pages are in the page cache (mincore over a map of it, which
    reads none of them)."""
    size = os.path.getsize(path)
    if size == 0:
        return 0
    residency = ctypes.create_string_buffer(-(-size // mmap.PAGESIZE))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
    with open(path, "rb") as file, mmap.mmap(file.fileno(), size, access=mmap.ACCESS_COPY) as m:
        start = ctypes.c_char.from_buffer(m)
        assert libc.mincore(ctypes.addressof(start), size, residency) == 0
        del start
    return sum(byte & 1 for byte in residency.raw)


def direct_io_here(folder: Path) -> bool:
    """Whether files in `folder` take direct I/O (O_DIRECT; tmpfs does not)."""
    probe = folder / ".direct-io-probe"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600))
    except OSError:
        return False
    finally:
        probe.unlink(missing_ok=True)
    return True
