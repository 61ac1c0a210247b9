"""The embedded farm: database session and blob store from settings, on this machine."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from sqlalchemy.orm import Session, sessionmaker

from farm.config import Settings
from farm.db.session import make_engine, make_session_factory, upgrade_database
from farm.storage import BlobStore, open_store


@dataclass
class LocalFarm:
    settings: Settings
    sessions: sessionmaker[Session]
    store: BlobStore

    @classmethod
    def open(cls, settings: Settings) -> LocalFarm:
        url = settings.resolved_database_url
        if url.startswith("sqlite"):
            # The embedded default must work with nothing set up: bring its schema to head.
            # A served database is upgraded by `farm db upgrade`, deliberately.
            upgrade_database(url)
        return cls(
            settings=settings,
            sessions=make_session_factory(make_engine(url)),
            store=open_store(settings.resolved_storage_url),
        )

    @contextmanager
    def session(self) -> Iterator[Session]:
        with self.sessions() as session:
            yield session
