"""Fault injection helpers: a private Redis and PostgreSQL we may stop, a TCP proxy we may cut,
a tiny temporary disk for a worker."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import uuid
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


class PrivatePostgres:
    """A PostgreSQL cluster of our own (initdb, trust auth) on its own loopback port, stopped
    with `pg_ctl -m immediate` (a crash: no shutdown checkpoint, recovery on the next start).
    Never the machine's shared server.

    The data lives in a directory of its own under /tmp, not in pytest's tmp_path: as root the
    server runs as the `postgres` user, which cannot enter pytest's 0700 directories.
    """

    def __init__(self) -> None:
        found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=_version)
        initdb = str(found[-1]) if found else shutil.which("initdb")
        if initdb is None:
            raise RuntimeError("no PostgreSQL server binaries (install postgresql)")
        self.bin = Path(initdb).parent
        self.directory = Path(tempfile.mkdtemp(prefix="farm-test-pg-"))
        self.data = self.directory / "data"
        self.port = free_port()
        self.as_postgres = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if self.as_postgres:
            shutil.chown(self.directory, "postgres")
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "-A", "trust", "-N")

    @property
    def admin_url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def create_database(self) -> str:
        """A fresh database in this cluster; its SQLAlchemy URL."""
        import psycopg

        name = f"farm_{uuid.uuid4().hex[:12]}"
        conninfo = f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres"
        with psycopg.connect(conninfo, autocommit=True) as connection:
            connection.execute(f'CREATE DATABASE "{name}"')
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{name}"

    def start(self) -> None:
        options = f"-p {self.port} -k {self.directory} -c listen_addresses=127.0.0.1 -c fsync=off"
        log = str(self.directory / "postgres.log")
        self._run("pg_ctl", "-D", str(self.data), "-l", log, "-w", "-o", options, "start")

    def stop(self) -> None:
        """Like a crash: every server process quits at once, nothing is flushed."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")

    def remove(self) -> None:
        if (self.data / "postmaster.pid").exists():
            self.stop()
        shutil.rmtree(self.directory, ignore_errors=True)

    def _run(self, program: str, *args: str) -> None:
        subprocess.run(
            [*self.as_postgres, str(self.bin / program), *args],
            check=True,
            capture_output=True,
            timeout=60,
        )


def _version(initdb: Path) -> tuple[int, ...]:
    return tuple(int(part) for part in initdb.parent.parent.name.split(".") if part.isdigit())


def tiny_disk_command(directory: Path, size_bytes: int) -> tuple[list[str], str]:
    """A command prefix that runs a program with `directory` on a disk of `size_bytes`.

    A tmpfs of that size mounted in a mount namespace of the program's own (it vanishes with
    the program, and nobody else sees it) when this machine allows that (root with
    CAP_SYS_ADMIN); otherwise RLIMIT_FSIZE (`prlimit --fsize`), under which any file the
    program writes past that size fails with EFBIG (Python ignores SIGXFSZ). Returns the
    prefix and which of the two it is.
    """
    mount = f'mount -t tmpfs -o size={size_bytes} farm-tiny-disk "$0" && exec "$@"'
    namespace = ["unshare", "--mount", "--propagation", "private", "sh", "-c", mount]
    probe = subprocess.run(
        [*namespace, str(directory), "true"], capture_output=True, timeout=30, check=False
    )
    if probe.returncode == 0:
        return [*namespace, str(directory)], "tmpfs"
    return ["prlimit", f"--fsize={size_bytes}", "--"], "RLIMIT_FSIZE"


class TcpProxy:
    """Forwards a loopback port to a target; `cut()` closes every connection and the port.

    With `cut_once_after`, the first connection that has carried that many bytes back to its
    client is broken off mid-stream (a dropped download); later connections pass whole. With
    `down_after`, the first connection to carry that many bytes back takes the whole proxy
    down with it (as `cut()`: the service is unreachable) until `start()` is called again.
    `sent` keeps what clients sent, to check what they asked for after the cut. While
    `stalled` is set, nothing is carried either way: the service takes requests and never
    answers them.
    """

    def __init__(
        self, target_port: int, cut_once_after: int | None = None, down_after: int | None = None
    ) -> None:
        self.target_port = target_port
        self.cut_once_after = cut_once_after
        self.down_after = down_after
        self.cuts = 0
        self.sent = bytearray()
        self.port = free_port()
        self._listener: socket.socket | None = None
        self._connections: list[socket.socket] = []
        self._lock = threading.Lock()
        self.stalled = threading.Event()

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
                while self.stalled.is_set():
                    time.sleep(0.05)
                if not back:
                    self.sent += data
                sink.sendall(data)
                carried += len(data)
                if back and self._should_cut(carried):
                    for end in (source, sink):
                        end.shutdown(socket.SHUT_RDWR)
                    return
                if back and self._should_go_down(carried):
                    self.cut()
                    return
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def _should_cut(self, carried: int) -> bool:
        with self._lock:
            if self.cut_once_after is None or self.cuts or carried < self.cut_once_after:
                return False
            self.cuts += 1
            return True

    def _should_go_down(self, carried: int) -> bool:
        with self._lock:
            if self.down_after is None or carried < self.down_after:
                return False
            self.down_after = None
            self.cuts += 1
            return True
