"""The `farm` command's contract with people and scripts (README "Exit codes"), run in this
process on an embedded farm in tmp_path: JSON errors with `--json`, cache key prefixes,
commands that need the farm's database refusing when only the API is configured, and output
that is never wrapped when it is not a terminal."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from farm.cli import main
from farm.cli.common import EXIT_CODES
from farm.core.errors import Kind
from farm.server.context import FarmContext
from tests.unit.conftest import add_blob, add_job, add_model

SHARED = "abcdef01"
"""The first 8 hex characters of two keys below: an ambiguous prefix."""
KEY_A = SHARED + "a" * 56
KEY_B = SHARED + "b" * 56
KEY_C = "c0ffee00" + "1" * 56


def farm_cli(home: Path, *args: str, **env: str | None) -> Result:
    """`farm ARGS` on the embedded farm in `home` (none of the developer's FARM_ settings)."""
    clean: dict[str, str | None] = {name: None for name in os.environ if name.startswith("FARM_")}
    return CliRunner(env={**clean, "FARM_HOME": str(home), **env}).invoke(
        main, list(args), catch_exceptions=False, prog_name="farm"
    )


@pytest.fixture
def farm(embedded_farm: FarmContext) -> FarmContext:
    model = add_model(embedded_farm)
    for key in (KEY_A, KEY_B, KEY_C):
        add_blob(embedded_farm, model, key)
    return embedded_farm


def one_error(result: Result) -> str:
    assert result.stderr.startswith("farm: error: "), result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.output, result.stderr
    return result.stderr


# --- cache key prefixes ------------------------------------------------------------------------


def test_a_unique_prefix_names_its_key(farm):
    shown = json.loads(farm_cli(farm.settings.home, "status", "C0FFEE00", "--json").stdout)
    assert shown["cache_key"] == KEY_C and shown["blob"]["cache_key"] == KEY_C
    longer = json.loads(farm_cli(farm.settings.home, "status", KEY_A[:20], "--json").stdout)
    assert longer["cache_key"] == KEY_A


def test_an_ambiguous_prefix_lists_the_keys_it_matches(farm):
    result = farm_cli(farm.settings.home, "status", SHARED)
    assert result.exit_code == EXIT_CODES[Kind.BAD_INPUT]
    assert f"cache key prefix {SHARED} is ambiguous: it matches {KEY_A}, {KEY_B}" in one_error(
        result
    )


def test_a_short_prefix_is_refused_and_an_unknown_one_is_not_found(farm):
    short = farm_cli(farm.settings.home, "pull", "abcdef0")
    assert short.exit_code == 2
    assert "prefix 'abcdef0' is too short: give at least 8 hex characters" in one_error(short)
    unknown = farm_cli(farm.settings.home, "status", "deadbeef")
    assert unknown.exit_code == 3
    assert "no blob and no job has a cache key starting with deadbeef" in one_error(unknown)


def test_a_job_only_key_resolves_from_its_prefix(farm):
    job_key = "feedface" + "2" * 56
    job_id = add_job(farm, add_model(farm, "other"), 0, cache_key=job_key)
    shown = json.loads(farm_cli(farm.settings.home, "status", "feedface", "--json").stdout)
    assert (shown["blob"], shown["job"]["id"]) == (None, job_id)


def test_eight_digits_are_a_job_number_first_then_a_key_prefix(farm):
    digits = "12345678" + "3" * 56
    add_blob(farm, add_model(farm, "digits"), digits)
    shown = json.loads(farm_cli(farm.settings.home, "status", "12345678", "--json").stdout)
    assert shown["cache_key"] == digits  # there is no job 12345678
    job_id = add_job(farm, add_model(farm, "job"), 1)
    job = json.loads(farm_cli(farm.settings.home, "status", str(job_id), "--json").stdout)
    assert job["id"] == job_id


def test_pull_takes_a_prefix(farm):
    # The fake blob's toolchain is not this host's: the agent refuses it by its whole key.
    result = farm_cli(farm.settings.home, "pull", "c0ffee00", "--json", FARM_ALLOW_UNSIGNED="1")
    assert result.exit_code == 4, result.output
    assert json.loads(result.stderr)["message"].startswith(f"blob {KEY_C} cannot be imported")


# --- --json errors -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "code", "exit_code"),
    [
        (["status", "deadbeef"], "not_found", 3),
        (["status", "xyz"], "cache_error", 2),
        (["status", "99"], "not_found", 3),
        (["jobs", "--state", "lost"], "usage", 2),
        (["gc"], "usage", 2),  # a missing option
        (["pull", "abcdef01"], "cache_error", 2),
    ],
)
def test_with_json_an_error_is_one_json_object_on_stderr(farm, args, code, exit_code):
    result = farm_cli(farm.settings.home, *args, "--json")
    assert result.exit_code == exit_code, result.output
    assert result.stdout == ""
    error = json.loads(result.stderr)
    assert set(error) == {"code", "message", "exit"}
    assert (error["code"], error["exit"]) == (code, exit_code)
    assert error["message"] and "Traceback" not in error["message"]


