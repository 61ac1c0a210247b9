"""Settings read as the README documents them (Configuration)."""

from __future__ import annotations

import pytest

from farm.core.config import Settings


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
