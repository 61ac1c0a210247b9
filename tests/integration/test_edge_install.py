"""The edge install (`farm[edge]`) in a fresh virtual environment: no Celery, SQLAlchemy, boto3
or FastAPI, and it pulls and imports a blob that a real worker compiled, through the real API
(PostgreSQL, Redis, SeaweedFS presigned URLs)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from sqlalchemy import select

from farm.server.db.models import Pull
from tests import models
from tests.integration.conftest import edge_cli, edge_environment

SERVER_ONLY = ("celery", "sqlalchemy", "boto3", "fastapi", "uvicorn", "psycopg", "alembic")


def test_the_edge_install_has_no_server_packages(edge_venv):
    probe = (
        "import importlib.util, json, sys;"
        f"print(json.dumps({{m: importlib.util.find_spec(m) is not None for m in {SERVER_ONLY}}}))"
    )
    found = json.loads(
        subprocess.run(
            [str(edge_venv / "bin" / "python"), "-c", probe],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    assert found == dict.fromkeys(SERVER_ONLY, False)


def edge_farm(venv: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(venv / "bin" / "farm"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )


@pytest.mark.parametrize(
    "args",
    [
        ["pull", "a" * 64],
        ["jobs"],
        ["gc", "--unpulled-days", "1"],
        ["token", "list"],
        ["db", "upgrade"],
        ["doctor"],
    ],
)
def test_what_needs_the_farm_itself_names_the_install_it_needs(edge_venv, tmp_path, args):
    """No FARM_API_URL on an edge install: a clear error and exit 4, never a traceback."""
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "FARM_HOME": str(tmp_path / "f")}
    result = edge_farm(edge_venv, env, *args, "--json")
    assert result.returncode == 4, result.stderr
    assert "Traceback" not in result.stderr
    if args == ["doctor"]:  # doctor reports what it can: OpenVINO here, and what is missing
        checks = {c["check"]: c for c in json.loads(result.stdout)}
        assert checks["openvino"]["ok"] and not checks["farm"]["ok"]
        assert "pip install 'farm[server]'" in checks["farm"]["detail"]
        return
    error = json.loads(result.stderr)
    assert (error["code"], error["exit"]) == ("not_installed", 4)
    assert (
        "needs sqlalchemy, which this install lacks: pip install 'farm[server]'"
        in (error["message"])
    )
    assert not (tmp_path / "f").exists()


def test_a_worker_blob_is_pulled_imported_and_run_on_the_edge_install(
    edge_venv, served, api, tmp_path
):
    served.start_worker("w1")
    xml = models.save_ir(models.transformer_block(), tmp_path / "model" / "block.xml")
    submitter = {"FARM_API_URL": api.url, "FARM_TOKEN": api.tokens["submit"]}
    submitted = served.farm_json("submit", str(xml), "-d", "CPU", "--wait", env=submitter)
    assert submitted["job"]["state"] == "succeeded"

    # The edge: its own Python, only the API URL and a pull token; no farm credentials at all.
    edge_env = edge_environment(api, served, tmp_path / "edge-home", "edge-install")
    edge = edge_cli(edge_venv, edge_env)

    pulled = edge("pull", str(xml), "--device", "CPU", "--import")
    assert pulled["cache_key"] == submitted["cache_key"]
    assert pulled["downloaded"] and pulled["import_seconds"] > 0
    assert Path(pulled["path"]).is_relative_to(tmp_path / "edge-home" / ".cache" / "farm")
    ran = edge("run", pulled["path"], "--device", "CPU")
    assert list(ran["outputs"].values()) == [[1, 16, 32]]
    # Submitting goes over HTTP too (a hit here), and doctor checks the API it is pointed at.
    resubmitted = edge_farm(
        edge_venv,
        {**edge_env, "FARM_TOKEN": api.tokens["submit"]},
        "submit",
        str(xml),
        "-d",
        "CPU",
        "--json",
    )
    assert resubmitted.returncode == 0, resubmitted.stderr
    assert json.loads(resubmitted.stdout) == {"outcome": "hit", "cache_key": pulled["cache_key"]}
    checks = {c["check"]: c for c in edge("doctor")}
    assert checks["api"]["ok"] and checks["token"]["detail"].startswith("valid, role pull")
    assert checks["trusted keys"]["ok"] and "farm" not in checks

    with served.sessions() as session:
        pulls = session.scalars(select(Pull)).all()
    assert [(p.agent_id, p.ok) for p in pulls] == [("edge-install", True)]
    assert pulls[0].import_seconds == pytest.approx(pulled["import_seconds"])
