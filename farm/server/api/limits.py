"""A cap on request bodies: every route but the model upload (which has its own, larger limit
and streams) takes at most `max_bytes`. Pure ASGI, so a chunked body without Content-Length
is counted as it arrives and never buffered past the cap."""

from __future__ import annotations

import json
import re

UPLOAD_PATH = re.compile(r"^/v1/models/[^/]+$")


class BodyLimit:
    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or (
            scope["method"] == "PUT" and UPLOAD_PATH.match(scope["path"])
        ):
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(send)
        received, refused = 0, False

        async def counting_receive():
            # FastAPI turns any error raised while reading a body into a 400, so the refusal
            # is sent from here and the application sees the client go away.
            nonlocal received, refused
            message = await receive()
            if message["type"] == "http.request" and not refused:
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    refused = True
                    await self._refuse(send)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message) -> None:
            if not refused:
                await send(message)

        await self.app(scope, counting_receive, guarded_send)

    async def _refuse(self, send) -> None:
        body = json.dumps(
            {
                "code": "too_large",
                "message": f"request body over {self.max_bytes} bytes (FARM_MAX_REQUEST_BYTES)",
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
