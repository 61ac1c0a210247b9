"""Hold the machine steady while benchmarks run, then put it back (as `pyperf system tune` does
for CPU frequency): `bench/run` holds it for a full run, never for `--smoke`.

What it holds: the guest's free page reporting. A VM whose balloon device offers it (virtio
`VIRTIO_BALLOON_F_REPORTING`) hands the host the 2 MB blocks it freed; the host takes their
memory back, and the next process that touches those pages waits while the host backs them
again. On the machine of bench/README.md "free page reporting" (reporting after 0 ms) that made
every fresh page cache or heap page cost a lottery: a direct `compile_model` of the 512 MB
model took 0.93-1.37 s while 978 MiB were reported over five runs, and 0.49-0.62 s with
nothing reported once freed blocks had to stay free for 60 s before being reported. Whichever
side of a comparison drew the slow pages lost, whatever its code did.

The knob is the page_reporting module's `min_free_ms` (how long a block stays free before it
is reported). Kernels without it, and runs that cannot write it (not root), run as the
machine is; `state()` says which, and each result records it (`machine()["page_reporting"]`).
`FARM_BENCH_TUNE=0` leaves the machine alone.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

PAGE_REPORTING = Path("/sys/module/page_reporting/parameters")
HOLD_MS = 300_000
"""How long a freed block stays free before it is reported while a run holds the machine:
longer than any one benchmark's side (seconds to a minute); the kernel measured refused
600 000."""


def state() -> dict[str, int] | None:
    """The free page reporting settings and how much it has reported so far; None when this
    kernel has no page reporting."""
    found = {}
    for name in ("min_free_ms", "page_reporting_order", "reported_kib"):
        with contextlib.suppress(OSError, ValueError):
            found[name] = int((PAGE_REPORTING / name).read_text())
    return found or None


@contextlib.contextmanager
def held() -> Iterator[bool]:
    """Freed pages stay with the guest for HOLD_MS during the block; whether they did."""
    knob = PAGE_REPORTING / "min_free_ms"
    if os.environ.get("FARM_BENCH_TUNE") == "0":
        yield False
        return
    try:
        before = knob.read_text().strip()
        knob.write_text(str(HOLD_MS))
    except OSError:
        yield False
        return
    try:
        yield True
    finally:
        knob.write_text(before)
