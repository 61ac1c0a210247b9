"""A value computed from the database at most once per period per API process, served from
memory in between: what the dashboard's summary cards and `/metrics` show.

Both aggregate whole tables (jobs by state, blobs and bytes, pulls by target), which at a
million rows costs the database hundreds of milliseconds to seconds per request; a Prometheus
scrape every 15 s, or a dashboard reloaded by several people, would repeat that cost for numbers
that move slowly. So the first request computes the value; later ones get the last value at
once, and one that finds it older than the period starts a refresh in a background thread
(stale-while-revalidate): no request waits for an aggregate after the first, and each process
runs at most one at a time. The numbers are then up to a period (plus one computation) old.

A request that finds the first computation under way waits for it rather than starting
another, so concurrent first requests after a restart cost one computation.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


class Cached(Generic[T]):
    def __init__(self, compute: Callable[[], T], period_seconds: float) -> None:
        self._compute = compute
        self.period_seconds = period_seconds
        self._lock = threading.Lock()
        self._computed = threading.Condition(self._lock)
        self._value: T | None = None
        self._computed_at = 0.0
        self._refreshing = False

    def get(self) -> T:
        """The value: computed now if there is none yet (or waited for, when a computation is
        under way), else the last one (refreshed in the background when older than the
        period)."""
        if self.period_seconds <= 0:
            return self._compute()
        with self._lock:
            while self._value is None and self._refreshing:
                self._computed.wait()
            value, age = self._value, time.monotonic() - self._computed_at
            stale = value is not None and age >= self.period_seconds and not self._refreshing
            if stale or value is None:
                self._refreshing = True
        if value is None:
            return self._refresh()
        if stale:
            threading.Thread(target=self._refresh_quietly, daemon=True).start()
        return value

    def _refresh(self) -> T:
        try:
            value = self._compute()
        except BaseException:
            with self._lock:
                self._refreshing = False
                self._computed.notify_all()
            raise
        with self._lock:
            self._value, self._computed_at = value, time.monotonic()
            self._refreshing = False
            self._computed.notify_all()
        return value

    def _refresh_quietly(self) -> None:
        try:
            self._refresh()
        except Exception:  # the last value stays; the next request retries
            log.exception("refreshing a cached aggregate failed; serving the last value")
