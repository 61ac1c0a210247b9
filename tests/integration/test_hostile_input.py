"""The bad-input corpus (issue 8): hostile and broken input, one case id each.

Every case is refused with one clear error, stores nothing and crashes nothing:
- through the CLI (embedded farm, run in this process for speed): exit code 2 (bad input), 3
  (not found) or 6 (token refused), as README "Exit codes" documents, one line on stderr;
  no model, job, blob or token row and no stored file;
- through the real API (uvicorn, PostgreSQL, Redis, SeaweedFS): a 4xx with a stable code, no
  rows and no objects;
- through a real worker, for model files sent with the raw API (the API never parses models,
  and a hostile client skips the CLI's own check): the job fails with the same clear error, no
  blob exists, and the worker carries on.

Other bad input has tests elsewhere: tests/integration/test_cli_embedded.py (missing or
truncated .bin, malformed XML stub, garbage ONNX, unknown device, tiles over the maximum,
malformed shape, unknown input, compiler parameter and property), test_api.py (malformed JSON,
unknown fields, matrix over the limit, digest mismatch, an upload over the limit, rate limit,
roles, revoked and expired tokens), test_api_fuzz.py (schemathesis: no input gives a 500).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import sqlite3
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx
import openvino as ov
import pytest
from click.testing import CliRunner
from sqlalchemy import func, select, update

from farm.server.db.models import ApiToken, Blob, Job, Model
from tests import hostile, models
from tests.integration.served import wait_until

# --- model files -----------------------------------------------------------------------------

MODEL_CASES: dict[str, str] = {
    "xml-mismatched-tags": "Start-end tags mismatch",
    "xml-xxe-file": "declares a DTD",
    "xml-xxe-parameter-entity": "declares a DTD",
    "xml-billion-laughs": "declares a DTD",
    "xml-zero-bytes": "Unable to read the model",
    "bin-zero-bytes": "Incorrect weights in bin file",
    "bin-one-byte-short": "Incorrect weights in bin file",
    "offset-past-bin": "Incorrect weights in bin file",
    "offset-size-overflow": "cannot read model",
    "offset-negative": "not an unsigned 64 bit integer",
    "shape-negative-in-xml": "must be greater or equal to -1",
    "shape-zero-in-xml": "has a zero dimension",
    "shape-huge-in-xml": "elements, more than 1099511627776",
    "input-name-not-utf8": "input or output names are not UTF-8",
    "onnx-zero-bytes": "it has no outputs",
    "onnx-truncated": "Model can't be parsed",
    "onnx-external-data-absolute": "outside the base directory",
    "onnx-external-data-traversal": "outside the base directory",
}
"""Case id (a builder in tests/hostile.py) → what the one-line error says."""
assert set(MODEL_CASES) == set(hostile.MODEL_FILES)

# --- flags and names (the embedded CLI) --------------------------------------------------------

NOT_UTF8 = b"\xff\xfe".decode("utf-8", "surrogateescape")
"""What Python makes of argument bytes that are not UTF-8."""

ARG_CASES: dict[str, tuple[list[str], int, str]] = {
    "shape-negative-flag": (["--shape", "x[-1,3,32,32]"], 2, "must be a positive integer"),
    "shape-zero-flag": (["--shape", "x[0,3,32,32]"], 2, "must be from 1 to 2147483647"),
    "shape-huge-flag": (["--shape", "x[2147483647,2147483647,3,3]"], 2, "elements, more than"),
    "tiles-zero": (["-d", "4000", "--tiles", "0"], 2, "outside what NPU.4000 supports (1 to 6)"),
    "tiles-not-a-number": (["-d", "4000", "--tiles", "2x"], 2, "--tiles and --batch take integers"),
    "device-path-traversal": (["-d", "../../etc"], 2, "unknown device '../../etc'"),
    "config-cache-dir": (["--config", "CACHE_DIR=/tmp/elsewhere"], 2, "set by farm itself"),
    "config-weights-path": (["--config", "WEIGHTS_PATH=/etc/passwd"], 2, "set by farm itself"),
    "config-value-not-utf8": (["--config", f"NUM_STREAMS={NOT_UTF8}"], 2, "must be an integer"),
    "input-name-path-traversal": (
        ["--shape", "../../etc/passwd[1,3,32,32]"],
        2,
        "the model has no input '../../etc/passwd'",
    ),
    "input-name-not-utf8-flag": (
        ["--shape", f"{NOT_UTF8}[1,3,32,32]"],
        2,
        "is not a usable input name",
    ),
    "layout-rank-mismatch": (
        ["--batch", "2", "--layout", "x:NCHWQ"],
        2,
        "--layout NCHWQ does not fit input x[1,3,32,32]",
    ),
    "layout-of-a-partly-known-rank": (
        ["--batch", "2", "--layout", "x:N?"],
        2,
        "--layout N? does not fit input x[1,3,32,32]",
    ),
    "batch-on-the-channel-axis": (
        ["--batch", "2", "--layout", "x:CNHW"],
        2,
        "cannot set batch 2",
    ),
    "matrix-over-limit": (
        ["--batch", ",".join(str(b) for b in range(1, 66)), "--layout", "NCHW"],
        2,
        "65 specs is over the limit of 64 (FARM_MAX_MATRIX)",
    ),
}
"""Case id → `farm submit conv.xml -d CPU` plus these flags (a later -d wins), exit, message."""

COMMAND_CASES: dict[str, tuple[list[str], int, str]] = {
    "cache-key-path-traversal": (
        ["pull", "../../etc", "-o", "x.blob"],
        2,
        "'../../etc' is neither a job number nor a cache key",
    ),
    "token-name-not-utf8": (
        ["token", "create", "--name", NOT_UTF8, "--role", "pull"],
        2,
        "has control characters or is not UTF-8",
    ),
    "token-name-terminal-escape": (
        ["token", "create", "--name", "\x1b[2Jops", "--role", "admin"],
        2,
        "has control characters or is not UTF-8",
    ),
    "token-revoke-not-utf8": (["token", "revoke", NOT_UTF8], 3, "no token named"),
    "token-revoke-path-traversal": (
        ["token", "revoke", "../../etc/passwd"],
        3,
        "no token named '../../etc/passwd'",
    ),
    "jobs-filter-not-utf8": (
        ["jobs", "--submitter", NOT_UTF8],
        2,
        "--submitter '\\udcff\\udcfe' has control characters or is not UTF-8",
    ),
}
"""Case id → a whole `farm` command line, exit code, message."""


def run_cli(home: Path, *args: str):
    """`farm ARGS` against the embedded farm in `home`, in this process (no interpreter start)."""
    from farm.cli import main

    env = {"FARM_HOME": str(home)}
    for name in ("DATABASE_URL", "STORAGE_URL", "BROKER_URL", "API_URL", "TOKEN"):
        env[f"FARM_{name}"] = None
    return CliRunner(env=env).invoke(main, list(args), catch_exceptions=False)


def stored(home: Path) -> dict[str, int]:
    """Rows per table and files in the store of the embedded farm in `home`."""
    counts = {"store files": sum(1 for p in (home / "store").rglob("*") if p.is_file())}
    tables = ("models", "jobs", "blobs", "api_tokens")
    if not (home / "farm.db").exists():
        return {**counts, **dict.fromkeys(tables, 0)}
    with sqlite3.connect(home / "farm.db") as connection:
        for table in tables:
            counts[table] = connection.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
    return counts


def assert_refused(result, exit_code: int, message: str, home: Path) -> None:
    text = result.stdout + result.stderr
    assert result.exit_code == exit_code, (result.exit_code, text)
    assert result.stderr.startswith("farm: error: "), text
    assert result.stderr.strip().count("\n") == 0, f"not one line: {result.stderr!r}"
    assert message in result.stderr, result.stderr
    assert "Traceback" not in text and hostile.SECRET_SIGN not in text
    assert set(stored(home).values()) == {0}, stored(home)


@pytest.fixture
def home(tmp_path) -> Path:
    return tmp_path / "farm-home"


@pytest.fixture(scope="module")
def conv_xml(tmp_path_factory) -> Path:
    return models.save_ir(models.conv_net(), tmp_path_factory.mktemp("conv") / "conv.xml")


@pytest.mark.parametrize("case", MODEL_CASES)
def test_cli_refuses_a_hostile_model_file(case, home, tmp_path):
    path = hostile.MODEL_FILES[case](tmp_path / "model")
    result = run_cli(home, "submit", str(path), "-d", "CPU")
    assert_refused(result, 2, MODEL_CASES[case], home)


@pytest.mark.parametrize("case", ARG_CASES)
def test_cli_refuses_a_bad_flag(case, home, conv_xml):
    flags, exit_code, message = ARG_CASES[case]
    result = run_cli(home, "submit", str(conv_xml), "-d", "CPU", *flags)
    assert_refused(result, exit_code, message, home)


@pytest.mark.parametrize("case", COMMAND_CASES)
def test_cli_refuses_a_bad_name_or_key(case, home, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args, exit_code, message = COMMAND_CASES[case]
    assert_refused(run_cli(home, *args), exit_code, message, home)


def test_openvino_itself_does_not_expand_external_entities(tmp_path):
    """farm refuses DTDs anyway; this records that OpenVINO's parser (pugixml) would not have
    read the file: the entity stays literal text."""
    xml = hostile.xml_xxe_file(tmp_path / "xxe")
    model = ov.Core().read_model(str(xml), str(xml.with_suffix(".bin")))
    assert model.inputs[0].get_any_name() == "&xxe;"
    names = [op.get_friendly_name() for op in model.get_ops()]
    assert "&xxe;" in names and not any(hostile.SECRET_SIGN in name for name in names)


def test_a_model_file_named_in_bytes_that_are_not_utf8_compiles_under_a_readable_name(
    home, conv_xml, tmp_path
):
    folder = os.fsencode(tmp_path / "weird")
    os.makedirs(folder)
    for suffix in (b".xml", b".bin"):
        source = conv_xml.with_suffix(suffix.decode())
        with open(os.path.join(folder, b"\xff\xfe" + suffix), "wb") as target:
            target.write(source.read_bytes())
    path = os.fsdecode(os.path.join(folder, b"\xff\xfe.xml"))
    result = run_cli(home, "submit", path, "-d", "CPU", "--json")
    assert result.exit_code == 0, result.stderr
    with sqlite3.connect(home / "farm.db") as connection:
        assert connection.execute("SELECT name FROM models").fetchall() == [("\ufffd\ufffd.xml",)]


# --- the served farm: a real API and worker, shared by the cases of this module --------------

UPLOAD_LIMIT = 64 * 1024
"""FARM_MAX_UPLOAD_BYTES of this module's API: a .bin with 1 MiB of junk is over it."""


