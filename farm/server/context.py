"""The composition root: the one place that turns `Settings` into the farm's parts.

Embedded mode (the CLI without `FARM_API_URL`), the API process and each Celery worker process
all build a `FarmContext` and take what they need from it: database sessions, the blob store,
the signer, the compile limits, the worker's model cache and the dispatcher. Every part is made
on first use, so a command that only reads the database never opens the store or the broker.

A context belongs to one process: connections made before a fork are not shared after it
(`farm.workers` builds one per pool process).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cached_property
from typing import TYPE_CHECKING

from farm.core.config import get_settings
from farm.server.db.session import (
    database_errors,
    make_engine,
    make_session_factory,
    sqlite_at_head,
    upgrade_database,
)

# The ORM, the dispatchers, the runner and signing (cryptography) load only where they are
# used: the CLI's read commands take `engine` alone (`farm.server.db.reads`).
if TYPE_CHECKING:
    from sqlalchemy import Engine
    from sqlalchemy.orm import Session, sessionmaker

    from farm.core.apikey import ApiSigner
    from farm.core.config import Settings
    from farm.core.filecache import BlobCache
    from farm.core.signing import Signer, TrustedKeys
    from farm.core.status import StatusSigner
    from farm.server.db.models import Job
    from farm.server.jobs.dispatch import Dispatcher
    from farm.server.jobs.runner import RunLimits
    from farm.server.storage import BlobStore


class FarmContext:
    """Settings and the parts built from them, for one process."""

    def __init__(self, settings: Settings, *, worker: str | None = None) -> None:
        self.settings = settings
        self.worker = worker
        """The name this process's jobs record in `jobs.worker` (a Celery worker's name)."""
        self.pid = os.getpid()

    @classmethod
    def open(cls, settings: Settings | None = None, *, worker: str | None = None) -> FarmContext:
        """A context whose database is ready: the embedded default (SQLite) is brought to the
        schema's head here, since it must work with nothing set up; a served database is
        upgraded by `farm db upgrade`, deliberately."""
        context = cls(settings or get_settings(), worker=worker)
        url = context.settings.resolved_database_url
        if url.startswith("sqlite") and not sqlite_at_head(url):
            with database_errors(url):
                upgrade_database(url)
        return context

    @cached_property
    def engine(self) -> Engine:
        return make_engine(self.settings.resolved_database_url)

    @cached_property
    def sessions(self) -> sessionmaker[Session]:
        return make_session_factory(self.engine)

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A session; a database that refuses or drops the connection is DatabaseUnavailable."""
        with database_errors(self.settings.resolved_database_url), self.sessions() as session:
            yield session

    @cached_property
    def _reads(self) -> sessionmaker[Session]:
        engine = self.sessions.kw["bind"]
        return make_session_factory(engine.execution_options(isolation_level="AUTOCOMMIT"))

    @contextmanager
    def read(self) -> Iterator[Session]:
        """A session for one read statement (an edge's resolve): in autocommit, so the database
        gets the query alone, with no BEGIN before it nor ROLLBACK after it (two of the four
        round trips of a resolve otherwise). Same pool, same errors as `session`."""
        with database_errors(self.settings.resolved_database_url), self._reads() as session:
            yield session

    @cached_property
    def store(self) -> BlobStore:
        from farm.server.storage import open_store

        return open_store(self.settings.resolved_storage_url, self.settings)

    @cached_property
    def signer(self) -> Signer | None:
        """Signs blobs; the embedded farm creates its key on first use, a served one must be
        given its key (`FARM_SIGNING_KEY`, `farm keys create`)."""
        from farm.core.signing import load_signer

        settings = self.settings
        return load_signer(settings.resolved_signing_key, create=not settings.served)

    @cached_property
    def trusted_keys(self) -> TrustedKeys:
        """FARM_TRUSTED_KEYS: besides its own, the keys whose signed bundle part listings this
        farm reuses (§17)."""
        from farm.core.signing import TrustedKeys

        return TrustedKeys.from_files(self.settings.trusted_key_paths)

    @cached_property
    def api_signer(self) -> ApiSigner | None:
        """Signs blob statuses and channel documents: FARM_STATUS_KEY with its certificate,
        else the blob signing key where this host holds it anyway (the embedded farm, a
        one-host farm); None: edges of this version refuse this farm's blobs and channels."""
        from farm.core.apikey import ApiSigner

        settings = self.settings
        if settings.status_key is not None:
            return ApiSigner.from_file(settings.status_key)
        signer = self.signer
        return None if signer is None else ApiSigner(signer)

    @cached_property
    def status_signer(self) -> StatusSigner | None:
        from farm.core.status import StatusSigner

        key = self.api_signer
        return None if key is None else StatusSigner(key, self.settings.status_lifetime_seconds)

    @cached_property
    def run_limits(self) -> RunLimits:
        from farm.server.jobs.runner import RunLimits

        settings = self.settings
        return RunLimits(
            settings.lease_seconds,
            settings.max_run_seconds,
            settings.resolved_compile_memory_bytes,
            max_blob_bytes=settings.max_blob_bytes,
            max_blob_ratio=settings.max_blob_ratio,
            blob_bytes_over_model=settings.blob_bytes_over_model,
            compile_user=settings.compile_user,
            compile_launcher=settings.compile_launcher,
            reference_outputs=settings.reference_outputs,
            allow_remote_code=settings.allow_remote_code,
            part_bytes=settings.blob_part_bytes,
        )

    @cached_property
    def model_cache(self) -> BlobCache | None:
        """Model files this host fetched, kept for its next jobs (`FARM_WORKER_MODEL_CACHE_BYTES`,
        0: none). Only a store that is not on this host's disk is worth caching."""
        if not (self.settings.served and self.settings.worker_model_cache_bytes):
            return None
        root = self.settings.cache_dir / "models"
        from farm.server.jobs.model_cache import open_model_cache

        return open_model_cache(root, self.settings.worker_model_cache_bytes)

    def run(self, job_id: int, *, detach_reference: bool = False) -> Job | None:
        """Run job `job_id` here: claim, compile in a child, store, record; then its blob's
        reference run, here or (`detach_reference`) in a process of its own."""
        from farm.server.jobs.runner import run_job

        return run_job(
            self.sessions,
            self.store,
            job_id,
            worker=self.worker,
            limits=self.run_limits,
            signer=self.signer,
            model_cache=self.model_cache,
            detach_reference=detach_reference,
        )

    def dispatcher(self, *, background: bool = False) -> Dispatcher:
        """Where new jobs go: the broker when served, else this process (`background`: on a
        thread of its own, for the embedded API)."""
        from farm.server.jobs.dispatch import CeleryDispatcher, InlineDispatcher

        if self.settings.served:
            return CeleryDispatcher(self.settings)
        return InlineDispatcher(self.run, background=background)