def test_without_json_an_error_is_one_line(farm):
    result = farm_cli(farm.settings.home, "status", "deadbeef")
    assert result.stderr == (
        "farm: error: no blob and no job has a cache key starting with deadbeef\n"
    )


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["submit", "model.xml"], "Missing option '--device' / '-d' (`farm submit --help`"),
        (["jobs", "--state", "lost"], "Invalid value for '--state'"),
        (["nosuch"], "No such command 'nosuch' (`farm --help`"),
        (["--bogus"], "No such option '--bogus' (`farm --help`"),
        (["blobs", "quarantine"], "Missing argument 'CACHE_KEY' (`farm blobs quarantine --help`"),
    ],
)
def test_a_usage_error_is_one_line_and_the_usage_stays_under_help(tmp_path, args, says):
    result = farm_cli(tmp_path, *args)
    assert result.exit_code == 2
    assert says in one_error(result)
    assert "Usage:" not in result.output
    assert farm_cli(tmp_path, "submit", "--help").stdout.startswith("Usage: farm submit ")


# --- commands that need the database, with only the API configured ----------------------------

API_ONLY = {"FARM_API_URL": "http://127.0.0.1:9/", "FARM_TOKEN": "farm_x"}
"""A submitter's or edge's environment: the API only (nothing listens on port 9)."""


@pytest.mark.parametrize(
    "args",
    [
        ["reconcile"],
        ["token", "list"],
        ["token", "create", "--name", "ci", "--role", "submit"],
        ["token", "revoke", "ci"],
        ["gc", "--dry-run", "--unpulled-days", "30"],
        ["db", "upgrade"],
        ["keys", "resign"],
    ],
)
def test_a_database_command_refuses_when_only_the_api_is_set(args, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = farm_cli(tmp_path / "home", *args, FARM_HOME=None, **API_ONLY)
    assert result.exit_code == EXIT_CODES[Kind.CANNOT_RUN_HERE] == 4
    message = one_error(result)
    assert f"`farm {' '.join(args[:2] if args[0] in ('token', 'db', 'keys') else args[:1])}`" in (
        message
    )
    assert "FARM_DATABASE_URL" in message and "unset FARM_API_URL" in message
    assert list(tmp_path.iterdir()) == []  # no ./.farm/farm.db


def test_with_the_database_url_too_an_operator_command_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    url = f"sqlite:///{tmp_path / 'ops.db'}"
    result = farm_cli(tmp_path / "home", "token", "list", FARM_DATABASE_URL=url, **API_ONLY)
    assert result.exit_code == 0, result.output
    assert (tmp_path / "ops.db").exists() and not (tmp_path / ".farm").exists()


def test_doctor_checks_the_api_it_is_pointed_at_not_a_local_farm(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = farm_cli(tmp_path / "home", "doctor", "--json", FARM_HOME=None, **API_ONLY)
    checks = {c["check"]: c for c in json.loads(result.stdout)}
    assert checks["api"]["ok"] is False
    assert "cannot reach the farm API at http://127.0.0.1:9" in checks["api"]["detail"]
    assert "database" not in checks and "storage" not in checks
    assert result.exit_code == 5
    assert list(tmp_path.iterdir()) == []


# --- output that is not a terminal ----------------------------------------------------------


def test_piped_output_is_never_wrapped(farm):
    text = farm_cli(farm.settings.home, "status", KEY_A).stdout
    blob = next(line for line in text.splitlines() if line.startswith("blob "))
    assert len(blob) > 100 and len(blob.split()[-1]) == 64  # the sha256, whole, on its line
    assert all(len(line.rstrip()) == len(line) for line in text.splitlines())  # no padding


# --- the exit-code table ------------------------------------------------------------------------


def test_every_kind_has_an_exit_code_the_readme_documents_and_an_http_status():
    from farm.server.api.errors import HTTP_STATUS

    assert set(EXIT_CODES) == set(Kind) == set(HTTP_STATUS)
    assert EXIT_CODES[Kind.UNTRUSTED] == 8  # a signature refusal is not "infrastructure"
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    table = readme.split("### Exit codes", 1)[1].split("\n\n", 2)[1]
    documented = {int(line.split("|")[1]) for line in table.splitlines()[2:]}
    assert documented == {0, 1, *EXIT_CODES.values()}


def test_install_npu_compiler_names_a_path_that_does_not_exist(tmp_path):
    missing = tmp_path / "no-such-compiler"
    result = farm_cli(tmp_path, "toolchain", "install-npu-compiler", str(missing))
    assert result.exit_code == 2
    assert f"Path '{missing}' does not exist" in one_error(result)


def test_doctor_says_where_an_npu_compiler_comes_from_once(tmp_path):
    from farm import toolchain

    result = farm_cli(tmp_path, "doctor")
    said = result.stdout.count("is not in the Linux openvino wheel")
    missing = not (toolchain.openvino_libs() / toolchain.NPU_COMPILER_LIBRARY).exists()
    assert said == 1 if missing else said <= 1, result.stdout


def test_submit_refuses_a_cpu_toolchain_file_for_an_npu_target(tmp_path):
    from tests import models

    xml = models.save_ir(models.conv_net(), tmp_path / "model" / "conv.xml")
    cpu = tmp_path / "cpu.json"
    cpu.write_text(
        json.dumps({"target": "CPU", "openvino": "2026.4.1", "runtime_requirements": "r"})
    )
    result = farm_cli(tmp_path, "submit", str(xml), "-d", "4000", "--toolchain", str(cpu))
    assert result.exit_code == 2
    assert "the toolchain file describes CPU, not NPU.4000" in one_error(result)
