"""Fault injection helpers: a private Redis we may restart, a TCP proxy we may cut."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import threading
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class PrivateRedis:
    """redis-server on its own loopback port with AOF, stopped by its pid, never the shared one."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.port = free_port()
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [
                "redis-server",
                "--bind",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--dir",
                str(self.directory),
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
                "--maxmemory-policy",
                "noeviction",
                "--save",
                "",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port)):
                return
            time.sleep(0.05)
        raise RuntimeError("private redis did not start")

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()  # SIGTERM: Redis flushes the AOF and exits
            self.process.wait(timeout=10)
            self.process = None


class TcpProxy:
    """Forwards a loopback port to a target; `cut()` closes every connection and the port.

    With `cut_once_after`, the first connection that has carried that many bytes back to its
    client is broken off mid-stream (a dropped download); later connections pass whole.
    `sent` keeps what clients sent, to check what they asked for after the cut.
    """

    def __init__(self, target_port: int, cut_once_after: int | None = None) -> None:
        self.target_port = target_port
        self.cut_once_after = cut_once_after
        self.cuts = 0
        self.sent = bytearray()
        self.port = free_port()
        self._listener: socket.socket | None = None
        self._connections: list[socket.socket] = []
        self._lock = threading.Lock()

    def start(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def cut(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
            connections, self._connections = self._connections, []
        if listener is not None:
            # shutdown() wakes the thread blocked in accept(); close() alone would not, and
            # the port would go on accepting.
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
            connection.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            with self._lock:
                self._connections += [client, upstream]
            for a, b, back in ((client, upstream, False), (upstream, client, True)):
                threading.Thread(target=self._pipe, args=(a, b, back), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, back: bool) -> None:
        carried = 0
        with contextlib.suppress(OSError):
            while data := source.recv(1 << 16):
                if not back:
                    self.sent += data
                sink.sendall(data)
                carried += len(data)
                if back and self._should_cut(carried):
                    for end in (source, sink):
                        end.shutdown(socket.SHUT_RDWR)
                    return
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def _should_cut(self, carried: int) -> bool:
        with self._lock:
            if self.cut_once_after is None or self.cuts or carried < self.cut_once_after:
                return False
            self.cuts += 1
            return True
