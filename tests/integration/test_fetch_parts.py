"""fetch_parts against a real SeaweedFS (scripts/services up): parallel ranged parts, each
checked against its sha256, and the answers S3 never gives from a server of our own."""

from __future__ import annotations

import hashlib
import os
import threading
import time
import tracemalloc
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse

import pytest

from farm.client import fetch_parts
from farm.core.errors import ApiError, IntegrityMismatch
from farm.server.storage.s3 import S3Settings, S3Store
from tests.conftest import S3_CREDENTIALS, S3_ENDPOINT_URL
from tests.integration.faults import TcpProxy

MIB = 2**20
SIZE = 5 * MIB + 123


def digests(data: bytes, part_bytes: int) -> list[str]:
    return [
        hashlib.sha256(data[a : a + part_bytes]).hexdigest()
        for a in range(0, len(data), part_bytes)
    ]


@pytest.fixture
def stored(s3_store, tmp_path) -> tuple[bytes, str]:
    """SIZE random bytes in the test's own bucket prefix, and their presigned GET URL."""
    data = os.urandom(SIZE)
    (tmp_path / "object").write_bytes(data)
    s3_store.put_file("blobs/parts.blob", tmp_path / "object")
    return data, s3_store.presigned_url("blobs/parts.blob", expires_seconds=300)


@pytest.mark.parametrize("connections", [1, 4, 16])
def test_the_parts_make_the_object(stored, tmp_path, connections):
    data, url = stored
    dest, received = tmp_path / "blob", []
    fetch_parts(url, dest, SIZE, MIB, digests(data, MIB), received.append, connections)
    assert dest.read_bytes() == data
    assert sum(received) == SIZE


@pytest.mark.parametrize("left", [0, MIB, SIZE + 4096], ids=["empty", "shorter", "longer"])
def test_a_file_already_there_becomes_the_object_and_is_never_opened_to_truncate(
    stored, tmp_path, left, file_opens
):
    """The agent's lock file (empty, held open) or a download killed midway: the same file
    becomes exactly the object. It is never opened with O_TRUNC (ext4 then flushes the whole
    file when it is closed, bench/README.md "edge"), and emptied only if it holds bytes."""
    data, url = stored
    dest = tmp_path / "blob"
    dest.write_bytes(b"\xff" * left)
    held = os.open(dest, os.O_RDWR)
    file_opens["flags"].clear()  # the lock's own open, above
    try:
        fetch_parts(url, dest, SIZE, MIB, digests(data, MIB), connections=4)
        assert os.fstat(held).st_ino == dest.stat().st_ino  # the same file, not a new one
    finally:
        os.close(held)
    assert dest.read_bytes() == data
    opened = file_opens["flags"]
    assert opened and not any(flags & os.O_TRUNC for flags in opened)
    assert file_opens["truncated"] == ([0, SIZE] if left else [SIZE])


def test_a_symbolic_link_in_the_files_place_is_never_written_through(stored, tmp_path):
    data, url = stored
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_bytes(b"keep")
    (tmp_path / "blob").symlink_to(elsewhere)
    with pytest.raises(OSError):
        fetch_parts(url, tmp_path / "blob", SIZE, MIB, digests(data, MIB))
    assert elsewhere.read_bytes() == b"keep"


def test_a_part_is_never_held_whole_in_memory(stored, tmp_path):
    data, url = stored
    tracemalloc.start()
    try:
        fetch_parts(url, tmp_path / "blob", SIZE, SIZE, digests(data, SIZE), connections=1)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 * MIB  # one 1 MiB buffer for a 5 MiB part
    assert (tmp_path / "blob").read_bytes() == data


@pytest.mark.parametrize("wrong", [0, 5])
def test_a_wrong_digest_names_its_part_and_removes_the_file(stored, tmp_path, wrong):
    data, url = stored
    sha256s = digests(data, MIB)
    sha256s[wrong] = "0" * 64
    with pytest.raises(IntegrityMismatch, match=f"part {wrong} \\(offset {wrong * MIB},") as error:
        fetch_parts(url, tmp_path / "blob", SIZE, MIB, sha256s)
    assert error.value.details == {"part": wrong, "offset": wrong * MIB}
    assert not (tmp_path / "blob").exists()


def test_after_a_wrong_part_no_other_part_is_asked_for(stored, s3_url, tmp_path):
    data, _ = stored
    proxy = TcpProxy(urlparse(S3_ENDPOINT_URL).port)
    proxy.start()
    try:
        url = through(proxy, s3_url).presigned_url("blobs/parts.blob", expires_seconds=300)
        sha256s = digests(data, MIB)
        sha256s[2] = "f" * 64
        with pytest.raises(IntegrityMismatch, match="part 2 "):
            fetch_parts(url, tmp_path / "blob", SIZE, MIB, sha256s, connections=1)
    finally:
        proxy.cut()
    assert proxy.sent.count(b"GET ") == 3  # parts 0, 1 and 2, on one connection
    assert not (tmp_path / "blob").exists()


