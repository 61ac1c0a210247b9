"""The README's quickstart blocks, run as written, so the README cannot drift from the product:
the embedded demo, the served farm (install, database, signing key, worker, API, tokens, a
submitter) and an edge that imports the blob the served worker compiled.

Each block the README marks with ``<!-- readme-test: NAME -->`` is run by bash with `set -euo
pipefail`, from this checkout, with its `.venv` (the installs in the blocks find everything
installed: they cost seconds, not minutes). Only the variables the README's own tools read
point them at this test's services: `scripts/services` takes the ports (FARM_PG_PORT,
FARM_REDIS_PORT, FARM_S3_PORT), a database, a Redis database, a bucket prefix and an API port
of the test's own; `.venv-edge` is the edge environment `edge_venv` made for this session
when the checkout has none. The worker and the API the served block starts in the
background are stopped with the shell's process group.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.conftest import POSTGRES_ADMIN_URL, S3_ENDPOINT_URL

ROOT = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"<!-- readme-test: (?P<name>[\w-]+) -->\n```sh\n(?P<code>.*?)\n```", re.S)
VENV = ROOT / ".venv"

pytestmark = [
    pytest.mark.skipif(
        Path(sys.prefix).resolve() != VENV.resolve(),
        reason="the README's install steps run against this checkout's .venv; run pytest from it",
    ),
    # The blocks install into .venv and write under the checkout (.farm/, demo/): under
    # pytest-xdist they run one at a time, in one process, with scripts/services' own tests.
    pytest.mark.xdist_group("checkout"),
]


def readme_blocks() -> dict[str, str]:
    return {m["name"]: m["code"] for m in BLOCK.finditer((ROOT / "README.md").read_text())}


def run_blocks(names: list[str], env: dict[str, str], timeout: float) -> str:
    """Run the README blocks `names` in one bash (their variables carry over, as in one
    terminal); returns stdout. Everything the shell left running is stopped afterwards."""
    script = "set -euo pipefail\n" + "\n".join(readme_blocks()[name] for name in names)
    # Nothing of the caller's farm settings leaks in, but this test's private client cache.
    inherited = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("FARM_") or k.startswith("FARM_TEST_") or k == "FARM_CACHE_DIR"
    }
    shell = subprocess.Popen(
        ["bash", "-c", script],
        cwd=ROOT,
        env={**inherited, "PATH": f"{VENV / 'bin'}{os.pathsep}{os.environ['PATH']}", **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: the background worker and API too
    )
    try:
        out, err = shell.communicate(timeout=timeout)
    finally:
        _stop_group(shell.pid)
    assert shell.returncode == 0, f"README blocks {names} failed:\n{out[-3000:]}\n{err[-5000:]}"
    return out


def _stop_group(group: int) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(group, sig)
        except ProcessLookupError:
            return
        for _ in range(100):
            try:
                os.killpg(group, 0)
            except ProcessLookupError:
                return
            subprocess.run(["sleep", "0.1"], check=False)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_the_readme_marks_its_quickstart_blocks():
    assert list(readme_blocks()) == ["embedded", "served", "submit", "edge", "admin-sql"]


@pytest.mark.slow
def test_the_embedded_quickstart_runs_as_written(tmp_path):
    out = run_blocks(["embedded"], {"FARM_HOME": str(tmp_path / "demo-home")}, timeout=300)
    assert "succeeded" in out and "hit" in out
    assert (tmp_path / "demo-home" / "farm.db").is_file()  # the demo's farm, not ./.farm


@pytest.mark.slow
def test_the_served_quickstart_and_its_edge_run_as_written(
    redis_url, s3_url, s3_store, edge_venv, tmp_path
):
    database = f"farm_readme_{uuid.uuid4().hex[:12]}"
    redis = urlsplit(redis_url)
    env = {
        "FARM_PG_PORT": str(urlsplit(POSTGRES_ADMIN_URL).port or 5432),
        "FARM_REDIS_PORT": str(redis.port),
        "FARM_S3_PORT": str(urlsplit(S3_ENDPOINT_URL).port),
        "FARM_SERVICES_DATABASE": database,
        "FARM_SERVICES_REDIS_DB": redis.path.lstrip("/"),
        "FARM_SERVICES_S3_PREFIX": s3_url.removeprefix("s3://farm/"),
        "FARM_API_PORT": str(free_port()),
        "FARM_AGENT_ID": "readme-edge",
    }
    schedules_before = set(ROOT.glob("celerybeat-schedule*"))
    edge = ROOT / ".venv-edge"
    linked = not edge.exists()
    if linked:
        edge.symlink_to(edge_venv)
    try:
        out = run_blocks(["served", "submit", "edge", "admin-sql"], env, timeout=600)
    finally:
        if linked:
            edge.unlink()
        _drop(database)
    assert "succeeded" in out  # the worker compiled it
    assert "imported served.blob on CPU" in out, out[-2000:]  # the edge imported and ran it
    assert "{'Result_13': [1, 10]}" in out
    # psql takes the URL the quickstart set (a libpq URL) and counts the blob the worker made.
    assert re.search(r"^ CPU +\| +1$", out, re.M), out[-2000:]
    # `farm worker --beat` keeps Celery beat's schedule under FARM_HOME, not in the checkout.
    assert set(ROOT.glob("celerybeat-schedule*")) == schedules_before


def _drop(database: str) -> None:
    import psycopg
    from sqlalchemy.engine import make_url

    admin = make_url(POSTGRES_ADMIN_URL).set(drivername="postgresql")
    with psycopg.connect(admin.render_as_string(hide_password=False), autocommit=True) as db:
        db.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
