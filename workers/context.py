"""Per-process database, store and dispatcher for tasks, created after the pool forks."""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property

from sqlalchemy.orm import Session, sessionmaker

from farm.config import Settings, get_settings
from farm.db.session import make_engine, make_session_factory
from farm.storage import BlobStore, open_store


@dataclass
class WorkerContext:
    settings: Settings
    pid: int

    @cached_property
    def sessions(self) -> sessionmaker[Session]:
        return make_session_factory(make_engine(self.settings.resolved_database_url))

    @cached_property
    def store(self) -> BlobStore:
        return open_store(self.settings.resolved_storage_url, self.settings)

    @cached_property
    def model_cache(self):
        from farm.edge.cache import BlobCache

        if not self.settings.worker_model_cache_bytes:
            return None
        root = self.settings.cache_dir / "models"
        return BlobCache(root, self.settings.worker_model_cache_bytes)

    @cached_property
    def signer(self):
        from farm.signing import load_signer

        return load_signer(self.settings.resolved_signing_key, create=not self.settings.served)

    @cached_property
    def dispatcher(self):
        from farm.dispatch import Dispatcher

        return Dispatcher(self.settings)


_context: WorkerContext | None = None


def worker_context() -> WorkerContext:
    """One context per process: connections made before a fork are not shared after it."""
    global _context
    if _context is None or _context.pid != os.getpid():
        _context = WorkerContext(get_settings(), os.getpid())
    return _context
