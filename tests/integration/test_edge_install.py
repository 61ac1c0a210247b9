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


def test_a_worker_blob_is_pulled_imported_and_run_on_the_edge_install(
    edge_venv, served, api, tmp_path
):
    served.start_worker("w1")
    xml = models.save_ir(models.transformer_block(), tmp_path / "model" / "block.xml")
    submitter = {"FARM_API_URL": api.url, "FARM_TOKEN": api.tokens["submit"]}
    submitted = served.farm_json("submit", str(xml), "-d", "CPU", "--wait", env=submitter)
    assert submitted["job"]["state"] == "succeeded"

    # The edge: its own Python, only the API URL and a pull token; no farm credentials at all.
    edge_env = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path / "edge-home"),
        "FARM_API_URL": api.url,
        "FARM_TOKEN": api.tokens["pull"],
        "FARM_AGENT_ID": "edge-install",
        "FARM_TRUSTED_KEYS": served.env["FARM_TRUSTED_KEYS"],
    }

    def edge(*args: str) -> dict:
        result = subprocess.run(
            [str(edge_venv / "bin" / "farm"), *args, "--json"],
            capture_output=True,
            text=True,
            env=edge_env,
            timeout=300,
            check=False,
        )
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    pulled = edge("pull", str(xml), "--device", "CPU", "--import")
    assert pulled["cache_key"] == submitted["cache_key"]
    assert pulled["downloaded"] and pulled["import_seconds"] > 0
    assert Path(pulled["path"]).is_relative_to(tmp_path / "edge-home" / ".cache" / "farm")
    ran = edge("run", pulled["path"], "--device", "CPU")
    assert list(ran["outputs"].values()) == [[1, 16, 32]]

    with served.sessions() as session:
        pulls = session.scalars(select(Pull)).all()
    assert [(p.agent_id, p.ok) for p in pulls] == [("edge-install", True)]
    assert pulls[0].import_seconds == pytest.approx(pulled["import_seconds"])
