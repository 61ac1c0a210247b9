"""The read-only commands load only what they use (issue 17, item 15, and issue 30, item 4; the
figures are in bench/startup.py): no OpenVINO, Alembic, Celery, boto3 or FastAPI to list jobs or
blobs or show a key on the embedded farm, no Alembic to open an embedded database already at
head, and neither the ORM and its models nor pydantic nor any other command's module: `farm
jobs`, `farm blobs` and `farm status` read through SQLAlchemy Core (farm/server/db/reads.py)
and plain settings (farm/core/config.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from farm.core.vocabulary import EMBEDDED_QUEUE
from farm.server.db.session import head_revision, sqlite_at_head
from tests.unit.conftest import add_blob, add_job, add_model, key

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
NOT_TO_READ = (
    "sqlalchemy.orm",
    "farm.server.db.models",
    "farm.server.jobs.service",
    "farm.server.blobs.service",
    "farm.server.routing",
    "pydantic",
    "pydantic_settings",
    "farm.core.validated",
    "farm.cli.submit",
    "farm.cli.edge",
    "farm.cli.ops",
    "farm.cli.channel",
    "farm.cli.verify",
    "farm.core.spec",
    "farm.core.identity",
    "farm.core.stages",
    "farm.core.sources",
    "farm.core.pipelines",
)
"""What `farm jobs`, `farm blobs` and `farm status` never load: the ORM (they read through
SQLAlchemy Core), pydantic (plain settings are read without it), the other commands' modules
and what a submission needs."""
SERVER_SIDE = ("sqlalchemy", "farm.server", "openvino", "numpy", "cryptography.hazmat.primitives")
"""What a command through the API never needs: it speaks HTTP only."""
SIGNS = "cryptography.hazmat.primitives.serialization"
"""`farm status KEY` of a blob answers its status signed, as the API does: it loads the key."""


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


READS = [["jobs"], ["blobs"], ["status", "1"], ["status", key("blob")], ["status", key(1)[:10]]]


@pytest.mark.parametrize("args", [*READS, ["workers"]])
def test_an_embedded_read_only_command_loads_no_heavy_library(embedded_farm, args):
    model = add_model(embedded_farm)
    add_job(embedded_farm, model, 1, queue=EMBEDDED_QUEUE)  # as the embedded farm queues it
    add_blob(embedded_farm, model, key("blob"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("FARM_")}
    env["FARM_HOME"] = str(embedded_farm.settings.home)
    watched = HEAVY + OPERATOR_ONLY + (() if args == ["workers"] else NOT_TO_READ)
    signs = args == ["status", key("blob")]
    assert _loaded_by(args, env, watched) == ([SIGNS] if signs else [])


@pytest.mark.parametrize("args", READS)
def test_a_read_command_through_the_api_loads_nothing_of_the_server(tmp_path, args):
    """Through the API the command is an HTTP client: no SQLAlchemy, no farm.server, no
    pydantic (the API here answers nothing: what is loaded on the way to the request is what
    counts)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FARM_")}
    env.update(FARM_HOME=str(tmp_path), FARM_API_URL="http://127.0.0.1:9", FARM_TOKEN="farm_x")
    assert _loaded_by(args, env, SERVER_SIDE + NOT_TO_READ) == []


def test_the_command_table_names_each_commands_modules():
    """`farm.cli.COMMANDS` (what the group imports to run a command) names every command and,
    for each, the modules that define it and its subcommands."""
    import importlib

    from farm.cli import COMMANDS, main

    for modules in COMMANDS.values():
        for module in modules:
            importlib.import_module(f"farm.cli.{module}")
    assert sorted(main.commands) == sorted(COMMANDS)
    for name, command in main.commands.items():
        found = [command, *getattr(command, "commands", {}).values()]
        assert {c.callback.__module__ for c in found if c.callback} <= {
            f"farm.cli.{module}" for module in COMMANDS[name]
        }, name


def test_a_plain_http_api_reads_no_ca_bundle_and_its_context_fails_closed():
    """Reading the CA bundle costs every command through the API ~20 ms; a plain-http API's
    client never opens TLS, so it gets a context that verifies and trusts no certificate."""
    import ssl

    from farm.client import _tls_for

    assert _tls_for("https://farm.example:8443") is True
    context = _tls_for("http://127.0.0.1:8000")
    assert isinstance(context, ssl.SSLContext)
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
    assert context.get_ca_certs() == []


def test_a_submit_through_the_api_loads_nothing_of_the_server(tmp_path):
    """The whole `farm submit` process (its hash forked ahead, the early starts an embedded
    farm makes beside it) through the API: an HTTP client, whatever it does before the
    request (the API here answers nothing)."""
    from tests import models

    xml = models.save_ir(models.conv_net(), tmp_path / "model" / "conv.xml")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FARM_")}
    env.update(FARM_HOME=str(tmp_path), FARM_API_URL="http://127.0.0.1:9", FARM_TOKEN="farm_x")
    probe = (
        "import atexit, json, sys\n"
        "watched = ('sqlalchemy', 'farm.server', 'farm.cli.backends.direct')\n"
        "atexit.register(lambda: print(json.dumps([m for m in watched if m in sys.modules])))\n"
        "sys.argv = ['farm', 'submit', sys.argv[1], '--device', 'CPU', '--json']\n"
        "from farm.cli import main\n"
        "main()\n"  # the `farm` process itself: its hash is forked ahead
    )
    done = subprocess.run(
        [sys.executable, "-c", probe, str(xml)], env=env, capture_output=True, text=True
    )
    assert "unreachable" in done.stdout + done.stderr, done.stdout + done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == []
