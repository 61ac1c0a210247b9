"""The HTTP API through a real uvicorn server, with the real services and a real worker."""

from __future__ import annotations

import hashlib
import json

import httpx
import pytest
from sqlalchemy import func, select

from farm.server.db.models import Blob, Job, Pull
from tests import models

ZERO_KEY = "0" * 64


@pytest.fixture
def conv_xml(tmp_path):
    return models.save_ir(models.conv_net(), tmp_path / "model" / "conv.xml")


def http(api, role: str | None = "admin") -> httpx.Client:
    headers = {"Authorization": f"Bearer {api.tokens[role]}"} if role else {}
    return httpx.Client(base_url=api.url, headers=headers, timeout=30)


def cli_env(api, role: str = "submit") -> dict[str, str]:
    return {
        "FARM_API_URL": api.url,
        "FARM_TOKEN": api.tokens[role],
        # The submitter holds no database, broker or storage settings.
        "FARM_DATABASE_URL": "postgresql+psycopg://nobody@127.0.0.1:1/none",
        "FARM_BROKER_URL": "",
        "FARM_STORAGE_URL": "/nonexistent",
    }


def test_cli_over_http_submit_wait_status_logs_pull_and_a_hit_uploads_nothing(
    served, api, conv_xml, tmp_path
):
    served.start_worker("w1")
    env = cli_env(api)
    first = served.farm_json("submit", str(conv_xml), "-d", "CPU", "--wait", env=env)
    assert first["outcome"] == "queued" and first["job"]["state"] == "succeeded"
    assert first["job"]["submitter"] == "test-submit"
    assert api.requests_logged("PUT /v1/models/") == 2  # .xml and .bin

    again = served.farm_json("submit", str(conv_xml), "-d", "CPU", env=env)
    assert again["outcome"] == "hit"
    assert api.requests_logged("PUT /v1/models/") == 2  # a hit uploads nothing

    # A compile the compiler refuses: --wait follows it to `failed` and exits 1.
    refused = served.farm(
        "submit",
        str(conv_xml),
        "-d",
        "CPU",
        "--config",
        "PERFORMANCE_HINT_NUM_REQUESTS=999999999999",
        "--wait",
        "--json",
        env=env,
        check=False,
    )
    assert refused.returncode == 1, refused.stderr
    failed = json.loads(refused.stdout)["job"]
    assert failed["state"] == "failed" and "Wrong value" in failed["error"]
    log = served.farm_json("logs", str(failed["id"]), env=env)
    assert log["state"] == "failed" and "--- compiler output ---" in log["log"]
    assert "OpenVINO: Exception from src/" in log["log"]

    job_id = str(first["job"]["id"])
    assert served.farm_json("status", job_id, env=env)["state"] == "succeeded"
    assert served.farm_json("status", first["cache_key"], env=env)["blob"]["target"] == "CPU"
    assert "toolchain=" in served.farm("logs", job_id, env=env).stdout
    assert [j["id"] for j in served.farm_json("jobs", "--state", "succeeded", env=env)] == [
        int(job_id)
    ]
    assert [j["id"] for j in served.farm_json("jobs", "--state", "failed", env=env)] == [
        failed["id"]
    ]
    assert [w["name"] for w in served.farm_json("workers", env=env)] == ["w1"]
    assert len(served.farm_json("blobs", env=env)) == 1
    refused = served.farm("blobs", env=cli_env(api, "pull"), check=False)
    assert refused.returncode == 6 and "needs the 'submit' role" in refused.stderr

    out = tmp_path / "pulled.blob"
    pull_env = cli_env(api, "pull")
    served.farm("pull", first["cache_key"], "-o", str(out), "--format", "cache-entry", env=pull_env)
    (blob,) = served.blobs()
    assert hashlib.sha256(out.read_bytes()).hexdigest() == blob.sha256
    by_model = tmp_path / "by-model.blob"  # the plain export_model() bytes, by default
    served.farm("pull", str(conv_xml), "-d", "CPU", "-o", str(by_model), env=pull_env)
    assert by_model.read_bytes() == out.read_bytes()[blob.payload_offset :]


def _queue_job(served, xml, device: str, submitter: str, **spec):
    """A queued job made through the service layer, as the API makes it (never sent)."""
    from farm.core.identity import ModelRef
    from farm.core.spec import CompileSpec
    from tests.integration.served import submit_ref

    spec = CompileSpec.create(device, **spec)
    return submit_ref(served, ModelRef.from_path(xml), spec, submitter=submitter)


