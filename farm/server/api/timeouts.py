"""A deadline for request heads: uvicorn's HTTP protocol, closing a connection that does not
send a complete request head within `FARM_API_HEADER_TIMEOUT_SECONDS` of connecting, or of
its previous response.

uvicorn has a keep-alive timeout, but none for a head that never completes: a client that
sends one header byte a second (slowloris) keeps its connection forever, and a few hundred of
them held every connection the server had (600 held for 20 s and more). The application never
sees such a request, so the guard lives where the bytes arrive, in the protocol. (Bodies that
arrive too slowly are answered 408 by `farm.server.api.limits.BodyLimit`.)

The protocol is h11's, which uvicorn uses unless httptools is installed; `farm api` names it
explicitly so the guard holds either way.
"""

from __future__ import annotations

import asyncio
import functools
import socket
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from farm.core.config import get_settings


@functools.cache
def head_timeout_seconds() -> float:
    """This process's `FARM_API_HEADER_TIMEOUT_SECONDS` (read once: it is needed per
    connection)."""
    return get_settings().api_header_timeout_seconds


def _no_delay(transport: Any) -> None:
    """TCP_NODELAY on a TCP connection. With `--workers` > 1 uvicorn binds the listening
    socket itself (protocol 0), asyncio then skips its own TCP_NODELAY on accepted connections
    (it checks for IPPROTO_TCP), and an answer written in two sends (head, body) waits for the
    client's delayed ACK: about 40 ms on every request (bench/catalog.py measured it)."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class HeadTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request head."""

    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: Any) -> None:
        _no_delay(transport)
        super().connection_made(transport)
        self._arm_head_timer()

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a complete head: its request runs
            self._disarm_head_timer()

    def on_response_complete(self) -> None:
        # Armed first: the next request may already be buffered, and handling it (in the
        # call below) disarms the timer again.
        self._arm_head_timer()
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        self._disarm_head_timer()
        seconds = head_timeout_seconds()
        if seconds > 0:
            self._head_timer = self.loop.call_later(seconds, self._head_too_slow)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_too_slow(self) -> None:
        self._head_timer = None
        if self.cycle is not None and not self.cycle.response_complete:
            return  # a request is running (its head arrived as the timer fired)
        if not self.transport.is_closing():
            # DEBUG: a flood of slow clients must not flood the log as well.
            self.logger.debug(
                "%s - closed: no complete request head within %g s "
                "(FARM_API_HEADER_TIMEOUT_SECONDS)",
                f"{self.client[0]}:{self.client[1]}" if self.client else "a client",
                head_timeout_seconds(),
            )
            self.transport.close()
