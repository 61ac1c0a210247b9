"""`/readyz`, cheap: the process's own database pool and store client, one kept broker
connection, and one answer reused for `FARM_READYZ_CACHE_SECONDS`.

Building an engine, a broker connection and a boto3 client on every call cost about 23 ms of
CPU per call, so some 35 probes a second took two cores and slowed every other request. Now a
probe within the cache window costs a dictionary lookup, and while one thread checks, the
others answer with the last answer rather than queue behind it (a stuck service must not take
every thread of the API).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from sqlalchemy import text

from farm.core.checks import Check
from farm.server.context import FarmContext
from farm.server.doctor import (
    BrokerProbe,
    broker_check,
    database_check,
    redacted,
    storage_check,
)


class Readiness:
    """The readiness of one API process; thread-safe."""

    def __init__(
        self,
        farm: FarmContext,
        cache_seconds: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.farm = farm
        self.cache_seconds = cache_seconds
        self.clock = clock
        self.checked = 0
        """How many times the services were checked (the rest were answered from the cache)."""
        self._broker = BrokerProbe(farm.settings.broker_url) if farm.settings.broker_url else None
        self._lock = threading.Lock()
        self._answer: list[Check] | None = None
        self._at = 0.0

    def checks(self) -> list[Check]:
        answer = self._answer
        if answer is not None and self.clock() - self._at < self.cache_seconds:
            return answer
        # Without an answer yet, wait for the check under way; with one, give it meanwhile.
        if not self._lock.acquire(blocking=answer is None):
            assert answer is not None
            return answer
        try:
            if self._answer is not None and self.clock() - self._at < self.cache_seconds:
                return self._answer
            self._answer = self._check()
            self._at = self.clock()
            self.checked += 1
            return self._answer
        finally:
            self._lock.release()

    def _check(self) -> list[Check]:
        farm, settings = self.farm, self.farm.settings
        checks = [database_check(settings.resolved_database_url, self._database_ping)]
        if self._broker is not None and settings.broker_url:
            checks.append(broker_check(settings.broker_url, self._broker.ping))
        checks.append(storage_check(settings.resolved_storage_url, lambda: farm.store))
        return redacted(checks, settings)

    def _database_ping(self) -> None:
        # The pool's own session (pre-ping on): the driver's error, not a wrapped one.
        with self.farm.sessions() as session:
            session.execute(text("SELECT 1"))

    def close(self) -> None:
        with self._lock:
            if self._broker is not None:
                self._broker.close()
