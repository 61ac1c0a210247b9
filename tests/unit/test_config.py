"""Settings read as the README documents them (Configuration)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pydantic import ValidationError

from farm.core.config import FIELD_TYPES, Settings, _read_plain
from farm.core.text import strip_userinfo
from farm.core.validated import ValidatedSettings


@pytest.mark.parametrize(
    ("given", "used"),
    [
        # What `scripts/services env` prints and `psql` takes: run on psycopg.
        (
            "postgresql://postgres@127.0.0.1:5432/farm",
            "postgresql+psycopg://postgres@127.0.0.1:5432/farm",
        ),
        (
            "postgres://u:p@db/farm?sslmode=require",
            "postgresql+psycopg://u:p@db/farm?sslmode=require",
        ),
        # A SQLAlchemy URL stays as it is.
        ("postgresql+psycopg://u@db/farm", "postgresql+psycopg://u@db/farm"),
        ("sqlite:////tmp/farm.db", "sqlite:////tmp/farm.db"),
    ],
)
def test_a_libpq_database_url_runs_on_psycopg(given, used):
    assert Settings(database_url=given).resolved_database_url == used


# --- the plain reader and pydantic-settings agree (issue 30, item 4) ---------------------------

SAMPLES = {
    "int": ["0", "42", "-7", "007", " 5", "1_000", "1e3", "4.0", "abc", ""],
    "float": ["2.5", "1", "-0.5", ".5", "1e2", "nan", "x", ""],
    "bool": ["true", "false", "1", "0", "yes", "off", "TRUE", "maybe", ""],
    "str": ["x", "", " spaced ", "postgresql://u:p@db/farm"],
    "Path": ["/tmp/x", "relative/dir", "", "~/home"],
}
"""Values of each type: plain ones (read without pydantic) and others (read by pydantic)."""


def _outcome(make):
    try:
        settings = make()
    except Exception as error:  # pydantic's ValidationError, whichever reader raised it
        return type(error).__name__
    return {name: repr(getattr(settings, name)) for name in FIELD_TYPES}  # nan == nan


def _clean_env(monkeypatch):
    for name in list(os.environ):
        if name.lower().startswith("farm_"):
            monkeypatch.delenv(name)


def test_the_defaults_are_pydantics(monkeypatch):
    _clean_env(monkeypatch)
    assert _read_plain(os.environ) is not None
    assert _outcome(Settings) == _outcome(ValidatedSettings)


@pytest.mark.parametrize(
    ("name", "text"),
    [
        (name, text)
        for kind, texts in SAMPLES.items()
        for name in [n for n, k in FIELD_TYPES.items() if k == kind][:2]
        for text in texts
    ]
    + [("status_lifetime_seconds", t) for t in ("59", "60", "31622400", "31622401")]
    + [("s3_endpoint_url", "http://user:secret@127.0.0.1:8333")],
)
def test_a_value_reads_as_pydantic_reads_it(monkeypatch, name, text):
    _clean_env(monkeypatch)
    monkeypatch.setenv(f"FARM_{name.upper()}", text)
    assert _outcome(Settings) == _outcome(lambda: _validated_then_stripped())


def _validated_then_stripped():
    """What `Settings` made of pydantic's answer before it read plain values itself."""
    validated = ValidatedSettings()
    if validated.s3_endpoint_url:
        validated.s3_endpoint_url = strip_userinfo(validated.s3_endpoint_url)
    return validated


@pytest.mark.parametrize(
    ("text", "plain"),
    [("42", True), ("true", True), ("/x", True), ("1_000", False), ("yes", False), ("", False)],
)
def test_plain_values_are_read_without_pydantic(text, plain):
    variable = "FARM_LEASE_SECONDS" if text[:1] != "/" and text != "true" else "FARM_HOME"
    variable = "FARM_ALLOW_UNSIGNED" if text in ("true", "yes") else variable
    assert (_read_plain({variable: text}) is not None) is plain


def test_a_variables_name_is_read_in_any_case(monkeypatch):
    _clean_env(monkeypatch)
    monkeypatch.setenv("farm_Lease_Seconds", "77")
    assert Settings().lease_seconds == ValidatedSettings().lease_seconds == 77


def test_a_copy_takes_its_update_and_validates_it():
    settings = Settings(lease_seconds=10)
    assert settings.model_copy(update={"lease_seconds": 20}).lease_seconds == 20
    assert settings.lease_seconds == 10
    with pytest.raises(ValidationError):
        settings.model_copy(update={"status_lifetime_seconds": 1})


def test_a_setting_of_another_type_is_left_to_pydantic():
    """A setting declared with a type the plain reader does not know (a list, a dict...) is
    read by pydantic, whatever its value."""
    from farm.core.config import _NOT_PLAIN, _plain

    assert _plain("list[str]", "a") is _NOT_PLAIN
    assert _plain("int", "12") == 12 and _plain("Path", "x") == Path("x")
