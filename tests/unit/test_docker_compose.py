"""docker/compose.yaml cannot run here (no Docker): check what can be checked without it.

Each service's command must parse as a real `farm` command with its options, the API must bind
every interface, and the workers must offer for routing the memory their container may use.
"""

from __future__ import annotations

import re
from pathlib import Path

import click
import pytest

from farm.cli import main

yaml = pytest.importorskip("yaml")

COMPOSE = Path(__file__).parents[2] / "docker" / "compose.yaml"
UNITS = {"k": 2**10, "m": 2**20, "g": 2**30}


@pytest.fixture(scope="module")
def services() -> dict:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def parse(args: list[str]) -> click.Context:
    """The context click builds for `farm ARGS` (options checked), without running it."""
    command, rest = main, list(args)
    while isinstance(command, click.Group):
        # get_command, not .commands: farm loads a command's module when it is asked for.
        found = command.get_command(click.Context(command), rest[0]) if rest else None
        assert found is not None, f"no command farm {' '.join(args)}"
        command, rest = found, rest[1:]
    return command.make_context(command.name, rest)


def test_every_farm_service_runs_a_real_farm_command(services):
    farm_services = {name: s for name, s in services.items() if "build" in s}
    assert set(farm_services) == {
        "signing-key",
        "status-key",
        "migrate",
        "api",
        "worker",
        "reconciler",
    }
    for name, service in farm_services.items():
        parse(service["command"])  # raises UsageError on an unknown command or option
        env = service["environment"]
        assert env["FARM_DATABASE_URL"].startswith("postgresql+psycopg://"), name
        assert env["FARM_BROKER_URL"].startswith("redis://"), name


def test_the_api_listens_on_every_interface_after_migrations(services):
    api = services["api"]
    options = parse(api["command"]).params
    assert options["host"] == "0.0.0.0"
    assert api["ports"] == [f"{options['port']}:{options['port']}"]
    assert api["depends_on"]["migrate"] == {"condition": "service_completed_successfully"}


def test_workers_sign_with_the_key_made_once_before_them(services):
    worker, maker = services["worker"], services["signing-key"]
    key = parse(maker["command"]).params["path"]
    assert parse(maker["command"]).params["if_missing"]  # a restart keeps the key
    assert worker["environment"]["FARM_SIGNING_KEY"] == str(key)
    assert worker["depends_on"]["signing-key"] == {"condition": "service_completed_successfully"}
    assert "keys:/keys:ro" in worker["volumes"] and "keys:/keys" in maker["volumes"]


def test_workers_offer_the_memory_of_their_container(services):
    worker = services["worker"]
    limit = worker["deploy"]["resources"]["limits"]["memory"]
    limit_bytes = int(limit[:-1]) * UNITS[limit[-1].lower()]
    assert int(worker["environment"]["FARM_WORKER_MEMORY_BYTES"]) == limit_bytes


def test_the_api_signs_statuses_and_channels_with_a_certified_key_of_its_own(services):
    """The API holds FARM_STATUS_KEY (statuses and channel documents) and never the blob
    signing key: neither the setting nor the volume it lives in."""
    api, maker = services["api"], services["status-key"]
    made = parse(maker["command"]).params
    assert made["if_missing"] and api["environment"]["FARM_STATUS_KEY"] == str(made["path"])
    assert "FARM_SIGNING_KEY" not in api["environment"]
    assert maker["environment"]["FARM_SIGNING_KEY"] == "/keys/signing.pem"
    assert api["depends_on"]["status-key"] == {"condition": "service_completed_successfully"}
    assert api["volumes"] == ["status-key:/status:ro"]
    assert not any(volume.startswith("keys:") for volume in api["volumes"])


def test_the_image_runs_the_compile_child_as_a_user_of_its_own_through_the_launcher(services):
    # What tests/integration/test_compile_user.py sets up and attacks on this host.
    dockerfile = (COMPOSE.parent / "Dockerfile").read_text()
    env = dict(re.findall(r"(FARM_COMPILE_\w+)=(\S+)", dockerfile))
    setup = re.search(r"farm-compile-sandbox (\S+) (\S+) (\S+)\n", dockerfile)
    assert setup and setup.groups() == (
        "farm",
        env["FARM_COMPILE_USER"],
        env["FARM_COMPILE_LAUNCHER"],
    )
    assert "COPY docker/compile-sandbox.sh /usr/local/sbin/farm-compile-sandbox" in dockerfile
    assert re.findall(r"^USER (\S+)$", dockerfile, re.M) == ["farm"]
    worker = services["worker"]
    assert worker["cap_drop"] == ["ALL"] and set(worker["cap_add"]) == {"SETUID", "SETGID"}
    assert "no-new-privileges" not in str(worker.get("security_opt", ""))  # voids file caps