class HostileFarm:
    def __init__(self, farm, server, store) -> None:
        self.farm, self.server, self.store = farm, server, store
        self.tokens: dict[str, str | bytes] = {}

    def client(self, token: str | bytes | None) -> httpx.Client:
        headers = {}
        if isinstance(token, bytes):  # not UTF-8: httpx sends bytes as they are
            headers["Authorization"] = b"Bearer " + token
        elif token:
            headers["Authorization"] = f"Bearer {token}"
        return httpx.Client(base_url=self.server.url, headers=headers, timeout=30)

    def objects(self, under: str = "") -> list[str]:
        prefix = self.store.settings.prefix + under
        listed = self.store.client.list_objects_v2(Bucket=self.store.bucket, Prefix=prefix)
        return [entry["Key"] for entry in listed.get("Contents", [])]

    def rows(self) -> dict[str, int]:
        with self.farm.sessions() as session:
            return {
                model.__tablename__: session.scalar(select(func.count()).select_from(model))
                for model in (Model, Job, Blob)
            }


@pytest.fixture(scope="module")
def served_farm(tmp_path_factory):
    from farm.server.storage import StorageError
    from farm.server.storage.s3 import S3Settings, S3Store
    from farm.server.tokens import create_token, revoke_token
    from tests.conftest import (
        S3_CREDENTIALS,
        S3_ENDPOINT_URL,
        fresh_postgres_url,
        fresh_redis_url,
        served_environment,
        service_missing,
    )
    from tests.integration.served import ApiServer, ServedFarm

    tmp = tmp_path_factory.mktemp("hostile-farm")
    s3_url = f"s3://farm/test-{uuid.uuid4().hex[:12]}"
    store = S3Store(S3Settings.from_url(s3_url, endpoint_url=S3_ENDPOINT_URL, **S3_CREDENTIALS))
    try:
        store.check()
    except StorageError as error:
        service_missing("SeaweedFS (scripts/services up)", error)
    with fresh_postgres_url() as postgres_url, fresh_redis_url() as redis_url:
        env = served_environment(tmp, postgres_url, redis_url, s3_url)
        env["FARM_MAX_UPLOAD_BYTES"] = str(UPLOAD_LIMIT)
        logs = tmp / "logs"
        logs.mkdir()
        farm = ServedFarm(env, logs)
        farm.start_worker("w1", wait=False)  # registers while the API starts
        server = ApiServer(env, logs / "api.log").start()
        hostile_farm = HostileFarm(farm, server, store)
        with farm.sessions() as session:
            for role in ("pull", "submit"):
                hostile_farm.tokens[role] = create_token(session, f"corpus-{role}", role)
            hostile_farm.tokens["revoked"] = create_token(session, "corpus-revoked", "admin")
            revoke_token(session, "corpus-revoked")
            hostile_farm.tokens["expired"] = create_token(session, "corpus-expired", "admin")
            session.execute(
                update(ApiToken)
                .where(ApiToken.name == "corpus-expired")
                .values(expires_at=ApiToken.created_at)
            )
            session.commit()
        hostile_farm.tokens["forged"] = "farm_" + secrets.token_urlsafe(32)
        hostile_farm.tokens["not-utf8"] = b"farm_\xff\xfe"
        try:
            yield hostile_farm
        finally:
            server.stop()
            farm.stop()


