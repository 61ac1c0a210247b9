"""Watching a real worker from outside, without changing it: when its job folders and files
appear (phase boundaries), and how much memory its processes hold (a process tree sampler).

A worker started with ``TMPDIR=<dir>`` makes one folder per job there (``farm-job-<id>-*``,
`farm.runner`): created just before the model fetch, ``<key>.request.json`` written when the
fetch is done and the compile child starts, ``<key>.result.json`` written by the child as it
ends, the folder removed after the blob is uploaded and recorded.
"""

from __future__ import annotations

import os
import re
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

POLL_SECONDS = 0.005
_JOB_DIR = re.compile(r"^farm-job-(\d+)-")


def timestamp(value: datetime) -> float:
    """Seconds since the epoch of a database timestamp (naive ones are UTC)."""
    return (value if value.tzinfo else value.replace(tzinfo=UTC)).timestamp()


@dataclass
class JobFolder:
    job_id: int
    path: Path
    appeared: float
    fetched: float | None = None
    """mtime of the request file: the model fetch is done, the compile child starts."""
    child_done: float | None = None
    """mtime of the result file: the compile child has finished."""
    removed: float | None = None
    files: set[str] = field(default_factory=set)


class WorkDirWatcher:
    """Polls a worker's TMPDIR every POLL_SECONDS for job folders and their files."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.folders: dict[str, JobFolder] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> WorkDirWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def finished_folder(self, job_id: int, timeout: float = 60) -> JobFolder:
        """The job's (last) folder, once the worker has removed it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            folders = self.by_job().get(job_id)
            if folders and folders[-1].removed is not None:
                return folders[-1]
            time.sleep(POLL_SECONDS)
        raise TimeoutError(f"the folder of job {job_id} was not removed in {timeout} s")

    def child_finished(self, job_id: int) -> bool:
        """The compile child of the job's (last) folder has written its result."""
        folders = self.by_job().get(job_id)
        return bool(folders) and folders[-1].child_done is not None

    def by_job(self) -> dict[int, list[JobFolder]]:
        jobs: dict[int, list[JobFolder]] = {}
        for folder in self.folders.values():
            jobs.setdefault(folder.job_id, []).append(folder)
        return jobs

    def _run(self) -> None:
        while not self._stop.is_set():
            self._scan()
            time.sleep(POLL_SECONDS)
        self._scan()

    def _scan(self) -> None:
        now = time.time()
        try:
            names = {entry.name for entry in os.scandir(self.root) if _JOB_DIR.match(entry.name)}
        except FileNotFoundError:
            return
        for name in names - self.folders.keys():
            match = _JOB_DIR.match(name)
            self.folders[name] = JobFolder(int(match[1]), self.root / name, now)
        for name, folder in self.folders.items():
            if folder.removed is not None:
                continue
            if name not in names:
                folder.removed = now
                continue
            try:
                entries = list(os.scandir(folder.path))
            except FileNotFoundError:
                continue
            for entry in entries:
                folder.files.add(entry.name)
                try:
                    if folder.fetched is None and entry.name.endswith(".request.json"):
                        folder.fetched = entry.stat().st_mtime
                    if folder.child_done is None and entry.name.endswith(".result.json"):
                        folder.child_done = entry.stat().st_mtime
                except FileNotFoundError:
                    pass


def _status(pid: int) -> dict[str, int] | None:
    try:
        with open(f"/proc/{pid}/status") as status:
            values = {}
            for line in status:
                key, _, rest = line.partition(":")
                if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                    values[key] = int(rest.split()[0]) * 1024
            return values
    except (FileNotFoundError, ProcessLookupError, ValueError):
        return None


def _proportional(pid: int) -> dict[str, int] | None:
    """PSS of a process: its private pages plus its share of pages it shares (a forked pool
    process shares most of its parent's), so the PSS of a process tree adds up to what the
    tree really holds, where summed RSS would count shared pages once per process."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as rollup:
            values = {}
            for line in rollup:
                key, _, rest = line.partition(":")
                if key in ("Pss", "Pss_Anon"):
                    values[key] = int(rest.split()[0]) * 1024
            return values if "Pss" in values else None
    except (FileNotFoundError, ProcessLookupError, ValueError, PermissionError):
        return None


def _children(pid: int) -> list[int]:
    found = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as children:
                found += [int(child) for child in children.read().split()]
    except (FileNotFoundError, ProcessLookupError):
        pass
    return found


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            words = cmdline.read().split(b"\0")
    except OSError:
        return "?"
    text = " ".join(w.decode(errors="replace") for w in words if w)
    return text.split("python", 1)[-1].strip()[:80]


def process_tree(pid: int) -> list[int]:
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        todo += _children(current)
    return tree


class TreeSampler:
    """Samples a process tree every `interval`: the peak of its summed PSS (what the tree
    holds at one moment), and each process's own peak RSS (VmHWM, last seen before it
    ended)."""

    def __init__(self, pid: int, interval: float = 0.01) -> None:
        self.pid = pid
        self.interval = interval
        self.peak_total = 0
        self.peak_total_anon = 0
        self.peak_by_pid: dict[int, int] = {}
        self.names: dict[int, str] = {}
        """What each process sampled was: its command line, shortened."""
        self.at_peak: dict[int, int] = {}
        """Each process's PSS at the moment of the tree's peak."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> TreeSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def reset(self) -> None:
        """Forget the peaks so far, the processes' own (VmHWM) included."""
        for pid in process_tree(self.pid):
            try:
                with open(f"/proc/{pid}/clear_refs", "w") as clear_refs:
                    clear_refs.write("5")
            except OSError:
                pass  # ended meanwhile
        self.peak_total = self.peak_total_anon = 0
        self.peak_by_pid = {}
        self.names = {}
        self.at_peak = {}

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            total = anon = 0
            shares_now: dict[int, int] = {}
            for pid in process_tree(self.pid):
                status = _status(pid)
                shares = _proportional(pid)
                if not status or "VmRSS" not in status or not shares:
                    continue  # ended, or a zombie (no memory left to count)
                total += shares["Pss"]
                anon += shares["Pss_Anon"]
                shares_now[pid] = shares["Pss"]
                self.peak_by_pid[pid] = max(self.peak_by_pid.get(pid, 0), status["VmHWM"])
                if not self.names.get(pid):  # empty between fork and exec
                    self.names[pid] = _command(pid)
            if total > self.peak_total:
                self.peak_total = total
                self.at_peak = shares_now
            self.peak_total_anon = max(self.peak_total_anon, anon)
