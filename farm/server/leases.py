"""A lease kept alive in the background while its holder works (a job, a bundle part, a
reference run): one thread calls the holder's `renew` every `interval` seconds.

`renew()` returns False once the row is no longer the holder's (taken over, cancelled by an
admin, finished by another run): `lost` is then set and the holder's `should_stop` says so; the
work in progress is abandoned and nothing of it recorded. A renewal that raises (the database
is briefly away) is logged and tried again at the next tick: the lease's own length allows
two misses (holders renew every third of it).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class Renewing:
    def __init__(self, renew: Callable[[], bool], interval: float, name: str) -> None:
        self.renew, self.interval, self.name = renew, interval, name
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def __enter__(self) -> Renewing:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def should_stop(self) -> bool:
        return self.lost.is_set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                held = self.renew()
            except Exception:
                log.warning("renewing the lease of %s failed", self.name, exc_info=True)
                continue
            if not held:
                log.warning("%s is no longer ours; stopping", self.name)
                self.lost.set()
                return