def _toolchain() -> dict:
    from farm.core.spec import Target
    from farm.toolchain import host_toolchain

    toolchain = host_toolchain(Target.parse("CPU"))
    return {"openvino": toolchain.openvino, "runtime_requirements": toolchain.runtime_requirements}


def _submission(model_name: str = "m.onnx", **spec) -> dict:
    return {
        "model": {"onnx": "0" * 64},
        "model_name": model_name,
        "specs": [{"target": "CPU", **spec}],
        "toolchain": _toolchain(),
    }


OCTET = {"Content-Type": "application/octet-stream"}
JSON = {"Content-Type": "application/json"}
"""With `body=json.dumps(...)`: JSON escapes a lone surrogate ("\\udcff"), as any client may."""
DATA = b"weights" * 100
SHA = hashlib.sha256(DATA).hexdigest()

Request = Callable[[HostileFarm], httpx.Response]


def _as(role: str, method: str, url: str, **kwargs) -> Request:
    def call(farm: HostileFarm) -> httpx.Response:
        with farm.client(farm.tokens[role]) as client:
            return client.request(method, url, **kwargs)

    return call


def _submit(role: str = "submit", body: str | None = None, **kwargs) -> Request:
    return _as(role, "POST", "/v1/submissions", **({"content": body} if body else {}), **kwargs)


