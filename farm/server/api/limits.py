"""Caps on request bodies, in size and in time.

Size: every route but the model upload (which has its own, larger limit and streams) takes at
most `max_bytes`. Pure ASGI, so a chunked body without Content-Length is counted as it arrives
and never buffered past the cap.

Time: a client that stops sending its body holds a connection and a task for as long as it
likes, and a few hundred such clients hold the server. Each wait for the next piece of a body
is capped at `body_timeout_seconds`; a body of any route but the upload (at most `max_bytes`)
must also arrive whole within that long, so a client cannot drip it a byte at a time. A
model upload, which may be gigabytes, must arrive whole within that long plus its
Content-Length at `upload_min_bytes_per_second`: a client sending one byte just before each
per-piece timeout no longer holds an upload slot for ever. Past any of these, the client is
answered 408 and the connection closed. (A request head that never
completes is cut off before the application sees it: `farm.server.api.timeouts`.)
"""

from __future__ import annotations

import asyncio
import json
import re
import time

UPLOAD_PATH = re.compile(r"^/v1/models/[^/]+$")


class BodyLimit:
    def __init__(
        self,
        app,
        max_bytes: int,
        body_timeout_seconds: float | None = None,
        upload_min_bytes_per_second: int = 0,
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.body_timeout_seconds = body_timeout_seconds
        self.upload_min_bytes_per_second = upload_min_bytes_per_second

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        upload = scope["method"] == "PUT" and UPLOAD_PATH.match(scope["path"]) is not None
        exchange = _Exchange(send)
        declared = dict(scope["headers"]).get(b"content-length")
        length = int(declared) if declared is not None and declared.isdigit() else None
        if not upload and length is not None and length > self.max_bytes:
            return await self._refuse(exchange)
        timed = self._timed(receive, exchange, self._total_seconds(upload, length))
        if upload:
            return await self.app(scope, timed, exchange.send)
        received = 0

        async def counting_receive():
            # FastAPI turns any error raised while reading a body into a 400, so the refusal
            # is sent from here and the application sees the client go away.
            nonlocal received
            message = await timed()
            if message["type"] == "http.request" and not exchange.answered:
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    await self._refuse(exchange)
                    return {"type": "http.disconnect"}
            return message

        await self.app(scope, counting_receive, exchange.send)

    def _total_seconds(self, upload: bool, length: int | None) -> float | None:
        """How long the whole body may take: the body timeout for any route but the upload;
        for an upload, that plus its length at the minimum rate (None: no total deadline)."""
        limit = self.body_timeout_seconds
        if not upload:
            return limit
        if not (limit and self.upload_min_bytes_per_second and length is not None):
            return None
        return limit + length / self.upload_min_bytes_per_second

    def _timed(self, receive, exchange: _Exchange, total_seconds: float | None):
        """`receive` that answers 408 and reports a disconnect when the client is too slow
        with its body: a piece later than the body timeout, or the body not whole within
        `total_seconds`. Once the body is complete, `receive` waits untimed: a response that
        streams for minutes listens on it for the client leaving."""
        limit = self.body_timeout_seconds
        if not limit:
            return receive
        deadline = time.monotonic() + total_seconds if total_seconds else None
        body_done = False

        async def timed_receive():
            nonlocal body_done
            if exchange.answered:
                return {"type": "http.disconnect"}
            if body_done:
                return await receive()
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            wait = limit if left is None else min(limit, left)
            try:
                message = await asyncio.wait_for(receive(), wait)
                if message["type"] != "http.request" or not message.get("more_body", False):
                    body_done = True
                return message
            except TimeoutError:
                if left is not None and left <= limit and total_seconds != limit:
                    why = (
                        f"the upload did not arrive whole within {total_seconds:.0f} s "
                        f"(FARM_API_BODY_TIMEOUT_SECONDS={limit:g} plus its size at "
                        f"FARM_API_UPLOAD_MIN_BYTES_PER_SECOND={self.upload_min_bytes_per_second})"
                    )
                else:
                    why = (
                        f"the request body did not arrive within {limit:g} s "
                        "(FARM_API_BODY_TIMEOUT_SECONDS)"
                    )
                await exchange.answer(408, "request_timeout", why, close=True)
                return {"type": "http.disconnect"}

        return timed_receive

    async def _refuse(self, exchange: _Exchange) -> None:
        await exchange.answer(
            413, "too_large", f"request body over {self.max_bytes} bytes (FARM_MAX_REQUEST_BYTES)"
        )


class _Exchange:
    """One request's answer: the application's, or one this middleware sends in its place
    (after which whatever the application sends is dropped: it was told the client left)."""

    def __init__(self, send) -> None:
        self._send = send
        self.started = False
        self.answered = False

    async def send(self, message) -> None:
        if self.answered:
            return
        if message["type"] == "http.response.start":
            self.started = True
        await self._send(message)

    async def answer(self, status: int, code: str, message: str, *, close: bool = False) -> None:
        """A JSON error answer, unless the application already began its own; with `close`,
        the connection closes after it (the client is not sending the rest of its body)."""
        if self.answered or self.started:
            return
        self.answered = True
        body = json.dumps({"code": code, "message": message}).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ]
        if close:
            headers.append((b"connection", b"close"))
        await self._send({"type": "http.response.start", "status": status, "headers": headers})
        await self._send({"type": "http.response.body", "body": body})