def test_a_missing_key_is_an_api_error_and_leaves_no_file(s3_store, tmp_path):
    url = s3_store.presigned_url("blobs/never-written.blob", expires_seconds=300)
    with pytest.raises(ApiError) as error:
        fetch_parts(url, tmp_path / "blob", SIZE, MIB, ["0" * 64] * 6)
    assert error.value.status == 404 and error.value.code == "http_error"
    assert not (tmp_path / "blob").exists()


def test_a_connection_cut_midway_is_unreachable_and_leaves_no_file(stored, s3_url, tmp_path):
    data, _ = stored
    proxy = TcpProxy(urlparse(S3_ENDPOINT_URL).port, cut_once_after=MIB // 2)
    proxy.start()
    try:
        url = through(proxy, s3_url).presigned_url("blobs/parts.blob", expires_seconds=300)
        with pytest.raises(ApiError) as error:
            fetch_parts(url, tmp_path / "blob", SIZE, MIB, digests(data, MIB))
    finally:
        proxy.cut()
    assert (error.value.status, error.value.code) == (0, "unreachable")
    assert not (tmp_path / "blob").exists()


def test_a_cut_part_is_asked_again_of_a_renewed_url_and_the_checked_parts_stay(
    stored, s3_url, tmp_path
):
    data, url = stored
    proxy = TcpProxy(urlparse(S3_ENDPOINT_URL).port, cut_once_after=MIB // 2)
    proxy.start()
    renewed: list[str] = []

    def renew() -> str:
        renewed.append(url)
        return url  # straight to the store, past the proxy

    try:
        cut = through(proxy, s3_url).presigned_url("blobs/parts.blob", expires_seconds=300)
        received: list[int] = []
        fetch_parts(
            cut, tmp_path / "blob", SIZE, MIB, digests(data, MIB), received.append, 2, renew
        )
    finally:
        proxy.cut()
    assert (tmp_path / "blob").read_bytes() == data
    assert proxy.cuts == 1 and renewed == [url]  # once, for both connections


def test_an_expired_url_is_renewed_and_without_renew_refuses(stored, s3_store, tmp_path):
    data, url = stored
    expired = s3_store.presigned_url("blobs/parts.blob", expires_seconds=1)
    time.sleep(2.5)
    with pytest.raises(ApiError) as error:
        fetch_parts(expired, tmp_path / "blob", SIZE, MIB, digests(data, MIB))
    assert error.value.status == 403 and not (tmp_path / "blob").exists()
    renewed: list[str] = []
    fetch_parts(
        expired,
        tmp_path / "blob",
        SIZE,
        MIB,
        digests(data, MIB),
        None,
        4,
        lambda: renewed.append(url) or url,
    )
    assert (tmp_path / "blob").read_bytes() == data and renewed == [url]


def through(proxy: TcpProxy, s3_url: str) -> S3Store:
    """The test's store as seen through `proxy` (a URL presigned for the proxy's host)."""
    endpoint = f"http://127.0.0.1:{proxy.port}"
    return S3Store(S3Settings.from_url(s3_url, endpoint_url=endpoint, **S3_CREDENTIALS))


class WrongRanges:
    """A server of `data` that answers every range request in one wrong way (`mode`)."""

    def __init__(self, data: bytes, mode: str) -> None:
        self.data, self.mode = data, mode
        served = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                served.answer(self)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/blob?X-Amz-Signature=x"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def answer(self, request: BaseHTTPRequestHandler) -> None:
        first, last = map(int, request.headers["Range"].removeprefix("bytes=").split("-"))
        body, size = self.data[first : last + 1], len(self.data)
        status, announce = 206, True
        if self.mode == "ignores range":
            status, body = 200, self.data
        elif self.mode == "another size":
            size += 1
        elif self.mode == "announced longer":
            body += b"x"
        elif self.mode == "unannounced longer":
            body, announce = body + b"x", False
        elif self.mode == "unannounced shorter":
            body, announce = body[:-1], False
        request.send_response(status)
        if status == 206:
            request.send_header("Content-Range", f"bytes {first}-{last}/{size}")
        if announce:
            request.send_header("Content-Length", str(len(body)))
        request.end_headers()  # HTTP/1.0: an unannounced body ends when the connection closes
        request.wfile.write(body)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


@pytest.mark.parametrize(
    ("mode", "error", "says"),
    [
        ("ignores range", ApiError, r"HTTP 200 to a request for bytes=\d+-\d+, not 206"),
        ("another size", IntegrityMismatch, r"answered Content-Range 'bytes \d+-\d+/2501'"),
        ("announced longer", IntegrityMismatch, "announced 1001 bytes"),
        ("unannounced longer", IntegrityMismatch, "sent more bytes than the range"),
        ("unannounced shorter", IntegrityMismatch, "ended 1 bytes early"),
    ],
)
def test_a_wrong_answer_to_a_range_is_refused(tmp_path, mode, error, says):
    data = os.urandom(2500)
    server = WrongRanges(data, mode)
    try:
        with pytest.raises(error, match=says):
            fetch_parts(server.url, tmp_path / "blob", len(data), 1000, digests(data, 1000))
    finally:
        server.stop()
    assert not (tmp_path / "blob").exists()
