"""`scripts/services up` uses an S3 it finds on its port only when that S3 takes the farm's
access key and has its bucket; anything else on the port stops it with a message naming
FARM_S3_PORT (it used to report success, and `farm doctor` failed later).

Runs against the services already up (the shared PostgreSQL and SeaweedFS, this run's Redis):
`up` only checks them, and starts or stops nothing of theirs.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.conftest import POSTGRES_ADMIN_URL, REDIS_URL, S3_ENDPOINT_URL
from tests.integration.served import wait_until

ROOT = Path(__file__).resolve().parents[2]

# scripts/services keeps its state under the checkout (.farm/services): one process at a time
# under pytest-xdist, with the README blocks that run it too.
pytestmark = pytest.mark.xdist_group("checkout")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def services_up(s3_port: int) -> subprocess.CompletedProcess:
    ports = {
        "FARM_PG_PORT": str(urlsplit(POSTGRES_ADMIN_URL).port or 5432),
        "FARM_REDIS_PORT": str(urlsplit(REDIS_URL).port or 6379),
        "FARM_S3_PORT": str(s3_port),
    }
    return subprocess.run(
        [str(ROOT / "scripts" / "services"), "up"],
        env={**os.environ, **ports},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.fixture
def services_running(postgres_url, redis_url, s3_store) -> None:
    """Skips (or fails in CI) when the services `up` would otherwise start are down."""


def test_up_refuses_a_server_on_the_s3_port_that_is_not_our_s3(services_running, tmp_path):
    port = free_port()
    foreign = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until(lambda: _answers(port), timeout=20, what="the foreign server")
        result = services_up(port)
    finally:
        foreign.terminate()
        foreign.wait()
    assert result.returncode == 1, result.stderr
    assert f"127.0.0.1:{port} answers, but not as an S3" in result.stderr
    assert "FARM_S3_PORT" in result.stderr
    assert "export" not in result.stdout  # no environment for a farm that would not work


def test_up_accepts_the_s3_that_takes_the_farm_credentials(services_running):
    port = urlsplit(S3_ENDPOINT_URL).port
    result = services_up(port)
    assert result.returncode == 0, result.stderr
    assert f"FARM_TEST_S3_ENDPOINT_URL=http://127.0.0.1:{port}" in result.stdout
    assert "started" not in result.stderr  # found all three running: started nothing


def _answers(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0
