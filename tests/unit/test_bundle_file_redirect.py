"""`FarmClient.open_bundle_file` through a presigned redirect: the client made for the
redirect is closed with the reader (it kept its keep-alive socket open until garbage
collection, one per bundle file read)."""

from __future__ import annotations

import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from farm.client import FarmClient

BODY = os.urandom(1000)


class RedirectingFarm:
    """Answers every bundle file with a redirect to its own `/presigned` object."""

    def __init__(self) -> None:
        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as S3 and the API

            def do_GET(self) -> None:
                if self.path.startswith("/v1/bundle-files/"):
                    self.send_response(307)
                    self.send_header("Location", f"{farm.url}/presigned")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(BODY)))
                self.end_headers()
                self.wfile.write(BODY)

            def log_message(self, *args: object) -> None:
                pass

        farm = self
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_the_redirects_connection_is_closed_with_the_reader():
    farm = RedirectingFarm()
    client = FarmClient(farm.url, "token")
    try:
        before = open_descriptors()
        readers = []
        for _ in range(20):
            reader = client.open_bundle_file("a" * 64, 0)
            assert reader.read(2 * len(BODY)) == BODY
            reader.close()
            readers.append(reader)  # a caller keeping its reader keeps nothing open
        deadline = time.monotonic() + 10  # the server's side closes when it sees the end
        while open_descriptors() > before + 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert open_descriptors() <= before + 4  # the API's one keep-alive connection, both ends
    finally:
        client.close()
        farm.server.shutdown()
        farm.server.server_close()
