"""Shared fixtures: databases. A test that needs a service skips when it is down, except in
CI (`CI=true`), where a missing service is a failure."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

POSTGRES_ADMIN_URL = os.environ.get(
    "FARM_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)


@pytest.fixture
def openvino_libs_alone() -> Iterator[Path]:
    """This OpenVINO's libs folder, for a test that installs into it or reads what is there:
    such tests take turns, whichever pytest process runs them (a lock file beside the checkout's
    temporary files, never in the folder itself, whose listing the tests compare)."""
    import fcntl
    import hashlib
    import tempfile

    from farm.toolchain import openvino_libs

    libs = openvino_libs()
    name = hashlib.sha256(str(libs.resolve()).encode()).hexdigest()[:16]
    with open(Path(tempfile.gettempdir()) / f"farm-tests-openvino-libs-{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield libs


@pytest.fixture
def file_opens(monkeypatch) -> dict[str, list[int]]:
    """What this test's code asks of `os.open` (its flags) and `os.ftruncate` (its lengths),
    for tests that a file is never opened with O_TRUNC (farm/core/emptied.py)."""
    seen: dict[str, list[int]] = {"flags": [], "truncated": []}
    real_open, real_ftruncate = os.open, os.ftruncate

    def recording_open(path, flags, *args):
        seen["flags"].append(flags)
        return real_open(path, flags, *args)

    def recording_ftruncate(fd, length):
        seen["truncated"].append(length)
        return real_ftruncate(fd, length)

    monkeypatch.setattr(os, "open", recording_open)
    monkeypatch.setattr(os, "ftruncate", recording_ftruncate)
    return seen


@pytest.fixture(autouse=True)
def private_client_cache(tmp_path, monkeypatch) -> None:
    """Digest and edge blob caches of this test's own (never the user's ~/.cache/farm)."""
    monkeypatch.setenv("FARM_CACHE_DIR", str(tmp_path / "client-cache"))


def service_missing(what: str, error: Exception) -> None:
    message = f"{what} is not available: {error}"
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture
def postgres_url() -> Iterator[str]:
    """A fresh PostgreSQL database for this test, dropped afterwards."""
    with fresh_postgres_url() as url:
        yield url


@contextmanager
def fresh_postgres_url() -> Iterator[str]:
    import psycopg
    from sqlalchemy.engine import make_url

    admin = make_url(POSTGRES_ADMIN_URL)
    conninfo = admin.set(drivername="postgresql").render_as_string(hide_password=False)
    name = f"farm_test_{uuid.uuid4().hex[:12]}"
    try:
        with psycopg.connect(conninfo, autocommit=True, connect_timeout=5) as connection:
            connection.execute(f'CREATE DATABASE "{name}"')
    except psycopg.OperationalError as error:
        service_missing("PostgreSQL", error)
    yield admin.set(database=name).render_as_string(hide_password=False)
    with psycopg.connect(conninfo, autocommit=True) as connection:
        connection.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def sqlite_url(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'farm.db'}"


@pytest.fixture(params=["sqlite", "postgres"])
def database_url(request) -> str:
    """Each test using this runs on both dialects."""
    return request.getfixturevalue(f"{request.param}_url")


S3_ENDPOINT_URL = os.environ.get("FARM_TEST_S3_ENDPOINT_URL", "http://127.0.0.1:8333")
S3_CREDENTIALS = {"access_key_id": "farm", "secret_access_key": "farm-secret"}
REDIS_URL = os.environ.get("FARM_TEST_REDIS_URL", "redis://127.0.0.1:6390")


@pytest.fixture
def s3_url() -> str:
    """A storage URL with a prefix of its own in the test bucket."""
    return f"s3://farm/test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def s3_store(s3_url):
    from farm.server.storage import StorageError
    from farm.server.storage.s3 import S3Settings, S3Store

    store = S3Store(S3Settings.from_url(s3_url, endpoint_url=S3_ENDPOINT_URL, **S3_CREDENTIALS))
    try:
        store.check()
    except StorageError as error:
        service_missing("SeaweedFS (scripts/services up)", error)
    return store


def _redis_dbs() -> Iterator[int]:
    """Redis database numbers 1..15 (0 is the benchmarks'), split between pytest-xdist's
    processes so two tests running at once never share one; each process runs one test at a
    time and takes its numbers in turn (a test may hold two at once, a worker and its edge's)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    processes = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(worker.removeprefix("gw") or 0)
    per_process = 15 // max(1, min(processes, 5))
    first = 1 + (index % 5) * per_process
    while True:
        yield from range(first, first + per_process)


_REDIS_DBS = _redis_dbs()


def _next_redis_db() -> int:
    return next(_REDIS_DBS)


@pytest.fixture
def redis_url() -> Iterator[str]:
    """A Redis database number of its own, flushed before and after."""
    with fresh_redis_url() as url:
        yield url


@contextmanager
def fresh_redis_url() -> Iterator[str]:
    import redis

    client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2)
    try:
        client.ping()
    except redis.ConnectionError as error:
        service_missing("Redis (scripts/services up)", error)
    number = _next_redis_db()
    db = redis.Redis.from_url(f"{REDIS_URL}/{number}")
    db.flushdb()
    yield f"{REDIS_URL}/{number}"
    db.flushdb()
    client.close()
    db.close()


@pytest.fixture
def served_env(tmp_path, postgres_url, redis_url, s3_url, s3_store) -> dict[str, str]:
    """Environment of a served farm with its own database, Redis db number and bucket prefix,
    and a signing key its workers sign with and its edges trust."""
    return served_environment(tmp_path, postgres_url, redis_url, s3_url)


def served_environment(tmp_path: Path, postgres_url: str, redis_url: str, s3_url: str) -> dict:
    from farm.core.signing import create_key_pair

    signing_key = tmp_path / "keys" / "worker.pem"
    public_key, _ = create_key_pair(signing_key)
    return {
        "FARM_SIGNING_KEY": str(signing_key),
        "FARM_TRUSTED_KEYS": str(public_key),
        "FARM_HOME": str(tmp_path / "farm-home"),
        "FARM_DATABASE_URL": postgres_url,
        "FARM_BROKER_URL": redis_url,
        "FARM_STORAGE_URL": s3_url,
        "FARM_S3_ENDPOINT_URL": S3_ENDPOINT_URL,
        "FARM_S3_ACCESS_KEY_ID": S3_CREDENTIALS["access_key_id"],
        "FARM_S3_SECRET_ACCESS_KEY": S3_CREDENTIALS["secret_access_key"],
        "FARM_LEASE_SECONDS": "3",
        "FARM_WORKER_HEARTBEAT_SECONDS": "1",
        "FARM_METRICS_CACHE_SECONDS": "0",  # tests read the numbers right after a change
        "FARM_TOKEN_CACHE_SECONDS": "0",  # and revoke a token in one process, then use it
    }


@pytest.fixture
def served(tmp_path, served_env):
    from tests.integration.served import ServedFarm

    logs = tmp_path / "logs"
    logs.mkdir()
    farm = ServedFarm(served_env, logs)
    yield farm
    farm.stop()


@pytest.fixture
def api_env(served) -> dict[str, str]:
    """The environment `api` runs with (a test module may override this fixture)."""
    return served.env


@pytest.fixture
def api(served, api_env, tmp_path):
    """The served farm's HTTP API, and a token per role: `api.tokens["pull"]`, ..."""
    from farm.server.tokens import create_token
    from tests.integration.served import ApiServer

    server = ApiServer(api_env, tmp_path / "logs" / "api.log").start()
    with served.sessions() as session:
        server.tokens = {
            role: create_token(session, f"test-{role}", role)
            for role in ("pull", "submit", "admin")
        }
    yield server
    server.stop()
