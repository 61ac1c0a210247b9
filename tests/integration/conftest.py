"""Fixtures of the integration tests that more than one module shares."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
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
