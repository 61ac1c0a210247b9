"""`scripts/chromium` (run by scripts/test): it says before it installs a system package, asks
first on a terminal, and a "no" skips the browser test with a message. Run with bash against a
PATH of stand-ins (`apt-get` records its calls, `id` says root), so nothing is installed."""

from __future__ import annotations

import os
import pty
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "chromium"


@pytest.fixture
def stand_ins(tmp_path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in {
        "apt-get": f'echo "apt-get $*" >> "{tmp_path}/apt.log"; echo "apt-get ran" >&2',
        "id": "echo 0",
    }.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return bin_dir


def run(stand_ins: Path, *, terminal_answer: str | None = None, ci: bool = False):
    env = {"PATH": str(stand_ins), **({"CI": "true"} if ci else {})}
    if terminal_answer is None:
        return subprocess.run(
            ["/bin/bash", str(SCRIPT)],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            env=env,
            timeout=30,
            check=True,
        )
    main, follower = pty.openpty()
    try:
        os.write(main, terminal_answer.encode() + b"\n")
        return subprocess.run(
            ["/bin/bash", str(SCRIPT)],
            stdin=follower,
            capture_output=True,
            text=True,
            env=env,
            timeout=30,
            check=True,
        )
    finally:
        os.close(main)
        os.close(follower)


def installs(stand_ins: Path) -> list[str]:
    log = stand_ins.parent / "apt.log"
    return log.read_text().splitlines() if log.exists() else []


def test_without_a_terminal_it_says_so_then_installs(stand_ins):
    result = run(stand_ins)
    said = "scripts/test: installing the system package chromium with apt-get"
    assert result.stderr.index(said) < result.stderr.index("apt-get ran")
    assert installs(stand_ins) == ["apt-get update -qq", "apt-get install -y -qq chromium"]


def test_on_a_terminal_a_no_skips_the_browser_test_and_installs_nothing(stand_ins):
    result = run(stand_ins, terminal_answer="n")
    assert "Install it with apt-get now? [y/N]" in result.stderr
    assert "not installing chromium: the dashboard's browser test will be skipped" in result.stderr
    assert installs(stand_ins) == []


def test_on_a_terminal_a_yes_installs(stand_ins):
    run(stand_ins, terminal_answer="y")
    assert installs(stand_ins)[-1] == "apt-get install -y -qq chromium"


def test_in_ci_it_installs_without_asking(stand_ins):
    result = run(stand_ins, terminal_answer="", ci=True)
    assert "[y/N]" not in result.stderr
    assert installs(stand_ins)[-1] == "apt-get install -y -qq chromium"
