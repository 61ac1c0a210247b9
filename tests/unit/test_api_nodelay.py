"""The API sets TCP_NODELAY on every connection: with `--workers` > 1 uvicorn binds the socket
itself and asyncio leaves Nagle on, which delayed every answer by ~40 ms (44 ms -> 1.7 ms
median for /healthz with 2 workers, measured). Speed lives in bench/; this pins the rule."""

from __future__ import annotations

import socket

from farm.server.api.timeouts import _no_delay


class _Transport:
    def __init__(self, sock: socket.socket | None) -> None:
        self.sock = sock

    def get_extra_info(self, name: str):
        return self.sock if name == "socket" else None


def test_an_accepted_tcp_connection_gets_tcp_nodelay():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:  # proto 0, as uvicorn
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        with socket.create_connection(listener.getsockname()) as _client:
            accepted, _ = listener.accept()
            with accepted:
                assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 0
                _no_delay(_Transport(accepted))
                assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1


def test_a_unix_socket_or_no_socket_is_left_alone():
    left, right = socket.socketpair()
    with left, right:
        _no_delay(_Transport(left))  # AF_UNIX: no TCP options to set
    _no_delay(_Transport(None))