def test_job_list_filters_over_http_and_status_by_cache_key(served, api, tmp_path):
    from datetime import UTC, datetime, timedelta

    from sqlalchemy import update

    from farm.core import hashing

    one = models.save_ir(models.conv_net(seed=1), tmp_path / "one" / "one.xml")
    two = models.save_ir(models.conv_net(seed=2), tmp_path / "two" / "two.xml")
    a = _queue_job(served, one, "CPU", "alice")
    b = _queue_job(served, two, "CPU", "bob")
    c = _queue_job(served, one, "4000", "bob", tiles=2)
    old = datetime.now(UTC) - timedelta(days=2)
    with served.sessions() as session:
        session.execute(update(Job).where(Job.id == c.job_id).values(created_at=old))
        session.commit()
    yesterday = datetime.now(UTC) - timedelta(days=1)
    one_digest = hashing.model_digest(service_identity(one))

    def listed(**params) -> list[int]:
        with http(api, "submit") as client:
            response = client.get("/v1/jobs", params=params)
        assert response.status_code == 200, response.text
        return [job["id"] for job in response.json()]

    with http(api, "admin") as client:  # not bob's token: an admin may cancel any job
        client.post(f"/v1/jobs/{b.job_id}/cancel").raise_for_status()
    assert listed() == [c.job_id, b.job_id, a.job_id]
    assert listed(state="cancelled") == [b.job_id]
    assert listed(state="queued") == [c.job_id, a.job_id]
    assert listed(target="4000") == listed(target="NPU.4000") == [c.job_id]
    assert listed(target="CPU") == [b.job_id, a.job_id]
    assert listed(model=one_digest) == listed(model="one.xml") == [c.job_id, a.job_id]
    assert listed(submitter="bob") == [c.job_id, b.job_id]
    assert listed(since=yesterday.isoformat()) == [b.job_id, a.job_id]
    naive = yesterday.replace(tzinfo=None).isoformat()  # no zone: UTC
    assert listed(since=naive) == [b.job_id, a.job_id]
    assert listed(cache_key=a.cache_key) == [a.job_id]
    assert listed(cache_key=b.cache_key, state="queued") == []
    assert listed(submitter="bob", target="CPU", limit=1) == [b.job_id]

    with http(api, "submit") as client:
        typo = client.get("/v1/jobs", params={"stat": "failed"})
        assert typo.status_code == 400, typo.text
        assert typo.json()["code"] == "unknown_parameter" and "stat" in typo.json()["message"]
        assert client.get("/v1/blobs", params={"colour": "red"}).status_code == 400
        bad_key = client.get("/v1/jobs", params={"cache_key": "xyz"})
        assert bad_key.status_code == 422 and bad_key.json()["code"] == "invalid_request"

    # `farm status KEY` over HTTP shows that key's job, not the newest job of the farm.
    env = cli_env(api)
    assert served.farm_json("status", a.cache_key, env=env)["job"]["id"] == a.job_id
    assert served.farm_json("status", b.cache_key, env=env)["job"]["state"] == "cancelled"
    since = yesterday.strftime("%Y-%m-%dT%H:%M:%S")
    cli = served.farm_json("jobs", "--since", since, "--submitter", "bob", env=env)
    assert [job["id"] for job in cli] == [b.job_id]


def service_identity(xml) -> dict[str, str]:
    from farm.core.identity import ModelRef

    return ModelRef.from_path(xml).identity


def test_matrix_submit_makes_one_job_per_combination(served, api, tmp_path):
    xml = models.save_ir(models.dynamic_net(), tmp_path / "dyn" / "dyn.xml")
    result = served.farm(
        "submit",
        str(xml),
        "-d",
        "CPU,4000",
        "--batch",
        "1,4",
        "--layout",
        "image:NCHW",
        "--json",
        env=cli_env(api),
        check=False,
    )
    # NPU.4000 needs static shapes: the dynamic model is refused before anything is sent.
    assert result.returncode == 2 and "needs static shapes" in result.stderr
    assert served.count(Job) == 0

    answer = served.farm_json(
        "submit",
        str(xml),
        "-d",
        "CPU",
        "--batch",
        "1,2,4",
        "--layout",
        "image:NCHW",
        env=cli_env(api),
    )
    assert len(answer["results"]) == 3
    jobs = [r["job"] for r in answer["results"]]
    assert {j["submission_id"] for j in jobs} == {answer["submission_id"]}
    assert sorted(j["spec"]["batch"] for j in jobs) == [1, 2, 4]
    assert len({r["cache_key"] for r in answer["results"]}) == 3