API_CASES: dict[str, tuple[Request, int, str]] = {
    "upload-token-expired": (
        _as("expired", "PUT", f"/v1/models/{SHA}", content=DATA, headers=OCTET),
        401,
        "token_expired",
    ),
    "upload-token-revoked": (
        _as("revoked", "PUT", f"/v1/models/{SHA}", content=DATA, headers=OCTET),
        401,
        "unauthorized",
    ),
    "upload-token-forged": (
        _as("forged", "PUT", f"/v1/models/{SHA}", content=DATA, headers=OCTET),
        401,
        "unauthorized",
    ),
    "upload-token-not-utf8": (
        _as("not-utf8", "PUT", f"/v1/models/{SHA}", content=DATA, headers=OCTET),
        401,
        "unauthorized",
    ),
    "upload-pull-role": (
        _as("pull", "PUT", f"/v1/models/{SHA}", content=DATA, headers=OCTET),
        403,
        "forbidden",
    ),
    "upload-multipart": (
        _as("submit", "PUT", f"/v1/models/{SHA}", files={"file": ("m.bin", DATA)}),
        415,
        "unsupported_media_type",
    ),
    "upload-json-content-type": (
        _as(
            "submit",
            "PUT",
            f"/v1/models/{SHA}",
            content=DATA,
            headers={"Content-Type": "application/json"},
        ),
        415,
        "unsupported_media_type",
    ),
    "upload-without-length": (
        _as("submit", "PUT", f"/v1/models/{SHA}", content=iter([DATA]), headers=OCTET),
        411,
        "length_required",
    ),
    "upload-key-path-traversal": (
        _as("submit", "PUT", "/v1/models/..%2F..%2Fetc%2Fpasswd", content=DATA, headers=OCTET),
        404,
        "not_found",
    ),
    "resolve-key-not-utf8": (_as("submit", "GET", "/v1/blobs/%FF%FE"), 422, "invalid_request"),
    "submit-text-plain": (
        _submit(body='{"model": {}}', headers={"Content-Type": "text/plain"}),
        422,
        "invalid_request",
    ),
    "submit-xml": (
        _submit(body="<submission/>", headers={"Content-Type": "application/xml"}),
        422,
        "invalid_request",
    ),
    "submit-deeply-nested-json": (
        _submit(body="[" * 100_000 + "]" * 100_000, headers=JSON),
        400,
        "http_error",
    ),
    "submit-model-name-path-traversal": (
        _submit(json=_submission(model_name="../../etc/passwd")),
        422,
        "invalid_request",
    ),
    "submit-model-name-terminal-escape": (
        _submit(json=_submission(model_name="m\x1b[2J.xml")),
        422,
        "invalid_request",
    ),
    "submit-model-name-not-utf8": (
        _submit(body=json.dumps(_submission(model_name="\udcff.xml")), headers=JSON),
        422,
        "invalid_request",
    ),
    "submit-input-name-not-utf8": (
        _submit(body=json.dumps(_submission(shapes={"\udcff": [1, 4]})), headers=JSON),
        422,
        "invalid_request",
    ),
    "submit-shape-negative": (
        _submit(json=_submission(shapes={"x": [-1, 4]})),
        422,
        "invalid_spec",
    ),
    "submit-shape-huge": (
        _submit(json=_submission(shapes={"x": [2**62, 2**62]})),
        422,
        "invalid_spec",
    ),
    "submit-batch-zero": (
        _submit(json=_submission(batch=0, layout={"": "NC"})),
        422,
        "invalid_spec",
    ),
    "submit-device-path-traversal": (
        _submit(json={**_submission(), "specs": [{"target": "../../etc"}]}),
        422,
        "invalid_spec",
    ),
    "submit-unknown-property": (
        _submit(json=_submission(config={"NUM_STREAM": "2"})),
        422,
        "invalid_spec",
    ),
    "submit-token-expired": (_submit("expired", json=_submission()), 401, "token_expired"),
    "submit-pull-role": (_submit("pull", json=_submission()), 403, "forbidden"),
}
"""Case id → request, status, error code."""


