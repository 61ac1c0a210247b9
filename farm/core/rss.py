"""The peak resident memory of this process over a stretch of work, on Linux.

`VmHWM` in /proc/self/status is the process's peak resident set; writing 5 to
/proc/self/clear_refs resets it to the current resident set (Linux >= 4.0), so a worker can
measure one compile and an edge one verification in a process that did other work before.
Standard library only: the worker's compile child and the edge share it.
"""

from __future__ import annotations

import contextlib
import resource


def reset_peak_rss() -> None:
    """Start a new peak: VmHWM := the current resident set (a no-op where it cannot)."""
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def peak_rss_bytes() -> int:
    """VmHWM since the last `reset_peak_rss`; where /proc has none, the process's lifetime
    peak (getrusage)."""
    with contextlib.suppress(OSError), open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