def test_roles_and_tokens(served, api):
    for role, expected in (("pull", 403), ("submit", 200), ("admin", 200)):
        with http(api, role) as client:
            assert client.get("/v1/jobs").status_code == expected, role
            assert client.get("/v1/blobs").status_code == expected, role  # listing: submit
            assert client.get("/v1/workers").status_code == expected, role
            assert client.get(f"/v1/blobs/{ZERO_KEY}").status_code == 404, role
    with http(api, None) as client:
        response = client.get(f"/v1/blobs/{ZERO_KEY}")
        assert response.status_code == 401 and response.json()["code"] == "unauthorized"
    forged = httpx.get(
        f"{api.url}/v1/blobs/{ZERO_KEY}", headers={"Authorization": "Bearer farm_forged"}
    )
    assert forged.status_code == 401
    revoked = served.farm_json("token", "revoke", "test-submit")
    assert revoked["name"] == "test-submit" and revoked["revoked_at"]
    assert "revoked test-submit" in served.farm("token", "revoke", "test-submit").stdout
    unknown = served.farm("token", "revoke", "nobody", check=False)
    assert unknown.returncode == 3 and "no token named 'nobody'" in unknown.stderr
    with http(api, "submit") as client:
        response = client.get("/v1/jobs")
        assert response.status_code == 401 and response.json()["code"] == "unauthorized"
    with http(api, "pull") as client:
        body = {
            "model": {"onnx": ZERO_KEY},
            "model_name": "m",
            "specs": [{"target": "CPU"}],
            "toolchain": {"openvino": "2026.4.1", "runtime_requirements": "x"},
        }
        response = client.post("/v1/submissions", json=body)
        assert response.status_code == 403 and response.json()["code"] == "forbidden"


def test_a_token_past_its_expiry_is_refused_with_token_expired(served, api):
    from datetime import UTC, datetime, timedelta

    from tests.integration.served import wait_until

    def create(name: str, *args: str) -> tuple[dict, httpx.Client]:
        created = served.farm_json("token", "create", "--name", name, "--role", "submit", *args)
        headers = {"Authorization": f"Bearer {created['token']}"}
        return created, httpx.Client(base_url=api.url, headers=headers, timeout=30)

    day, day_client = create("ci-day", "--expires-in", "1")
    left = datetime.fromisoformat(day["expires_at"]) - datetime.now(UTC)
    assert timedelta(hours=23) < left <= timedelta(days=1)
    with day_client:
        assert day_client.get("/v1/jobs").status_code == 200  # valid until then

    before = datetime.now(UTC)
    short, short_client = create("ci-short", "--expires-in", "0.00003")  # 2.6 seconds
    assert datetime.fromisoformat(short["expires_at"]) - before <= timedelta(seconds=10)
    with short_client:
        expired = wait_until(
            lambda: (r := short_client.get("/v1/jobs")).status_code != 200 and r, 30, "expiry"
        )
    assert expired.status_code == 401 and expired.json()["code"] == "token_expired"
    assert "ci-short" in expired.json()["message"]
    listed = {t["name"]: t for t in served.farm_json("token", "list")}
    assert listed["ci-short"]["state"] == "expired" and listed["ci-day"]["state"] == "valid"
    assert listed["test-admin"]["expires_at"] is None

    until = served.farm_json(
        "token", "create", "--name", "dated", "--role", "pull", "--expires", "2099-01-02"
    )
    assert until["expires_at"].startswith("2099-01-02 00:00:00+00:00")
    for args, message in (
        (["--expires", "2001-01-01"], "is in the past"),
        (["--expires-in", "0"], "--expires-in"),
        (["--expires-in", "1", "--expires", "2099-01-01"], "not both"),
    ):
        refused = served.farm("token", "create", "--name=x", "--role=pull", *args, check=False)
        assert refused.returncode == 2 and message in refused.stderr, (args, refused.stderr)


