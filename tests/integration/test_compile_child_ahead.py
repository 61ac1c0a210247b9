"""A compile child started ahead of its job (`sandbox.prestart_compile_child`, the embedded
`farm submit`'s, beside the model's hash): the job's compile takes it as it is, with the job's
limits; a job it cannot run, and a submit that needs no compile, end it and remove its box."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from farm.core import errors
from farm.core.hashing import model_files
from farm.core.spec import CompileSpec, Target
from farm.server.jobs import sandbox
from farm.server.jobs.compile_user import compile_identity
from tests import models
from tests.integration.test_compile_child import SECRETS, broadcast_net, children_of, observe

CPU = Target.parse("CPU")


@pytest.fixture(autouse=True)
def _nothing_left_waiting():
    yield
    sandbox.discard_prestarted()


def waiting_child() -> sandbox._WaitingChild:
    [waiting] = sandbox._WAITING
    return waiting


def gone(pid: int, within: float = 10.0) -> bool:
    """Whether process `pid` has ended within `within` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return True
        if state in ("Z", "X"):  # ended; an orphan waits there for a init that may not collect
            return True
        time.sleep(0.05)
    return False


def test_the_job_compiles_in_the_child_started_ahead(tmp_path, monkeypatch):
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(sandbox, "POLL_SECONDS", 0.02)
    files = model_files(models.save_ir(models.large_net(8), tmp_path / "m" / "big.xml"))
    sandbox.prestart_compile_child(CPU)
    waiting = waiting_child()
    pid, box = waiting.child.pid, waiting.box
    before = observe(pid)
    assert before is not None and before["cwd"] == str(box)  # the box it will compile in
    assert not [name for name in before["env"] if name.startswith("FARM_")]
    seen: list[dict] = []

    def look() -> bool:
        seen.extend(filter(None, map(observe, children_of(os.getpid()))))
        return False

    result, _ = sandbox.compile_in_child(
        files, CompileSpec.create(CPU), tmp_path / "out", "k", timeout_seconds=120, should_stop=look
    )

    assert sandbox._WAITING == []  # taken
    assert result.blob_path == tmp_path / "out" / "k.blob"
    assert result.size_bytes == result.blob_path.stat().st_size > 8 * 2**20
    assert result.toolchain.openvino and result.compile_seconds > 0
    # The very child started ahead ran it, in its box, then both were gone.
    assert seen and {sight["cwd"] for sight in seen} == {str(box)}
    assert gone(pid) and not box.exists()
    if os.geteuid() == 0:
        assert seen[-1]["uids"] == [65534] * 4  # switched to nobody, as any compile child
    # Its output and result are where a child started for the job leaves them.
    assert (tmp_path / "k.result.json").read_text().startswith("{")
    assert (tmp_path / "k.log").is_file()
    # The same compile in a child started for it: the same blob size and toolchain.
    cold, _ = sandbox.compile_in_child(
        files, CompileSpec.create(CPU), tmp_path / "cold", "k", timeout_seconds=120
    )
    assert (cold.size_bytes, cold.toolchain) == (result.size_bytes, result.toolchain)


def test_the_child_started_ahead_takes_the_jobs_limits(tmp_path):
    xml = models.save_ir(broadcast_net(16 * 2**20), tmp_path / "m" / "bc.xml")  # a 64 MiB blob
    sandbox.prestart_compile_child(CPU)
    pid = waiting_child().child.pid
    with pytest.raises(errors.BlobTooLarge):
        sandbox.compile_in_child(
            model_files(xml),
            CompileSpec.create(CPU),
            tmp_path / "out",
            "k",
            timeout_seconds=120,
            max_blob_bytes=16 * 2**20,
        )
    assert gone(pid)
    assert list((tmp_path / "out").iterdir()) == []


def test_a_child_started_ahead_runs_no_other_task_and_is_ended():
    identity = compile_identity()
    sandbox.prestart_compile_child(CPU)
    waiting = waiting_child()
    pid, box = waiting.child.pid, waiting.box
    assert not waiting.fits({"task": "reference", "target": "CPU"}, identity)
    assert not waiting.fits({"target": "NPU.4000"}, identity)
    assert waiting.fits({"target": "CPU"}, identity)

    assert sandbox._take_waiting({"task": "reference", "target": "CPU"}, identity) is None

    assert sandbox._WAITING == [] and gone(pid) and not box.exists()