@pytest.mark.parametrize("case", API_CASES)
def test_api_refuses_bad_input_with_a_4xx_and_stores_nothing(case, served_farm):
    request, status, code = API_CASES[case]
    rows, objects = served_farm.rows(), served_farm.objects()
    response = request(served_farm)
    assert response.status_code == status, response.text
    body = response.json()
    assert body["code"] == code and body["message"], body
    assert "Traceback" not in response.text and hostile.SECRET_SIGN not in response.text
    assert served_farm.rows() == rows and served_farm.objects() == objects
    with served_farm.client(None) as client:
        assert client.get("/healthz").status_code == 200


def test_cli_over_http_refuses_a_bin_over_the_upload_limit(served_farm, tmp_path):
    """An oversized .bin (valid weights, then junk) meets the API's upload limit: exit 2, one
    line, nothing stored."""
    xml = hostile.bin_oversized(tmp_path / "big", 1 << 20)
    env = {
        "FARM_API_URL": served_farm.server.url,
        "FARM_TOKEN": served_farm.tokens["submit"],
        "FARM_DATABASE_URL": "postgresql+psycopg://nobody@127.0.0.1:1/none",
        "FARM_BROKER_URL": "",
        "FARM_STORAGE_URL": "/nonexistent",
    }
    rows, objects = served_farm.rows(), served_farm.objects()
    result = served_farm.farm.farm("submit", str(xml), "-d", "CPU", env=env, check=False)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("farm: error: ") and result.stderr.count("\n") == 1
    assert f"is over the upload limit of {UPLOAD_LIMIT}" in result.stderr
    assert served_farm.rows() == rows and served_farm.objects() == objects


