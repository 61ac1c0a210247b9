"""No one client exhausts the farm (issue 25): each bound an admin sets, met through a real API
process (uvicorn), PostgreSQL, Redis and S3, answered with the error naming its setting.

Also here: presigned URLs that never outlive the token that asked for them, and a matrix an
API killed mid-submission leaves wholly unrecorded.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime, timedelta
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
import redis
from sqlalchemy import func, select

from farm.client import FarmClient
from farm.core.clock import now
from farm.server.db.models import Blob, Job, Verification
from farm.server.storage import blob_storage_key
from farm.server.tokens import create_token
from tests.integration.served import ApiServer
from tests.unit.conftest import TOOLCHAIN, add_model, key

LIMITS = {
    "FARM_MAX_CONCURRENT_UPLOADS": "4",
    "FARM_MAX_UPLOADS_PER_TOKEN": "2",
    "FARM_API_BODY_TIMEOUT_SECONDS": "3",
    "FARM_API_UPLOAD_MIN_BYTES_PER_SECOND": "1000",
    "FARM_MAX_QUEUED_JOBS_PER_SUBMITTER": "4",
    "FARM_MAX_QUEUES_PER_SUBMITTER": "2",
    "FARM_MAX_STORED_BYTES_PER_SUBMITTER": "200000",
    "FARM_MAX_REPORT_BYTES": "4096",
    "FARM_MAX_REPORTS_PER_BLOB": "3",
    "FARM_MAX_REPORTS_PER_AGENT": "2",
    "FARM_PRESIGN_SECONDS": "600",
}


@pytest.fixture
def limited(served, tmp_path):
    server = ApiServer({**served.env, **LIMITS}, tmp_path / "api.log").start()
    with served.sessions() as session:
        server.tokens = {
            name: create_token(session, name, role)
            for name, role in (("dripper", "submit"), ("other", "submit"), ("edge", "pull"))
        }
    yield server
    server.stop()


def _headers(api, name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {api.tokens[name]}"}


def _upload(api, name: str, data: bytes) -> httpx.Response:
    return httpx.put(
        f"{api.url}/v1/models/{hashlib.sha256(data).hexdigest()}",
        content=data,
        headers={**_headers(api, name), "Content-Type": "application/octet-stream"},
        timeout=30,
    )


def _drip(api, token: str, size: int, answers: list, every: float = 1.0) -> None:
    """An upload of `size` bytes announced, then sent one byte every `every` s (always in time
    for the per-piece timeout); appends (status line, seconds it was held)."""
    digest = hashlib.sha256(os.urandom(8)).hexdigest()
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", api.port), timeout=60) as sock:
        sock.sendall(
            (
                f"PUT /v1/models/{digest} HTTP/1.1\r\nHost: x\r\n"
                f"Authorization: Bearer {token}\r\nContent-Type: application/octet-stream\r\n"
                f"Content-Length: {size}\r\n\r\n"
            ).encode()
        )
        sock.settimeout(every)
        answer = b""
        for _ in range(size):
            try:
                answer = sock.recv(4096)
                break  # answered (refused, or cut off)
            except TimeoutError:
                pass
            try:
                sock.sendall(b"x")
            except OSError:
                break
        sock.settimeout(30)
        # The answer's head and body, until the server closes; a byte sent after the server's
        # answer makes its close a reset, which ends the answer as well.
        with contextlib.suppress(ConnectionResetError):
            while more := sock.recv(4096):
                answer += more
    answers.append((answer.split(b"\r\n")[0].decode(), answer, time.monotonic() - start))


def test_dripping_clients_cannot_hold_the_upload_slots(limited, tmp_path):
    answers: list = []
    drippers = [
        threading.Thread(target=_drip, args=(limited, limited.tokens["dripper"], 5000, answers))
        for _ in range(4)
    ]
    for thread in drippers:
        thread.start()
    time.sleep(2)
    # Two of the four hold this token's share; another token still uploads at once.
    other = _upload(limited, "other", b"another client's model file")
    assert other.status_code == 201, other.text
    # The dripping token's own client waits for its share (429, Retry-After) and gets in.
    model = tmp_path / "model.bin"
    model.write_bytes(os.urandom(10_000))
    with FarmClient(limited.url, limited.tokens["dripper"]) as client:
        digest = hashlib.sha256(model.read_bytes()).hexdigest()
        assert client.upload(digest, model) == {"sha256": digest, "stored": True}
    for thread in drippers:
        thread.join(60)
    statuses = sorted(status for status, _, _ in answers)
    assert statuses == ["HTTP/1.1 408 Request Timeout"] * 2 + ["HTTP/1.1 429 Too Many Requests"] * 2
    refused = [body for status, body, _ in answers if " 429 " in status]
    assert b"too_many_uploads_for_token" in refused[0]
    assert b"FARM_MAX_UPLOADS_PER_TOKEN=2" in refused[0]
    cut = [(body, held) for status, body, held in answers if " 408 " in status]
    for body, held in cut:
        assert b"FARM_API_UPLOAD_MIN_BYTES_PER_SECOND=1000" in body
        # The deadline: 3 s + 5000 bytes at 1000 bytes/s = 8 s (dripping all would take 5000 s).
        assert 7 < held < 20, held
    assert limited.process.poll() is None


def _store_model(api) -> dict[str, str]:
    files = {"xml": b"<net/>" + os.urandom(16), "bin": os.urandom(64)}
    for data in files.values():
        assert _upload(api, "dripper", data).status_code == 201
    return {role: hashlib.sha256(data).hexdigest() for role, data in files.items()}


def _submit(api, model: dict[str, str], batches, runtime: str = "x") -> httpx.Response:
    body = {
        "model": model,
        "model_name": "m.xml",
        "specs": [{"target": "CPU", "batch": b} for b in batches],
        "toolchain": {"openvino": TOOLCHAIN.openvino, "runtime_requirements": runtime},
    }
    return httpx.post(
        f"{api.url}/v1/submissions", json=body, headers=_headers(api, "dripper"), timeout=30
    )


def test_a_submitter_cannot_fill_the_broker_with_jobs_or_queues(served, limited):
    model = _store_model(limited)
    broker = redis.Redis.from_url(served.env["FARM_BROKER_URL"])

    def queued_messages() -> int:
        return sum(broker.llen(name) for name in broker.keys("compile.*"))

    assert _submit(limited, model, [1, 2]).status_code == 200
    too_many = _submit(limited, model, [3, 4, 5])  # 2 + 3 > 4: refused whole
    assert too_many.status_code == 429 and too_many.headers["Retry-After"] == "30"
    assert too_many.json()["code"] == "too_many_queued_jobs"
    assert "FARM_MAX_QUEUED_JOBS_PER_SUBMITTER=4" in too_many.json()["message"]
    assert too_many.json()["details"] == {
        "setting": "FARM_MAX_QUEUED_JOBS_PER_SUBMITTER",
        "limit": 4,
    }
    assert served.count(Job) == 2 and queued_messages() == 2

    # Toolchains no worker has: each is a queue in Redis. A second is allowed, not a third.
    assert _submit(limited, model, [1], runtime="invented-1").status_code == 200
    new_queue = _submit(limited, model, [1], runtime="invented-2")
    assert new_queue.status_code == 429 and new_queue.json()["code"] == "too_many_queues"
    assert "FARM_MAX_QUEUES_PER_SUBMITTER=2" in new_queue.json()["message"]
    assert served.count(Job) == 3 and queued_messages() == 3
    assert len(broker.keys("compile.*")) == 2


def test_stored_bytes_have_a_quota_per_submitter(served, limited):
    first = os.urandom(120_000)
    assert _upload(limited, "dripper", first).status_code == 201
    second = os.urandom(100_000)  # 220000 > 200000
    refused = _upload(limited, "dripper", second)
    assert refused.status_code == 413
    assert refused.json()["code"] == "storage_quota_exceeded"
    assert "FARM_MAX_STORED_BYTES_PER_SUBMITTER=200000" in refused.json()["message"]
    assert not served.store.exists(f"models/{hashlib.sha256(second).hexdigest()}")
    assert _upload(limited, "other", second).status_code == 201  # the quota is per token
    assert _upload(limited, "dripper", first).json() == {  # stored already: costs nothing
        "sha256": hashlib.sha256(first).hexdigest(),
        "stored": False,
    }


def _blob(served, tmp_path, n: int = 1) -> Blob:
    """A blob row and its object in the bucket."""
    data = f"blob {n}".encode()
    source = tmp_path / f"blob-{n}"
    source.write_bytes(data)
    served.store.put_file(blob_storage_key(key(n)), source)
    model = add_model(_Sessions(served), f"m{n}")
    with served.sessions() as session:
        blob = Blob(
            cache_key=key(n),
            model_id=model,
            target="CPU",
            spec={},
            toolchain=TOOLCHAIN.as_dict(),
            openvino_version=TOOLCHAIN.openvino,
            storage_key=blob_storage_key(key(n)),
            size_bytes=len(data),
            sha256=hashlib.sha256(data).hexdigest(),
            payload_offset=0,
            weightless=False,
            created_at=now(),
        )
        session.add(blob)
        session.commit()
        return blob


class _Sessions:
    """What `add_model` needs of a farm: `session()`."""

    def __init__(self, served) -> None:
        self.session = served.sessions


def _report(blob: Blob, agent: str, **fields) -> dict:
    return {
        "blob_sha256": blob.sha256,
        "agent_id": agent,
        "device_name": "CPU",
        "openvino_version": TOOLCHAIN.openvino,
        "passed": True,
        "tolerance": {"atol": 0.01, "rtol": 0.02, "min_cosine": 0.999},
        "outputs": [],
        "runs": 1,
        **fields,
    }


def test_verification_reports_are_bounded_in_size_and_count(served, limited, tmp_path):
    blob = _blob(served, tmp_path)
    url = f"{limited.url}/v1/blobs/{blob.cache_key}/verifications"
    edge = _headers(limited, "edge")

    def send(agent: str, **fields) -> httpx.Response:
        return httpx.post(url, json=_report(blob, agent, **fields), headers=edge, timeout=30)

    large = send("edge-1", error="x" * 3900, passed=False, device_name="d" * 250)
    assert large.status_code == 413 and large.json()["code"] == "report_too_large"
    assert "FARM_MAX_REPORT_BYTES=4096" in large.json()["message"]
    assert send("edge-1").status_code == 201
    assert send("edge-1").status_code == 201
    third = send("edge-1")
    assert third.status_code == 429 and "FARM_MAX_REPORTS_PER_AGENT=2" in third.text
    assert send("edge-2").status_code == 201
    full = send("edge-invented")
    assert full.status_code == 429 and "FARM_MAX_REPORTS_PER_BLOB=3" in full.text
    with served.sessions() as session:
        assert session.scalar(select(func.count()).select_from(Verification)) == 3


def test_a_presigned_url_lives_no_longer_than_the_token_that_asked(served, limited, tmp_path):
    blob = _blob(served, tmp_path, 2)
    with served.sessions() as session:
        brief = create_token(session, "brief", "pull", datetime.now(UTC) + timedelta(seconds=90))

    def expires_in(token: str) -> int:
        answer = httpx.get(
            f"{limited.url}/v1/blobs/{blob.cache_key}/download",
            headers={"Authorization": f"Bearer {token}"},
            timeout=30,
        )
        assert answer.status_code == 307, answer.text
        query = parse_qs(urlsplit(answer.headers["location"]).query)
        if "X-Amz-Expires" in query:  # SigV4: seconds
            return int(query["X-Amz-Expires"][0])
        return round(int(query["Expires"][0]) - time.time())  # SigV2: a Unix time

    assert 598 <= expires_in(limited.tokens["edge"]) <= 600  # FARM_PRESIGN_SECONDS
    assert 80 <= expires_in(brief) <= 90  # the token's remaining life


KILLED_MID_MATRIX = """
import os, signal, sys
from farm.core.config import Settings
from farm.core.identity import ModelInfo
from farm.core.spec import CompileSpec, Toolchain
from farm.server.context import FarmContext
from farm.server.jobs import service

farm = FarmContext.open(Settings())
identity = {"xml": sys.argv[1], "bin": sys.argv[2]}
real, made = service.submit, []

def killed_at_the_fifth(*args, **kwargs):
    if len(made) == 4:
        os.kill(os.getpid(), signal.SIGKILL)
    made.append(1)
    return real(*args, **kwargs)

service.submit = killed_at_the_fifth
with farm.session() as session:
    service.submit_matrix(
        session, farm.store, farm.settings, farm.dispatcher, identity,
        [CompileSpec.create("CPU", batch=n) for n in range(1, 65)],
        Toolchain("2026.4.1", runtime_requirements="x"),
        describe_model=lambda: ModelInfo(identity, "m.xml", 70), submitter="ci",
    )
"""


def test_a_process_killed_mid_matrix_records_none_of_it(served, limited):
    model = _store_model(limited)
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_MID_MATRIX, model["xml"], model["bin"]],
        env={**os.environ, **served.env},
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert served.count(Job) == 0  # the first four rows died with their transaction
    broker = redis.Redis.from_url(served.env["FARM_BROKER_URL"])
    assert broker.keys("compile.*") == []
