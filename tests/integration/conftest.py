"""Fixtures of the integration tests that more than one module shares."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from filelock import FileLock

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def edge_venv(tmp_path_factory) -> Path:
    """A fresh virtual environment with `farm[edge]` installed from this checkout (not
    editable), made once per test run: it takes most of a minute. Under pytest-xdist the
    processes share one (the first makes it under a lock, the others wait for it)."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent
    venv = shared / "edge" / "venv"
    with FileLock(str(shared / "edge.lock")):
        if (venv / "ready").exists():
            return venv
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        installed = subprocess.run(
            [str(venv / "bin" / "pip"), "install", "-q", f"{ROOT}[edge]"],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        assert installed.returncode == 0, installed.stderr[-3000:]
        (venv / "ready").touch()
    return venv


def edge_environment(api, served, home: Path, agent_id: str) -> dict[str, str]:
    """What an edge of the served farm holds: the API's URL, a pull token and the workers'
    public key; no farm credentials."""
    return {
        "PATH": os.environ["PATH"],
        "HOME": str(home),
        "FARM_API_URL": api.url,
        "FARM_TOKEN": api.tokens["pull"],
        "FARM_AGENT_ID": agent_id,
        "FARM_TRUSTED_KEYS": served.env["FARM_TRUSTED_KEYS"],
    }


def edge_cli(edge_venv: Path, env: dict[str, str]) -> Callable[..., dict]:
    """`farm ... --json` with the `farm[edge]` venv's own command in `env`: its JSON answer,
    after checking it exited 0."""

    def edge(*args: str) -> dict:
        result = subprocess.run(
            [str(edge_venv / "bin" / "farm"), *args, "--json"],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
            check=False,
        )
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    return edge


def settled_reference(state: Callable[[], str | None], timeout: float = 300) -> str | None:
    """The state of a blob's reference once its run ended (`state()` reads it, for example
    from `farm status KEY --json`): after an embedded submit the run is detached and follows
    the record (docs §6), so a test that reads the stored reference waits for it first."""
    import time

    deadline = time.monotonic() + timeout
    current = state()
    while current == "pending" and time.monotonic() < deadline:
        time.sleep(0.5)
        current = state()
    return current