def test_pull_reports_and_download_redirects_to_a_presigned_url(served, api, conv_xml):
    served.start_worker("w1")
    result = served.farm_json("submit", str(conv_xml), "-d", "CPU", "--wait", env=cli_env(api))
    key = result["cache_key"]
    with http(api, "pull") as client:
        meta = client.get(f"/v1/blobs/{key}").json()
        assert meta["target"] == "CPU" and meta["toolchain"]["runtime_requirements"]
        response = client.get(f"/v1/blobs/{key}/download", follow_redirects=False)
        assert response.status_code == 307
        data = httpx.get(response.headers["location"]).content  # no token needed
        assert hashlib.sha256(data).hexdigest() == meta["sha256"]
        ranged = httpx.get(response.headers["location"], headers={"Range": "bytes=0-9"})
        assert ranged.status_code == 206 and ranged.content == data[:10]
        report = {"agent_id": "edge-1", "ok": True, "import_seconds": 0.02}
        assert client.post(f"/v1/blobs/{key}/pulls", json=report).status_code == 201
        bad = client.post(f"/v1/blobs/{key}/pulls", json={**report, "import_seconds": -1})
        assert bad.status_code == 422
    assert served.count(Pull) == 1


def test_uploads_are_verified_and_limited(served, api, tmp_path):
    data = b"weights" * 1000
    sha = hashlib.sha256(data).hexdigest()
    octet = {"Content-Type": "application/octet-stream"}
    with http(api, "submit") as client:
        assert client.post("/v1/models/missing", json={"sha256": [sha]}).json() == {
            "missing": [sha]
        }
        wrong = client.put(f"/v1/models/{'1' * 64}", content=data, headers=octet)
        assert wrong.status_code == 422 and wrong.json()["code"] == "digest_mismatch"
        form = client.put(f"/v1/models/{sha}", content=data, headers={"Content-Type": "text/plain"})
        assert form.status_code == 415
        assert client.put(f"/v1/models/{sha}", content=data, headers=octet).status_code == 201
        assert client.post("/v1/models/missing", json={"sha256": [sha]}).json() == {"missing": []}
    assert not served.store.exists(f"models/{'1' * 64}")


@pytest.mark.parametrize(
    ("body", "content_type", "code"),
    [
        ("{not json", "application/json", "invalid_request"),
        (
            json.dumps({"model": {}, "model_name": "m", "specs": [], "toolchain": {}}),
            "application/json",
            "invalid_request",
        ),
        (
            json.dumps(
                {
                    "model": {"onnx": ZERO_KEY},
                    "model_name": "m",
                    "specs": [{"target": "CPU"}],
                    "toolchain": {"openvino": "2026.4.1", "runtime_requirements": "x"},
                    "colour": "red",
                }
            ),
            "application/json",
            "invalid_request",
        ),
        (
            json.dumps(
                {
                    "model": {"onnx": ZERO_KEY},
                    "model_name": "m",
                    "specs": [{"target": "GPU"}],
                    "toolchain": {"openvino": "2026.4.1"},
                }
            ),
            "application/json",
            "invalid_spec",
        ),
        (
            json.dumps(
                {
                    "model": {"onnx": ZERO_KEY},
                    "model_name": "m",
                    "specs": [{"target": "4000", "tiles": 9}],
                    "toolchain": {"openvino": "2026.4.1"},
                }
            ),
            "application/json",
            "invalid_spec",
        ),
        (
            json.dumps(
                {
                    "model": {"onnx": ZERO_KEY},
                    "model_name": "m",
                    "specs": [{"target": "4000"}] * 65,
                    "toolchain": {"openvino": "2026.4.1"},
                }
            ),
            "application/json",
            "matrix_too_large",
        ),
        (
            json.dumps(
                {
                    "model": {"onnx": ZERO_KEY},
                    "model_name": "m",
                    "specs": [{"target": "4000"}],
                    "toolchain": {"openvino": "2026.4.1"},
                }
            ),
            "application/json",
            "model_missing",
        ),
        ("model=x", "application/x-www-form-urlencoded", "invalid_request"),
    ],
    ids=[
        "malformed-json",
        "empty",
        "unknown-field",
        "unknown-device",
        "tiles",
        "matrix",
        "model-missing",
        "form",
    ],
)
def test_bad_submissions_are_4xx_and_store_nothing(served, api, body, content_type, code):
    with http(api, "submit") as client:
        response = client.post(
            "/v1/submissions", content=body, headers={"Content-Type": content_type}
        )
        assert 400 <= response.status_code < 500, response.text
        assert response.json()["code"] == code, response.text
        assert response.json()["message"]
        assert client.get("/healthz").status_code == 200  # still serving
    assert served.count(Job) == 0 and served.count(Blob) == 0


