"""Engines, sessions and schema upgrades for PostgreSQL (served) and SQLite (embedded)."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterator
from importlib.resources import files
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import quote

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import CursorResult, make_url
from sqlalchemy.exc import OperationalError
from sqlalchemy.sql import Executable

from farm.core.errors import DatabaseUnavailable
from farm.core.text import mask_url

if TYPE_CHECKING:  # the ORM: not for the CLI's light reads (`farm.server.db.reads`)
    from sqlalchemy.orm import Session, sessionmaker

SQLITE_BUSY_TIMEOUT_MS = 30_000
"""How long a SQLite writer waits for another process's write lock before failing."""


def make_engine(url: str) -> Engine:
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        return create_engine(url, pool_pre_ping=True)
    if parsed.database and parsed.database != ":memory:":
        Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000})

    @event.listens_for(engine, "connect")
    def _sqlite_pragmas(connection, _record) -> None:
        cursor = connection.cursor()
        cursor.execute("PRAGMA foreign_keys = ON")
        cursor.execute("PRAGMA journal_mode = WAL")  # readers do not block the writer
        cursor.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
        cursor.close()

    return engine


@contextlib.contextmanager
def database_errors(url: str) -> Iterator[None]:
    """Turn the driver's connection errors into DatabaseUnavailable, naming the setting."""
    try:
        yield
    except OperationalError as error:
        orig = error.orig or error
        first = (str(orig).strip().splitlines() or [type(orig).__name__])[0]
        raise DatabaseUnavailable(
            f"database error (FARM_DATABASE_URL={mask_url(url)}): {first}"
        ) from error


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    from sqlalchemy.orm import sessionmaker

    return sessionmaker(engine, expire_on_commit=False)


def alembic_config(url: str):
    """Alembic configuration for `url`, using the migrations shipped inside the package."""
    from alembic.config import Config  # alembic: only to migrate

    config = Config()
    config.set_main_option("script_location", str(files("farm.migrations")))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def head_revision() -> str:
    """The newest migration's revision, without Alembic: each file in farm.migrations.versions
    is named after its revision (`0010_worker_toolchains.py` is revision "0010", one line of
    history; tests/unit/test_cli_startup.py checks this against Alembic's own head)."""
    versions = files("farm.migrations").joinpath("versions").iterdir()
    return max(f.name.split("_", 1)[0] for f in versions if f.name[:4].isdigit())


def sqlite_at_head(url: str) -> bool:
    """Whether the SQLite database at `url` exists and is at `head_revision()`: then opening
    the embedded farm needs no Alembic (loading it and every migration took ~0.3 s of each
    `farm jobs`)."""
    path = make_url(url).database
    if not path or path == ":memory:" or not Path(path).is_file():
        return False
    try:
        with contextlib.closing(sqlite3.connect(f"file:{quote(path)}?mode=ro", uri=True)) as db:
            row = db.execute("SELECT version_num FROM alembic_version").fetchone()
    except sqlite3.Error:
        return False
    return row is not None and row[0] == head_revision()


def upgrade_database(url: str, revision: str = "head") -> str | None:
    """Upgrade the schema to `revision`; returns the revision the database is at after."""
    from alembic import command  # alembic: only to migrate
    from alembic.runtime.migration import MigrationContext

    engine = make_engine(url)
    try:
        with engine.begin() as connection:
            config = alembic_config(url)
            config.attributes["connection"] = connection
            command.upgrade(config, revision)
            return MigrationContext.configure(connection).get_current_revision()
    finally:
        engine.dispose()


def downgrade_database(url: str, revision: str = "base") -> None:
    from alembic import command  # alembic: only to migrate

    engine = make_engine(url)
    try:
        with engine.begin() as connection:
            config = alembic_config(url)
            config.attributes["connection"] = connection
            command.downgrade(config, revision)
    finally:
        engine.dispose()


def rows_changed(session: Session, statement: Executable) -> int:
    """Run an UPDATE or DELETE and return how many rows it changed: the conditional claims
    (`UPDATE ... WHERE state = 'queued'`) decide by this count, not by a read before."""
    result = cast("CursorResult[Any]", session.execute(statement))
    return result.rowcount