def test_a_child_no_job_takes_ends_when_discarded_or_with_its_parent(tmp_path):
    sandbox.prestart_compile_child(CPU)
    waiting = waiting_child()
    pid, box = waiting.child.pid, waiting.box
    sandbox.discard_prestarted()
    assert gone(pid) and not box.exists()

    # A process that ends without a word (the embedded submit's `os._exit`): its pipe closes,
    # and the child, with no request to read, ends too.
    script = (
        "import os, sys\n"
        "from farm.core.spec import Target\n"
        "from farm.server.jobs import sandbox\n"
        "sandbox.prestart_compile_child(Target.parse('CPU'))\n"
        "print(sandbox._WAITING[0].child.pid, sandbox._WAITING[0].box, flush=True)\n"
        "os._exit(0)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
    )
    pid, box = done.stdout.split()
    assert gone(int(pid)), "the child outlived the process that started it"
    shutil.rmtree(box, ignore_errors=True)  # an abrupt end leaves the empty box behind


def test_a_cancelled_compile_ends_the_child_started_ahead_once(tmp_path, monkeypatch):
    files = model_files(models.save_ir(models.large_net(8), tmp_path / "m" / "big.xml"))
    sandbox.prestart_compile_child(CPU)
    pid = waiting_child().child.pid
    monkeypatch.setattr(sandbox, "POLL_SECONDS", 0.0)  # asked to stop at once
    killed: list[int] = []
    kill = sandbox.kill_group
    monkeypatch.setattr(
        sandbox, "kill_group", lambda group, *rest: (killed.append(group), kill(group, *rest))
    )
    with pytest.raises(errors.CompileCancelled):
        sandbox.compile_in_child(
            files,
            CompileSpec.create(CPU),
            tmp_path / "out",
            "k",
            timeout_seconds=120,
            should_stop=lambda: True,
        )
    # Killed and collected once: a second kill would signal whoever has its pid now.
    assert killed == [pid] and gone(pid) and sandbox._WAITING == []


def test_a_request_bigger_than_a_pipe_reaches_the_child_and_a_child_that_never_reads_is_ended(
    tmp_path, monkeypatch
):
    """The request is written beside the watch: one bigger than the pipe holds (64 KiB) waits
    for the child to read it, and a child stuck before reading it is ended by its time limit."""
    files = model_files(models.save_ir(models.conv_net(), tmp_path / "m" / "conv.xml"))
    identity = compile_identity()
    fields = {
        "target": "CPU",
        "spec": CompileSpec.create(CPU).canonical(),
        "blob_id": "k",
        "memory_bytes": None,
        "max_blob_bytes": None,
        "padding": "x" * (1 << 20),  # unread by the child; 16 pipes' worth
    }
    sandbox.prestart_compile_child(CPU)
    with sandbox._child_in_box(
        files, tmp_path / "out", "k", identity, fields, 120, lambda: False
    ) as run:
        assert (run.returncode, run.timed_out) == (0, False)
        assert (run.box / "k.blob").is_file()

    monkeypatch.setattr(sandbox, "POLL_SECONDS", 0.05)
    monkeypatch.setattr(sandbox, "_start_child", start_stuck_child)
    sandbox.prestart_compile_child(CPU)
    pid = waiting_child().child.pid
    started = time.monotonic()
    with sandbox._child_in_box(
        files, tmp_path / "stuck", "k", identity, fields, 1.0, lambda: False
    ) as run:
        assert run.timed_out
    assert time.monotonic() - started < 30
    assert gone(pid)


def start_stuck_child(box, identity, env, request, result, log, ahead_for=None):
    """`_start_child` for a child stuck before it reads its request (a plugin that hangs as it
    loads): it holds the pipe open and never reads."""
    command = [sys.executable, "-c", "import time; time.sleep(3600)"]
    return subprocess.Popen(command, cwd=box, env=env, stdin=request, stdout=log, process_group=0)
