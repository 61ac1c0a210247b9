"""The edges of the served API and its operators' commands: no password in any answer, output
or log; `since` at the edge of the calendar; a client that leaves mid-upload; readiness that
reuses the process's clients; slow clients cut off."""

from __future__ import annotations

import hashlib
import re
import select
import socket
import time

import httpx
import pytest

from farm.server.storage import model_storage_key
from tests.integration.faults import free_port
from tests.integration.served import ApiServer, wait_until

SECRETS = ("pg-pass-7f3a9", "redis-pass-91bc4", "s3-url-pass-c0de5", "farm-secret")
"""The database, broker and S3 endpoint passwords, and the S3 secret key of the served env."""


def with_passwords(env: dict[str, str], *, reachable: bool = True) -> dict[str, str]:
    """`env` with a password in every URL (PostgreSQL here trusts, Redis has none set: both
    accept any), or with every service on a closed port (`reachable=False`)."""
    from sqlalchemy.engine import make_url

    database = make_url(env["FARM_DATABASE_URL"]).set(password=SECRETS[0])
    broker = env["FARM_BROKER_URL"].replace("redis://", f"redis://:{SECRETS[1]}@", 1)
    endpoint = env["FARM_S3_ENDPOINT_URL"].replace("http://", f"http://farm:{SECRETS[2]}@", 1)
    if not reachable:
        database = database.set(port=free_port())
        broker = re.sub(r":\d+/", f":{free_port()}/", broker)
        endpoint = re.sub(r":\d+$", f":{free_port()}", endpoint)
    return {
        **env,
        "FARM_DATABASE_URL": database.render_as_string(hide_password=False),
        "FARM_BROKER_URL": broker,
        "FARM_S3_ENDPOINT_URL": endpoint,
    }


def assert_no_secret(*texts: str) -> None:
    for text in texts:
        for secret in SECRETS:
            assert secret not in text


def test_no_password_in_readyz_doctor_worker_start_or_logs(served, tmp_path):
    working = with_passwords(served.env)
    api = ApiServer(working, tmp_path / "api.log").start()
    try:
        ready = httpx.get(f"{api.url}/readyz", timeout=30)
        assert ready.status_code == 200 and ready.json()["ready"] is True
        assert ready.json()["checks"]["broker"].startswith("redis://:***@127.0.0.1:")
        assert_no_secret(ready.text)
    finally:
        api.stop()
    doctor = served.farm("doctor", env=working)
    assert doctor.returncode == 0, doctor.stderr
    upgrade = served.farm("db", "upgrade", env=working)
    assert "postgresql+psycopg://postgres:***@127.0.0.1:" in upgrade.stdout
    as_json = served.farm("doctor", "--json", env=working).stdout
    assert_no_secret(doctor.stdout, doctor.stderr, upgrade.stdout, upgrade.stderr, as_json)

    down = with_passwords(served.env, reachable=False)
    api = ApiServer(down, tmp_path / "api-down.log").start()
    try:
        answer = httpx.get(f"{api.url}/readyz", timeout=120)
        assert answer.status_code == 503 and answer.json()["ready"] is False
        checks = answer.json()["checks"]
        assert checks["database"].startswith("cannot reach the database postgresql+psycopg://")
        assert checks["broker"].startswith("cannot reach the broker redis://:***@127.0.0.1:")
        assert checks["storage"].startswith("cannot reach S3 at http://127.0.0.1:")
        assert_no_secret(answer.text)
    finally:
        api.stop()
    outputs = []
    for args in (["doctor"], ["doctor", "--json"], ["worker"], ["db", "upgrade"]):
        result = served.farm(*args, env=down, check=False)
        assert result.returncode == 5, (args, result.stderr)
        outputs += [result.stdout, result.stderr]
    assert "cannot reach the broker redis://:***@" in outputs[5]  # farm worker's one line
    assert_no_secret(
        *outputs, (tmp_path / "api.log").read_text(), (tmp_path / "api-down.log").read_text()
    )