def test_limits_refuse_clearly(served, tmp_path):
    from farm.server.tokens import create_token
    from tests.integration.served import ApiServer

    env = {
        **served.env,
        "FARM_MAX_UPLOAD_BYTES": "10",
        "FARM_API_REQUESTS_PER_MINUTE": "3",
        "FARM_MAX_REQUEST_BYTES": "2000",
    }
    server = ApiServer(env, tmp_path / "limited.log").start()
    try:
        with served.sessions() as session:
            token = create_token(session, "limited", "submit")
        client = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {token}"})
        big = client.put(
            f"/v1/models/{ZERO_KEY}",
            content=b"x" * 11,
            headers={"Content-Type": "application/octet-stream"},
        )
        assert big.status_code == 413 and big.json()["code"] == "too_large"
        # Any other body is capped too, declared or streamed without a Content-Length.
        huge_json = {"model": {"onnx": ZERO_KEY}, "model_name": "x" * 3000, "specs": []}
        declared = client.post("/v1/submissions", json=huge_json)
        assert (
            declared.status_code == 413 and "FARM_MAX_REQUEST_BYTES" in declared.json()["message"]
        )
        streamed = client.post(
            "/v1/submissions",
            content=iter([b'{"model_name": "', b"x" * 1500, b"x" * 1500, b'"}']),
            headers={"Content-Type": "application/json"},
        )
        assert streamed.status_code == 413 and streamed.json()["code"] == "too_large"
        assert httpx.get(f"{server.url}/healthz").status_code == 200
        with served.sessions() as session:
            assert session.scalar(select(func.count()).select_from(Job)) == 0
        statuses = [client.get("/v1/jobs").status_code for _ in range(4)]
        assert statuses[-1] == 429 and client.get("/v1/jobs").json()["code"] == "rate_limited"
        client.close()
    finally:
        server.stop()


def test_openapi_and_health(api):
    spec = httpx.get(f"{api.url}/openapi.json").json()
    assert "/v1/submissions" in spec["paths"] and "/v1/blobs/{cache_key}/download" in spec["paths"]
    ready = httpx.get(f"{api.url}/readyz").json()
    assert ready["ready"] is True and set(ready["checks"]) == {"database", "broker", "storage"}


def test_only_the_submitter_or_an_admin_cancels_a_job_and_the_row_says_who(served, api, tmp_path):
    from farm.server.tokens import create_token

    with served.sessions() as session:
        tokens = {name: create_token(session, name, "submit") for name in ("alice", "bob")}
    xml = models.save_ir(models.conv_net(seed=5), tmp_path / "m" / "m.xml")
    job = _queue_job(served, xml, "CPU", "alice")
    other = _queue_job(served, xml, "CPU", "alice", performance_hint="LATENCY")

    def cancel(job_id: int, token: str) -> httpx.Response:
        headers = {"Authorization": f"Bearer {token}"}
        return httpx.post(f"{api.url}/v1/jobs/{job_id}/cancel", headers=headers, timeout=30)

    refused = cancel(job.job_id, tokens["bob"])
    assert (refused.status_code, refused.json()["code"]) == (403, "forbidden")
    assert "submitted by token 'alice'" in refused.json()["message"]
    assert served.job(job.job_id).state == "queued"
    # The CLI says so with the documented exit code (6: a token without the right).
    env = {**cli_env(api), "FARM_TOKEN": tokens["bob"]}
    assert served.farm("cancel", str(job.job_id), env=env, check=False).returncode == 6

    assert cancel(job.job_id, tokens["alice"]).json()["cancelled_by"] == "alice"
    assert cancel(other.job_id, api.tokens["admin"]).json()["cancelled_by"] == "test-admin"
    assert (served.job(job.job_id).state, served.job(job.job_id).cancelled_by) == (
        "cancelled",
        "alice",
    )
