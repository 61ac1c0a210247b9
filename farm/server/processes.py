"""Child processes that must not outlive their parent: the compile sandbox's child and the
worker's embedded beat. Linux only (``prctl``); elsewhere these are no-ops.

Why: a child that outlives its parent keeps working for nobody. An orphaned compile holds its
memory for hours; an orphaned beat keeps sending reconcile tasks, and after the worker is
restarted two beats send them.
"""

from __future__ import annotations

import contextlib
import ctypes
import signal

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """This process gets `sig` when the thread that started it dies. Call it first thing in
    the child (a `preexec_fn`, a start signal); the caller checks ``os.getppid()`` afterwards
    if the parent may already have gone."""
    with contextlib.suppress(OSError):
        _libc().prctl(PR_SET_PDEATHSIG, sig)


def name_process(name: str) -> None:
    """Name this process (its main thread) as ``ps`` and ``/proc/PID/comm`` show it; at most
    15 bytes are kept."""
    with contextlib.suppress(OSError):
        _libc().prctl(PR_SET_NAME, name.encode()[:15])


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL("libc.so.6", use_errno=True)
