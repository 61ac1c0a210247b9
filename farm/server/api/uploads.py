"""A bound on the model uploads one API process streams at once.

Each upload holds up to ~80 MiB while it streams (the piece being received, and four 16 MiB
parts in flight to S3), so 48 at once took an API from 0.7 to 2.1 GB, and glibc kept 1.4 to
1.8 GB of it after they ended. Past the bound an upload is answered at once, before its body
is read, with 503 `too_many_uploads` and Retry-After; the client waits and tries again.

The slots are shared fairly: one token streams at most `per_token` uploads at once (429
`too_many_uploads_for_token` past it), so four clients of one token dripping a byte every 10 s
no longer hold every slot; and each upload must arrive whole by a total deadline
(`farm.server.api.limits.BodyLimit`), so a slot is never held longer than its body needs at
FARM_API_UPLOAD_MIN_BYTES_PER_SECOND.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

from fastapi import Request

from farm.core.errors import ApiError, TooManyUploads

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
    """At most `limit` uploads at once, and at most `per_token` of one token (0: no such
    bound). Taken and given back on the event loop's thread only (no await between the check
    and the count), so plain counters are enough."""

    def __init__(self, limit: int, per_token: int = 0) -> None:
        self.limit = limit
        self.per_token = per_token
        self.taken = 0
        self.by_token: Counter[str] = Counter()

    @contextlib.contextmanager
    def hold(self, token: str = "") -> Iterator[None]:
        if self.per_token and self.by_token[token] >= self.per_token:
            raise TooManyUploads(
                f"token {token!r} is already streaming {self.by_token[token]} uploads to this "
                "API process; send the next one when one has finished",
                setting="FARM_MAX_UPLOADS_PER_TOKEN",
                limit=self.per_token,
            )
        if self.taken >= self.limit:
            raise UploadsBusy(
                f"this API process is streaming {self.taken} uploads, its limit "
                f"(FARM_MAX_CONCURRENT_UPLOADS={self.limit}); retry after Retry-After"
            )
        self.taken += 1
        self.by_token[token] += 1
        try:
            yield
        finally:
            self.taken -= 1
            self.by_token[token] -= 1
            if not self.by_token[token]:
                del self.by_token[token]


def upload_slots(request: Request, limit: int, per_token: int = 0) -> UploadSlots:
    """The app's slots, made on the first upload."""
    slots = getattr(request.app.state, "upload_slots", None)
    if slots is None:
        slots = request.app.state.upload_slots = UploadSlots(limit, per_token)
    return slots
