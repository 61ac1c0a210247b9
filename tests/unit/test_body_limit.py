"""The body deadline of `BodyLimit`: a body that stalls is answered 408; a response that goes
on after its body arrived is never cut by it (Starlette listens on `receive` for the client
leaving while it streams a response, such as a download from the local store)."""

from __future__ import annotations

import asyncio
import json

from farm.server.api.limits import BodyLimit

SCOPE = {"type": "http", "method": "POST", "path": "/v1/submissions", "headers": []}


def run(app, messages: list[dict], timeout: float = 0.2) -> tuple[list[dict], list[dict]]:
    """`app` behind BodyLimit(body timeout `timeout`), fed `messages` then nothing (a client
    that says no more); returns what it sent and what it received."""
    sent, received = [], []

    async def main() -> None:
        queue: asyncio.Queue[dict] = asyncio.Queue()
        for message in messages:
            queue.put_nowait(message)

        async def receive() -> dict:
            return await queue.get()

        async def send(message: dict) -> None:
            sent.append(message)

        async def recording(scope, receive, send) -> None:
            async def noting() -> dict:
                message = await receive()
                received.append(message)
                return message

            await app(scope, noting, send)

        limit = BodyLimit(recording, max_bytes=1000, body_timeout_seconds=timeout)
        await limit(dict(SCOPE), receive, send)

    asyncio.run(main())
    return sent, received


async def read_body_then_stream(scope, receive, send) -> None:
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": []})
    listener = asyncio.ensure_future(receive())  # as Starlette's streaming responses do
    for _ in range(5):  # 0.5 s of response: past the 0.2 s body deadline
        await asyncio.sleep(0.1)
        assert not listener.done(), "the client was reported gone while it was not"
        await send({"type": "http.response.body", "body": b"x", "more_body": True})
    listener.cancel()
    await send({"type": "http.response.body", "body": b""})


def test_a_response_after_a_complete_body_is_not_cut_by_the_body_deadline():
    sent, _ = run(
        read_body_then_stream,
        [
            {"type": "http.request", "body": b"{}", "more_body": True},
            {"type": "http.request", "body": b"", "more_body": False},
        ],
    )
    assert sent[0]["status"] == 200
    assert b"".join(m.get("body", b"") for m in sent[1:]) == b"xxxxx"


async def read_body_then_answer(scope, receive, send) -> None:
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 400, "headers": []})
    await send({"type": "http.response.body", "body": b"incomplete body"})


def test_a_body_that_stalls_is_answered_408_and_the_app_sees_the_client_go():
    sent, received = run(
        read_body_then_answer, [{"type": "http.request", "body": b"{", "more_body": True}]
    )
    assert sent[0]["status"] == 408
    assert (b"connection", b"close") in sent[0]["headers"]
    assert json.loads(sent[1]["body"])["code"] == "request_timeout"
    assert received[-1] == {"type": "http.disconnect"}
    assert len(sent) == 2  # what the app sent after it was told the client left is dropped
