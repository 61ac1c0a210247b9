"""The farm as this process sees it: settings, database sessions, blob store, dispatcher."""

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
            store=open_store(settings.resolved_storage_url, settings),
        )

    @contextmanager
    def session(self) -> Iterator[Session]:
        with self.sessions() as session:
            yield session

    def run(self, job_id: int):
        """Compile a job in this process's child (the embedded farm's worker)."""
        from farm.runner import RunLimits, run_job
        from farm.signing import load_signer

        settings = self.settings
        limits = RunLimits(
            settings.lease_seconds, settings.max_run_seconds, settings.resolved_compile_memory_bytes
        )
        signer = load_signer(self.settings.resolved_signing_key, create=not self.settings.served)
        return run_job(self.sessions, self.store, job_id, limits=limits, signer=signer)

    def dispatcher(self):
        from farm.dispatch import Dispatcher

        return Dispatcher(self.settings)
