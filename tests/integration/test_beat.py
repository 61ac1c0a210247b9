"""`farm worker --beat`: the embedded beat dies with its worker, even one killed by SIGKILL, so
a restarted worker never runs beside an orphaned beat (two beats, every task sent twice)."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

from tests.integration.served import wait_until


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                stat = (entry / "stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
    return found


def running(pid: int) -> bool:
    """Alive and not a zombie (PID 1 of a container may never reap it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def test_the_embedded_beat_dies_with_its_worker(served, tmp_path):
    folder = tmp_path / "worker-cwd"  # where the beat writes its schedule file
    folder.mkdir()
    # `farm worker -n beat` exec'ed with --beat appended, from a folder of its own.
    prefix = ("sh", "-c", f'cd "{folder}" && exec "$0" "$@" --beat')
    worker = served.start_worker("beat", prefix=prefix)

    # The beat has started once the worker says so; its pool process starts before it.
    wait_until(lambda: "beat: Starting..." in served.worker_log("beat"), 60, "the beat")
    wait_until(lambda: len(children(worker.pid)) == 2, 30, "the pool process and the beat")
    spawned = children(worker.pid)

    def comms() -> list[str]:
        return [Path(f"/proc/{pid}/comm").read_text().strip() for pid in spawned]

    # The beat names itself when its init signal runs, a moment after it logs its start.
    wait_until(lambda: "farm beat" in comms(), 30, "the beat's process name")
    names = comms()
    assert names.count("farm beat") == 1  # the beat (the other: the pool process)
    # Its schedule file is under FARM_HOME, not in the folder the worker was started from.
    home = Path(served.env["FARM_HOME"])
    wait_until(lambda: list(home.glob("celerybeat-schedule*")), 30, "the schedule file")
    assert list(folder.iterdir()) == []

    served.workers.pop("beat")
    os.kill(worker.pid, signal.SIGKILL)  # the worker's main process only
    worker.wait(timeout=30)
    try:
        wait_until(lambda: not any(map(running, spawned)), 5, "the beat to die with its worker")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(worker.pid, signal.SIGKILL)  # whatever else is left of the worker