@pytest.mark.parametrize("since", ["0001-01-01T00:00:00+14:00", "9999-12-31T23:59:59-14:00"])
def test_since_at_the_edge_of_the_calendar_is_refused_with_a_422(served, api, since):
    client = httpx.Client(
        base_url=api.url, headers={"Authorization": f"Bearer {api.tokens['submit']}"}
    )
    refused = client.get("/v1/jobs", params={"since": since})
    assert refused.status_code == 422
    assert refused.json()["code"] == "invalid_request"
    assert refused.json()["message"].startswith(f"since: {since} is outside the dates")
    assert client.get("/v1/jobs", params={"since": "2020-01-01T00:00:00+14:00"}).json() == []
    client.close()


def test_cli_since_at_the_edge_of_the_calendar_over_http_and_direct(served, api):
    over_http = {"FARM_API_URL": api.url, "FARM_TOKEN": api.tokens["submit"]}
    for env in (over_http, None):
        for since in ("0001-01-01", "9999-12-31 23:59:59"):
            assert served.farm_json("jobs", "--since", since, env=env) == []
        zoned = served.farm("jobs", "--since", "0001-01-01T00:00:00+14:00", env=env, check=False)
        assert zoned.returncode == 2 and "'--since'" in zoned.stderr


def test_a_client_that_leaves_mid_upload_logs_one_line_and_nothing_is_stored(served, api):
    sha = hashlib.sha256(b"never sent whole").hexdigest()
    declared, sent = 40 << 20, 20 << 20  # past the first 16 MiB part: a multipart upload began
    with socket.create_connection(("127.0.0.1", api.port)) as connection:
        connection.sendall(
            f"PUT /v1/models/{sha} HTTP/1.1\r\nHost: farm\r\n"
            f"Authorization: Bearer {api.tokens['submit']}\r\n"
            f"Content-Type: application/octet-stream\r\nContent-Length: {declared}\r\n\r\n".encode()
        )
        chunk = b"\xa5" * (1 << 20)
        for _ in range(sent // len(chunk)):
            connection.sendall(chunk)
    line = "the client went away; nothing stored"
    wait_until(lambda: api.requests_logged(line) == 1, 60, "the disconnect to be logged")
    store = served.store

    def no_upload_left() -> bool:
        listing = store.client.list_multipart_uploads(
            Bucket=store.bucket, Prefix=store.settings.prefix
        )
        return not listing.get("Uploads")

    wait_until(no_upload_left, 30, "the multipart upload to be aborted")
    time.sleep(1)  # anything else the server would log about it
    log = api.log.read_text()
    assert log.count(line) == 1
    assert f"INFO:     upload of model file {sha} stopped: {line}" in log
    assert "Traceback" not in log and "ERROR" not in log
    assert not store.exists(model_storage_key(sha))


def test_readyz_reuses_one_engine_store_and_broker_connection(served, monkeypatch):
    """With the cache off, each call checks every service, through the app's own database pool,
    boto3 client and broker connection: none is made anew."""
    import asyncio

    import boto3
    import redis
    from sqlalchemy import event
    from sqlalchemy.pool import Pool

    from farm.server.api.app import create_app

    connects, clients = [], []
    real_client = boto3.client

    def counting_client(*args, **kwargs):
        clients.append(args)
        return real_client(*args, **kwargs)

    def on_connect(*_):
        connects.append(1)

    monkeypatch.setattr(boto3, "client", counting_client)
    event.listen(Pool, "connect", on_connect)
    broker = redis.Redis.from_url(served.env["FARM_BROKER_URL"])
    number = int(served.env["FARM_BROKER_URL"].rsplit("/", 1)[1])

    def broker_clients() -> set[str]:
        return {c["id"] for c in broker.client_list() if int(c["db"]) == number}

    app = create_app(served.settings.model_copy(update={"readyz_cache_seconds": 0}))

    async def probe() -> None:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://farm") as client:
                assert (await client.get("/readyz")).json()["ready"] is True
                before = (len(connects), len(clients), broker_clients())
                answers = [await client.get("/readyz") for _ in range(20)]
                assert [a.status_code for a in answers] == [200] * 20
                assert (len(connects), len(clients)) == before[:2]
                assert broker_clients() == before[2]  # the same connections, kept
            app.state.farm.sessions.kw["bind"].dispose()

    try:
        asyncio.run(probe())
    finally:
        event.remove(Pool, "connect", on_connect)
        broker.close()


@pytest.fixture
def impatient_api(served, tmp_path):
    env = {
        **served.env,
        "FARM_API_HEADER_TIMEOUT_SECONDS": "2",
        "FARM_API_BODY_TIMEOUT_SECONDS": "2",
    }
    server = ApiServer(env, tmp_path / "impatient.log").start()
    from farm.server.tokens import create_token

    with served.sessions() as session:
        server.tokens = {"submit": create_token(session, "impatient", "submit")}
    yield server
    server.stop()


def _closed_after(connection: socket.socket, drip: bytes | None, limit: float):
    """Seconds until the server closes `connection` (sending `drip` every 0.5 s meanwhile),
    and what it answered before closing."""
    started, answer = time.monotonic(), b""
    while time.monotonic() - started < limit:
        readable, _, _ = select.select([connection], [], [], 0.5)
        if readable:
            try:
                data = connection.recv(65536)
            except ConnectionResetError:
                data = b""
            if not data:
                return time.monotonic() - started, answer
            answer += data
        elif drip:
            try:
                connection.sendall(drip)
            except (BrokenPipeError, ConnectionResetError):
                return time.monotonic() - started, answer
    raise AssertionError(f"the server kept the connection for {limit} s")


def test_slow_clients_are_cut_off(impatient_api):
    port = impatient_api.port
    # A head that never completes, one header a half second (slowloris).
    with socket.create_connection(("127.0.0.1", port)) as slow_head:
        slow_head.sendall(b"GET /healthz HTTP/1.1\r\nHost: farm\r\n")
        seconds, answer = _closed_after(slow_head, b"X-Drip: 1\r\n", 15)
        assert 1.5 < seconds < 5 and answer == b""

    # A body that stops, and one dripped a byte at a time: 408, then the connection closes.
    for drip in (None, b"x"):
        with socket.create_connection(("127.0.0.1", port)) as slow_body:
            slow_body.sendall(
                b"POST /v1/models/missing HTTP/1.1\r\nHost: farm\r\n"
                b'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"sha256": '
            )
            seconds, answer = _closed_after(slow_body, drip, 15)
            assert 1.5 < seconds < 5
            assert answer.startswith(b"HTTP/1.1 408 ") and b"FARM_API_BODY_TIMEOUT" in answer

    # An upload that stalls: 408, and nothing stored.
    sha = hashlib.sha256(b"stalled").hexdigest()
    with socket.create_connection(("127.0.0.1", port)) as stalled:
        stalled.sendall(
            f"PUT /v1/models/{sha} HTTP/1.1\r\nHost: farm\r\n"
            f"Authorization: Bearer {impatient_api.tokens['submit']}\r\n"
            "Content-Type: application/octet-stream\r\nContent-Length: 1000\r\n\r\n".encode()
            + b"x" * 10
        )
        seconds, answer = _closed_after(stalled, None, 15)
        assert 1.5 < seconds < 5 and answer.startswith(b"HTTP/1.1 408 ")

    # A client that is not slow is not disturbed: keep-alive, several requests.
    with httpx.Client(base_url=impatient_api.url) as client:
        assert [client.get("/healthz").status_code for _ in range(3)] == [200] * 3
    log = impatient_api.log.read_text()
    assert "Traceback" not in log and "ERROR" not in log