WORKER_CASES = (
    "xml-xxe-file",
    "xml-billion-laughs",
    "offset-size-overflow",
    "shape-huge-in-xml",
    "input-name-not-utf8",
    "onnx-zero-bytes",
    "onnx-external-data-traversal",
)
"""Model files a client that skips the CLI sends straight to the API: the worker judges them."""


def _upload_and_submit(served_farm: HostileFarm, path: Path) -> dict:
    from farm.core.hashing import model_files, sha256_file

    files = model_files(path)
    identity = {role: sha256_file(file) for role, file in files.items()}
    with served_farm.client(served_farm.tokens["submit"]) as client:
        for role, file in files.items():
            response = client.put(
                f"/v1/models/{identity[role]}", content=file.read_bytes(), headers=OCTET
            )
            assert response.status_code == 201, response.text
        body = {**_submission(model_name=path.name), "model": identity}
        response = client.post("/v1/submissions", json=body)
        assert response.status_code == 200, response.text
    (result,) = response.json()["results"]
    return result


@pytest.mark.parametrize("case", WORKER_CASES)
def test_a_worker_fails_a_hostile_model_sent_past_the_cli_and_carries_on(
    case, served_farm, tmp_path
):
    worker = served_farm.farm.workers["w1"]
    result = _upload_and_submit(served_farm, hostile.MODEL_FILES[case](tmp_path / "model"))
    assert result["outcome"] == "queued"
    job = served_farm.farm.wait_job(result["job"]["id"], timeout=120)
    assert job.state == "failed" and job.attempts == 1, (job.state, job.error)
    assert MODEL_CASES[case] in job.error
    assert hostile.SECRET_SIGN not in job.error + (job.log or "")
    assert served_farm.rows()["blobs"] == 0 and served_farm.objects("blobs/") == []
    assert worker.poll() is None  # the worker process lives on


def test_the_worker_still_compiles_after_the_corpus(served_farm, conv_xml):
    worker = served_farm.farm.workers["w1"]
    result = _upload_and_submit(served_farm, conv_xml)
    job = served_farm.farm.wait_job(result["job"]["id"], timeout=120)
    assert job.state == "succeeded" and job.worker == "w1", job.error
    assert worker.poll() is None
    wait_until(lambda: "succeeded" in served_farm.farm.worker_log("w1"), 10, "the task log")
    assert "Traceback" not in served_farm.farm.worker_log("w1")
