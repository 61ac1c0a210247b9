"""Fixtures of the integration tests that more than one module shares."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def edge_venv(tmp_path_factory) -> Path:
    """A fresh virtual environment with `farm[edge]` installed from this checkout (not
    editable), made once per test session: it takes most of a minute."""
    venv = tmp_path_factory.mktemp("edge") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    installed = subprocess.run(
        [str(venv / "bin" / "pip"), "install", "-q", f"{ROOT}[edge]"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert installed.returncode == 0, installed.stderr[-3000:]
    return venv
