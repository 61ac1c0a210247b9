"""The read-only commands load only what they use (issue 17, item 15; the figures are in
bench/startup.py): no OpenVINO, Alembic, Celery, boto3 or FastAPI to list jobs or blobs or show
a key on the embedded farm, and no Alembic to open an embedded database already at head."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from farm.server.db.session import head_revision, sqlite_at_head

HEAVY = ("openvino", "numpy", "alembic", "celery", "boto3", "fastapi", "uvicorn", "httpx")
OPERATOR_ONLY = (
    "farm.server.doctor",
    "farm.server.tokens",
    "farm.server.blobs.gc",
    "farm.server.blobs.resign",
    "farm.server.blobs.verifications",
    "farm.server.jobs.reconcile",
    "farm.server.jobs.runner",
    "cryptography.hazmat.primitives.serialization",
)
"""What only some commands use (operator commands, compiles, signing keys): never loaded to
read."""
SERVER_SIDE = ("sqlalchemy", "farm.server", "openvino", "numpy", "cryptography.hazmat.primitives")
"""What a command through the API never needs: it speaks HTTP only."""


def _loaded_by(args: list[str], env: dict[str, str], watched: tuple[str, ...]) -> list[str]:
    """The modules of `watched` that `farm ARGS --json` has loaded when it returns (or fails)."""
    probe = (
        "import sys, json\n"
        "from farm.cli import main\n"
        "try:\n"
        f"    main({[*args, '--json']!r}, standalone_mode=False)\n"
        "except Exception as error:\n"
        "    print(repr(error), file=sys.stderr)\n"
        f"print(json.dumps([m for m in {watched!r} if m in sys.modules]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_head_revision_is_alembics_head():
    from alembic.script import ScriptDirectory

    from farm.server.db.session import alembic_config

    assert (
        head_revision() == ScriptDirectory.from_config(alembic_config("sqlite://")).get_heads()[0]
    )


def test_a_database_at_head_is_known_without_alembic(embedded_farm, tmp_path):
    assert sqlite_at_head(embedded_farm.settings.resolved_database_url)
    assert not sqlite_at_head(f"sqlite:///{tmp_path / 'none.db'}")
    (tmp_path / "empty.db").write_bytes(b"")
    assert not sqlite_at_head(f"sqlite:///{tmp_path / 'empty.db'}")


@pytest.mark.parametrize("args", [["jobs"], ["blobs"], ["status", "1"], ["workers"]])
def test_an_embedded_read_only_command_loads_no_heavy_library(embedded_farm, args):
    from tests.unit.conftest import add_job, add_model

    add_job(embedded_farm, add_model(embedded_farm), 1)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FARM_")}
    env["FARM_HOME"] = str(embedded_farm.settings.home)
    assert _loaded_by(args, env, HEAVY + OPERATOR_ONLY) == []


@pytest.mark.parametrize("args", [["jobs"], ["blobs"], ["status", "1"]])
def test_a_read_command_through_the_api_loads_nothing_of_the_server(tmp_path, args):
    """Through the API the command is an HTTP client: no SQLAlchemy, no farm.server (the API
    here answers nothing: what is loaded on the way to the request is what counts)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FARM_")}
    env.update(FARM_HOME=str(tmp_path), FARM_API_URL="http://127.0.0.1:9", FARM_TOKEN="farm_x")
    assert _loaded_by(args, env, SERVER_SIDE) == []
