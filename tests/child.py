"""A Python script run in a child process of the test's interpreter: for what must not touch the
test process itself (a resource limit, an open that may block forever)."""

from __future__ import annotations

import subprocess
import sys


def run_python(script: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """`script` run as `python -c script args...`, its output captured as text; a child still
    running after `timeout` seconds fails the test (TimeoutExpired)."""
    return subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
