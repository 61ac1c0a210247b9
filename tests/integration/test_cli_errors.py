"""Errors a user can act on (issue 24 §5), met through the real `farm` command and real
services: a broker that is really down, a URL that answers with something that is not farm."""

from __future__ import annotations

import json

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
    assert "internal" not in result.stderr and "Traceback" not in result.stderr
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
