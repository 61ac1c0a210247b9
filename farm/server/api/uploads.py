"""A bound on the model uploads one API process streams at once.

Each upload holds up to ~80 MiB while it streams (the piece being received, and four 16 MiB
parts in flight to S3), so 48 at once took an API from 0.7 to 2.1 GB, and glibc kept 1.4 to
1.8 GB of it after they ended. Past the bound an upload is answered at once, before its body
is read, with 503 `too_many_uploads` and Retry-After; the client waits and tries again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from fastapi import Request

from farm.core.errors import ApiError

RETRY_AFTER_SECONDS = 1
"""Retry-After of a turned-away upload: a slot frees as soon as any upload ends (with the API's
usual 5 s, 48 uploads of 32 MiB at once took 80 s, against 32 s unbounded)."""


class UploadsBusy(ApiError):
    """503 `too_many_uploads`, answered before the body is read, and the connection closed:
    kept open, it would take in the whole body first (the client sends it all before it
    reads the answer: a 256 MiB upload turned away cost 256 MiB; closed, about 4 MiB)."""

    headers = {"Retry-After": str(RETRY_AFTER_SECONDS), "Connection": "close"}  # noqa: RUF012

    def __init__(self, message: str) -> None:
        super().__init__(503, "too_many_uploads", message)


class UploadSlots:
    """At most `limit` uploads at once. Taken and given back on the event loop's thread only
    (no await between the check and the count), so a plain counter is enough."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.taken = 0

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        if self.taken >= self.limit:
            raise UploadsBusy(
                f"this API process is streaming {self.taken} uploads, its limit "
                f"(FARM_MAX_CONCURRENT_UPLOADS={self.limit}); retry after Retry-After"
            )
        self.taken += 1
        try:
            yield
        finally:
            self.taken -= 1


def upload_slots(request: Request, limit: int) -> UploadSlots:
    """The app's slots, made on the first upload."""
    slots = getattr(request.app.state, "upload_slots", None)
    if slots is None:
        slots = request.app.state.upload_slots = UploadSlots(limit)
    return slots
