"""Start-up of the read-only commands (issues 17 and 30): `farm jobs`, `farm blobs` and
`farm status KEY` on the embedded farm and through the API, against a bare Python process that
imports only the libraries that path must have, measured side by side in one run.

"Before" is the code of a baseline commit (`FARM_BENCH_STARTUP_BASELINE`, default the commit
before issue 30's read path without the ORM and pydantic), checked out into a scratch worktree
and run by the same interpreter with that worktree first on PYTHONPATH: same Python, same
libraries, same farm home, only farm's own code differs. "After" is this checkout. "API" is this
checkout with FARM_API_URL set, talking to `farm api` on the same embedded farm. "Bare" is
`python -c "import click, sqlalchemy, sqlite3"` (what the embedded path cannot do without) and
`python -c "import click, httpx"` (the API path's).

Each measurement is the wall time of a fresh process, interleaved run by run across all the
ways (and the order rotated each run, so no way always follows another), so the noise of a
shared machine hits all of them; each figure is the median of its runs.

Target (issue 30, item 4): each read command costs at most 1.5x + 50 ms of its path's bare
process.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from .common import REPO, RUNS, comparison, log, scaled, scratch, stats, target, write_result

NAME = "startup"
BASELINE = os.environ.get("FARM_BENCH_STARTUP_BASELINE", "7f9dcbf")
"""The commit before issue 30's light read path (the ORM, pydantic and every command's module
loaded by every read command)."""
COMMANDS = {"farm jobs": ["jobs"], "farm blobs": ["blobs"], "farm status KEY": ["status"]}
BARE = {
    "embedded": "import click, sqlalchemy, sqlite3",
    "API": "import click, httpx",
}
"""What each path must import: the floor a read command is compared with."""
BARE_FACTOR, BARE_PLUS_MS = 1.5, 50.0


def farm_env(home: Path, code: Path | None, **extra: str) -> dict[str, str]:
    """An environment with nothing of the caller's FARM_ settings; `code`: the checkout first on
    PYTHONPATH (None: this one, as installed)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FARM_")}
    env["FARM_HOME"] = str(home)
    env["PYTHONPATH"] = str(code or REPO)
    env.update(extra)
    return env


def run_farm(env: dict[str, str], *args: str) -> tuple[float, str]:
    """`python -m farm ARGS`, from the farm home's folder: a child started in a checkout would
    import that checkout's farm (the current folder comes first on sys.path), not PYTHONPATH's."""
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "farm", *args],
        env=env,
        cwd=Path(env["FARM_HOME"]).parent,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"farm {' '.join(args)} exited {done.returncode}: {done.stderr}")
    return elapsed, done.stdout


def start_api(env: dict[str, str], port: int, log_path: Path) -> subprocess.Popen:
    import httpx

    with open(log_path, "ab") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "farm", "api", "--port", str(port)],
            env=env,
            cwd=Path(env["FARM_HOME"]).parent,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"farm api exited: {log_path.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return process
        except httpx.TransportError:
            time.sleep(0.2)
    raise RuntimeError("farm api did not answer within 60 s")


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> dict:
    from tests import models

    with scratch(NAME) as root:
        home = root / "home"
        baseline_code = root / "baseline"
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(baseline_code), BASELINE],
            cwd=REPO,
            check=True,
            capture_output=True,
        )
        api = None
        try:
            xml = models.save_ir(models.conv_net(), root / "model" / "conv.xml")
            after = farm_env(home, None)
            submitted = json.loads(run_farm(after, "submit", str(xml), "-d", "CPU", "--json")[1])
            key = submitted["cache_key"]
            token = run_farm(after, "token", "create", "--name", "bench", "--role", "submit")[1]
            port = free_port()
            api = start_api(after, port, root / "api.log")
            ways = {
                "before": farm_env(home, baseline_code),
                "after": after,
                "API": farm_env(
                    home,
                    None,
                    FARM_API_URL=f"http://127.0.0.1:{port}",
                    FARM_TOKEN=token.strip(),
                ),
            }
            seconds: dict[str, dict[str, list[float]]] = {
                command: {way: [] for way in ways} for command in COMMANDS
            }
            python_alone: list[float] = []
            bare: dict[str, list[float]] = {path: [] for path in BARE}
            runs = scaled(max(RUNS, 15), 1)
            for env in ways.values():  # warm the page cache and the .pyc files
                for command, args in COMMANDS.items():
                    run_farm(env, *args, *([key] if command.endswith("KEY") else []))

            def python(code: str, into: list[float]) -> None:
                started = time.perf_counter()
                subprocess.run([sys.executable, "-c", code], check=True)
                into.append(time.perf_counter() - started)

            def farm(command: str, way: str) -> None:
                full = [*COMMANDS[command], *([key] if command.endswith("KEY") else [])]
                seconds[command][way].append(run_farm(ways[way], *full)[0])

            tasks = [lambda: python("pass", python_alone)]
            tasks += [functools.partial(python, code, bare[path]) for path, code in BARE.items()]
            tasks += [functools.partial(farm, c, w) for c in COMMANDS for w in ways]
            for run in range(runs):
                log(f"run {run + 1}/{runs}")
                turn = run % len(tasks)
                for task in tasks[turn:] + tasks[:turn]:
                    task()
        finally:
            if api is not None:
                os.killpg(api.pid, signal.SIGTERM)
                api.wait(timeout=30)
            subprocess.run(
                ["git", "worktree", "remove", "--force", str(baseline_code)],
                cwd=REPO,
                check=False,
                capture_output=True,
            )

    medians = {
        command: {way: statistics.median(runs) * 1000 for way, runs in by_way.items()}
        for command, by_way in seconds.items()
    }
    bare_ms = {path: statistics.median(runs) * 1000 for path, runs in bare.items()}
    comparisons = []
    targets = []
    for command, by_way in medians.items():
        for way, path in (("after", "embedded"), ("API", "API")):
            comparisons.append(
                comparison(
                    f"{command}, {path}",
                    f"bare `{BARE[path]}`",
                    bare_ms[path],
                    by_way[way],
                    "ms",
                )
            )
            targets.append(
                target(
                    f"{command}, {path} <= {BARE_FACTOR}x bare + {BARE_PLUS_MS:g} ms",
                    by_way[way],
                    BARE_FACTOR * bare_ms[path] + BARE_PLUS_MS,
                    unit="ms",
                )
            )
        comparisons.append(
            comparison(
                f"{command}, embedded",
                f"before ({BASELINE})",
                by_way["before"],
                by_way["after"],
                "ms",
            )
        )
        comparisons.append(
            comparison(
                f"{command}, embedded vs the API", "API", by_way["API"], by_way["after"], "ms"
            )
        )
    return {
        "title": "a fresh `python -m farm` process per command, embedded farm with 1 job",
        "comparisons": comparisons,
        "milliseconds": {
            command: {way: stats([s * 1000 for s in runs]) for way, runs in by_way.items()}
            for command, by_way in seconds.items()
        },
        "python_alone_ms": stats([s * 1000 for s in python_alone]),
        "bare_ms": {path: stats([s * 1000 for s in runs]) for path, runs in bare.items()},
        "baseline_commit": BASELINE,
        "runs_per_measurement": runs,
        "targets": targets,
        "notes": (
            "before: the baseline commit's farm code, same interpreter and libraries; after: "
            "this checkout; API: this checkout through `farm api` on the same farm; bare: "
            "a process importing only what the path must have. "
            "`python -c pass` is the interpreter's own start, for scale."
        ),
    }


if __name__ == "__main__":
    write_result(NAME, main())
