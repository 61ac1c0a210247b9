"""Hold the machine steady while benchmarks run, then put it back (as `pyperf system tune` does
for CPU frequency): `bench/run` holds it for a full run, never for `--smoke`.

What it holds: the guest's free page reporting. A VM whose balloon device offers it (virtio
`VIRTIO_BALLOON_F_REPORTING`) hands the host the 2 MB blocks it freed; the host takes their
memory back, and the next process that touches those pages waits while the host backs them
again. On the machine of bench/README.md "free page reporting" (reporting after 0 ms) that made
every fresh page cache or heap page cost a lottery: a direct `compile_model` of the 512 MB
model took 0.93-1.37 s while 978 MiB were reported over five runs, and 0.49-0.62 s with
nothing reported once freed blocks had to stay free for 30 s before being reported. Whichever
side of a comparison drew the slow pages lost, whatever its code did. Holding it makes runs
steadier, not steady: blocks free for longer than HOLD_MS are still reported.

The knob is the page_reporting module's `min_free_ms` (how long a block stays free before it
is reported). Kernels without it, runs that cannot write it (not root), and a run while
another holds it run as the machine is; `state()` says which, and each result records it
(`machine()["page_reporting"]`). `FARM_BENCH_TUNE=0` leaves the machine alone.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

PAGE_REPORTING = Path("/sys/module/page_reporting/parameters")
HOLD_MS = 300_000
"""How long a freed block stays free before it is reported while a run holds the machine:
longer than any one benchmark's side (seconds to a minute); the kernel measured refused
600 000."""
LOCK = Path(tempfile.gettempdir()) / "farm-bench-tune.lock"
"""Held by the run that holds the machine: a second run at once leaves the knob alone (it
would take the first run's setting for the machine's own, and put that back)."""


def state() -> dict[str, int] | None:
    """The free page reporting settings and how much it has reported so far; None when this
    kernel has no page reporting."""
    found = {}
    for name in ("min_free_ms", "max_waiting_mib", "page_reporting_order", "reported_kib"):
        with contextlib.suppress(OSError, ValueError):
            found[name] = int((PAGE_REPORTING / name).read_text())
    return found or None


def held_now(reporting: dict[str, int] | None) -> bool:
    """Whether `state()` shows a run of ours holding reporting."""
    return bool(reporting) and reporting.get("min_free_ms") == HOLD_MS


@contextlib.contextmanager
def held() -> Iterator[bool]:
    """Freed pages stay with the guest for HOLD_MS during the block; whether they did. The
    setting is put back when the block ends, by an exception, Ctrl-C, SIGTERM or SIGHUP."""
    if os.environ.get("FARM_BENCH_TUNE") == "0":
        yield False
        return
    with contextlib.ExitStack() as stack:
        before = _set_knob(stack)
        if before is None:
            yield False
            return
        try:
            with _signals_exit():
                yield True
        finally:
            (PAGE_REPORTING / "min_free_ms").write_text(before)


def _set_knob(stack: contextlib.ExitStack) -> str | None:
    """Take the lock for this run (kept open on `stack`) and set `min_free_ms` to HOLD_MS; its
    value before, or None: another run holds it, this kernel has no page reporting, or this
    user may not set it."""
    try:
        lock = stack.enter_context(open(LOCK, "a"))  # noqa: SIM115 - closed by the stack
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        knob = PAGE_REPORTING / "min_free_ms"
        before = knob.read_text().strip()
        knob.write_text(str(HOLD_MS))
    except OSError:
        return None
    return before


@contextlib.contextmanager
def _signals_exit() -> Iterator[None]:
    """SIGTERM and SIGHUP end the process through `finally` blocks (SystemExit), not around
    them."""

    def leave(number: int, _frame: object) -> None:
        raise SystemExit(128 + number)

    previous = {}
    with contextlib.suppress(ValueError):  # not the main thread: its caller's signals are its own
        for number in (signal.SIGTERM, signal.SIGHUP):
            previous[number] = signal.signal(number, leave)
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
