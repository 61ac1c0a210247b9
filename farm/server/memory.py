"""Handing freed memory back to the OS, for the long-lived processes that move big files: the
worker's pool processes (blob and model transfers) and the API (model uploads)."""

from __future__ import annotations

import ctypes
import functools


def release_free_memory() -> None:
    """Hand memory freed by transfers back to the OS. glibc keeps freed parts' buffers in the
    transfer threads' arenas: a long-lived worker grew by ~80 MB over five 512 MB jobs and held
    it through every later compile (bench/README.md, worker_memory), and an API that streamed 48
    uploads at once kept 1.4 to 1.8 GB after they ended. No-op off glibc."""
    trim = getattr(_this_process(), "malloc_trim", None)
    if trim is not None:
        trim(0)


@functools.cache
def _this_process() -> ctypes.CDLL:
    """The symbols already loaded in this process, libc's among them (no library search)."""
    return ctypes.CDLL(None)
