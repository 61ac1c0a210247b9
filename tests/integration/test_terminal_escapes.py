"""Text a model controls (an op type quoted in OpenVINO's error) reaches the terminal with its
control characters shown, never obeyed: `farm submit`, `farm status`, `farm jobs` and
`farm logs` print no ESC (0x1b) or CSI (0x9b) byte. The database and ``--json`` keep the raw
text."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

from farm.core.spec import CompileSpec
from tests import hostile

FARM = [sys.executable, "-m", "farm"]
VISIBLE = "\\x1b]52;c;cHduZWQ=\\x07"
"""How the clipboard write shows: as text."""


def farm(home: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FARM_")}
    env.update(FARM_HOME=str(home), FARM_CACHE_DIR=os.environ["FARM_CACHE_DIR"])
    return subprocess.run([*FARM, *args], capture_output=True, env=env, timeout=300, check=False)


def assert_inert(result: subprocess.CompletedProcess[bytes]) -> str:
    """No byte of the output acts on a terminal; returns stdout and stderr as text."""
    for stream in (result.stdout, result.stderr):
        assert b"\x1b" not in stream and b"\x9b" not in stream and b"\x07" not in stream
    return (result.stdout + result.stderr).decode()


class _Quiet:
    def uploading(self, total_bytes: int):
        return contextlib.nullcontext(lambda _count: None)

    def compiling(self, what: str):
        return contextlib.nullcontext()


def test_escapes_in_an_op_type_are_shown_not_obeyed(tmp_path, monkeypatch):
    home = tmp_path / "farm-home"
    xml = hostile.op_type_terminal_escapes(tmp_path / "model")

    submitted = farm(home, "submit", str(xml), "--device", "CPU")
    assert submitted.returncode == 2
    assert VISIBLE in assert_inert(submitted)

    # A job of that model, as an API client that skips the CLI's own check would make it: the
    # worker's compile refuses it, and its error quotes the op type.
    from farm.cli.backends.direct import Direct
    from farm.core.config import Settings
    from farm.core.identity import ModelRef
    from farm.toolchain import host_toolchain

    for name in list(os.environ):
        if name.startswith("FARM_") and name != "FARM_CACHE_DIR":
            monkeypatch.delenv(name)
    spec = CompileSpec.create("CPU")
    direct = Direct.open(Settings(home=home))
    answer = direct.submit(ModelRef.from_path(xml), [spec], host_toolchain(spec.target), _Quiet())
    direct.farm.sessions.kw["bind"].dispose()
    job = answer["results"][0]["job"]
    assert job["state"] == "failed"
    assert hostile.TERMINAL_ESCAPES in job["error"]  # the database keeps the raw text

    raw = json.loads(farm(home, "status", str(job["id"]), "--json").stdout)
    assert hostile.TERMINAL_ESCAPES in raw["error"]  # so does --json (as JSON escapes)

    for args in (["status", str(job["id"])], ["logs", str(job["id"])]):
        result = farm(home, *args)
        assert result.returncode == 0, result.stderr
        assert VISIBLE in assert_inert(result), args
    listed = farm(home, "jobs", "--limit", "1")  # the error, cut to 60 characters, in a table
    assert listed.returncode == 0
    assert_inert(listed)
