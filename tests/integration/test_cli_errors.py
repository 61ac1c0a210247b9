"""Errors a user can act on (issue 24 §5), met through the real `farm` command and real
services: a broker that is really down, a URL that answers with something that is not farm."""

from __future__ import annotations

import functools
import http.server
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest
from sqlalchemy import select

from farm.server.db.models import Job
from tests import models
from tests.integration.faults import free_port
from tests.integration.served import ApiServer


@pytest.fixture
def conv_xml(tmp_path):
    return models.save_ir(models.conv_net(), tmp_path / "model" / "conv.xml")


def closed_broker() -> dict[str, str]:
    """FARM_BROKER_URL at a loopback port nothing listens on: a broker that is down."""
    return {"FARM_BROKER_URL": f"redis://127.0.0.1:{free_port()}/0"}


def test_a_submit_while_the_broker_is_down_records_the_job_and_says_it_will_be_sent(
    served, conv_xml
):
    served.start_worker("w1")  # live, on the real broker: only the submitter's broker is down
    result = served.farm("submit", str(conv_xml), "-d", "CPU", "--json", env=closed_broker())
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    job_id = answer["job"]["id"]
    assert answer["job"]["state"] == "queued"
    assert answer["note"].startswith(f"job {job_id} is recorded, but the broker")
    assert "will be sent when the broker is back" in answer["note"]
    assert result.stderr == ""  # a success: stderr says nothing, the note is in the JSON
    assert served.job(job_id).sent_at is None

    human = served.farm(
        "submit", str(conv_xml), "-d", "CPU", "--hint", "LATENCY", env=closed_broker()
    )
    assert human.returncode == 0, human.stderr
    assert "is recorded, but the broker (FARM_BROKER_URL) has not taken it" in human.stdout

    # --wait --json: stderr is one JSON object, with what would have been said on the way in it.
    waited = served.farm(
        "submit",
        str(conv_xml),
        "-d",
        "CPU",
        "--wait",
        "--wait-timeout",
        "1",
        "--json",
        check=False,
        env=closed_broker(),
    )
    assert waited.returncode == 7, waited.stderr
    (error,) = [json.loads(line) for line in waited.stderr.splitlines()]
    assert error["code"] == "wait_timeout" and error["exit"] == 7
    assert error["notes"] == [f"job {job_id}: {answer['note']}"]

    # The broker is back: the reconciler sends what was recorded, and the worker compiles it.
    served.farm("reconcile")
    assert served.job(job_id).sent_at is not None
    assert served.wait_job(job_id).state == "succeeded"


def test_a_submit_through_the_api_while_the_broker_is_down_is_not_an_internal_error(
    served, conv_xml, tmp_path
):
    from farm.server.tokens import create_token

    server = ApiServer({**served.env, **closed_broker()}, tmp_path / "api.log").start()
    try:
        with served.sessions() as session:
            token = create_token(session, "submitter", "submit")
        client = {"FARM_API_URL": server.url, "FARM_TOKEN": token}
        result = served.farm("submit", str(conv_xml), "-d", "CPU", "--json", env=client)
        assert result.returncode == 0, result.stderr
        answer = json.loads(result.stdout)
        assert answer["note"].startswith(f"job {answer['job']['id']} is recorded, but the broker")
    finally:
        server.stop()
    with served.sessions() as session:
        assert [job.sent_at for job in session.scalars(select(Job))] == [None]


def test_a_verifications_bound_past_the_id_column_is_a_422(api):
    import httpx

    headers = {"Authorization": f"Bearer {api.tokens['submit']}"}
    for before, status in ((2**31, 422), (2**63, 422), (-1, 422), (2**31 - 1, 200)):
        response = httpx.get(
            f"{api.url}/v1/blobs/{'0' * 64}/verifications",
            params={"before": before},
            headers=headers,
        )
        assert response.status_code == status, (before, response.text)


class _AsksForAToken(http.server.BaseHTTPRequestHandler):
    """Another service's API: every request answered 401 with its own JSON."""

    def do_GET(self) -> None:
        body = b'{"detail": "Not authenticated"}'
        self.send_response(401)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture(params=["files", "token"])
def not_farm_url(request, tmp_path) -> Iterator[str]:
    """A URL answered by something that is not farm: a plain `http.server` serving a folder
    (404 pages in HTML), or another JSON API that asks for a token of its own (401)."""
    handler = (
        functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
        if request.param == "files"
        else _AsksForAToken
    )
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize(
    "args", [["status", "1"], ["jobs"], ["workers"], ["pull", "deadbeef" * 8], ["doctor"]]
)
def test_an_api_url_that_is_not_farm_says_so_instead_of_a_token_error(not_farm_url, args):
    env = {**os.environ, "FARM_API_URL": not_farm_url, "FARM_TOKEN": "farm_x"}
    env = {
        k: v
        for k, v in env.items()
        if not k.startswith("FARM_") or k in ("FARM_API_URL", "FARM_TOKEN")
    }
    result = subprocess.run(
        [sys.executable, "-m", "farm", *args], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 5, result.stderr + result.stdout
    text = result.stderr + result.stdout
    assert "that is not the farm API's answer: FARM_API_URL names something else" in text
    assert "token" not in text.lower() or args == ["doctor"], text
    assert "Traceback" not in text and "<html" not in text.lower()
