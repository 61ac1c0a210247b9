"""Alembic migrations on SQLite and PostgreSQL: up, down, up again, and models == migrations."""

from __future__ import annotations

from alembic import command
from sqlalchemy import inspect

from farm.server.db.session import (
    alembic_config,
    downgrade_database,
    make_engine,
    upgrade_database,
)

TABLES = {
    "models",
    "jobs",
    "blobs",
    "pulls",
    "workers",
    "api_tokens",
    "blob_deletions",
    "verifications",
    "model_uploads",
    "dashboard_sessions",
    "channels",
    "channel_revisions",
    "channel_moves",
    "channel_edges",
    "stage_outputs",
    "job_phases",
    "metric_counts",
    "bundle_builds",
    "bundle_parts",
    "bundle_build_parts",
}


def tables(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        return set(inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def test_upgrade_downgrade_upgrade(database_url):
    upgrade_database(database_url)
    assert tables(database_url) == TABLES
    downgrade_database(database_url, "base")
    assert tables(database_url) == set()
    upgrade_database(database_url)
    assert tables(database_url) == TABLES


def test_models_match_migrations(database_url):
    """`alembic check`: a model change without its migration fails here."""
    upgrade_database(database_url)
    engine = make_engine(database_url)
    try:
        with engine.connect() as connection:
            config = alembic_config(database_url)
            config.attributes["connection"] = connection
            command.check(config)
    finally:
        engine.dispose()


def test_columns_are_documented(postgres_url):
    upgrade_database(postgres_url)
    engine = make_engine(postgres_url)
    try:
        inspector = inspect(engine)
        for table in TABLES:
            assert inspector.get_table_comment(table)["text"], table
            for column in inspector.get_columns(table):
                assert column.get("comment"), f"{table}.{column['name']} has no comment"
    finally:
        engine.dispose()
