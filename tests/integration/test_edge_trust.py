"""The edge's trust chain against a man in the middle: a real `farm api` behind an HTTP proxy on
loopback that answers one cache key with another key's genuine, correctly signed record or
bytes, or pads a download past its signed size, as a proxy on plain HTTP or a compromised API
could. The edge imports exactly the blob of the key it computed, or nothing."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from farm.core import filecache
from tests import models
from tests.integration.test_edge import edge_farm, ok_json, run_farm  # noqa: F401

_BLOB = re.compile(r"^/v1/blobs/([0-9a-f]{64})(/download)?$")


class SwappingProxy:
    """Forwards every request to the API, except that it answers the keys in `records` with
    the record of another key (`relabel`: with the key asked for written into it), the keys in
    `bodies` with another key's bytes (`fit`: cut or padded to a size), and pads the
    downloads of the keys in `padding`; `redirect` answers downloads with a redirect to its
    own `/presigned/<key>` (the client's presigned-URL path), `announce` False sends bodies
    without a Content-Length (ended by closing the connection)."""

    def __init__(self, upstream_port: int, token: str) -> None:
        self.upstream_port, self.token = upstream_port, token
        self.records: dict[str, str] = {}
        self.bodies: dict[str, str] = {}
        self.padding: dict[str, int] = {}
        self.fit: dict[str, int] = {}
        self.relabel = False
        self.redirect = False
        self.announce = True
        self.downloads: list[str] = []
        self.failures: list[int] = []
        """Statuses the next downloads are answered with, as S3 under load (503 SlowDown)."""
        self.hold_at: int | None = None
        """The first download stops after this many bytes until `release` is set."""
        self.holding, self.release = threading.Event(), threading.Event()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                proxy.answer(self)

            def do_POST(self) -> None:
                proxy.answer(self)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def answer(self, request: BaseHTTPRequestHandler) -> None:
        path = request.path
        presigned = path.startswith("/presigned/")
        match = _BLOB.match(path)
        if presigned or (match and match[2]):
            key = path.removeprefix("/presigned/") if presigned else match[1]
            self.downloads.append(key)
            if self.failures:
                error = b"<Error><Code>SlowDown</Code><Message>Reduce your rate</Message></Error>"
                return self.send(request, self.failures.pop(0), error, {})
            if self.redirect and not presigned:
                return self.send(request, 307, b"", {"Location": f"{self.url}/presigned/{key}"})
            status, headers, body = self.forward(
                "GET", f"/v1/blobs/{self.bodies.get(key, key)}/download", None, {}
            )
            if key in self.fit:
                body = body[: self.fit[key]].ljust(self.fit[key], b"\0")
            body += b"\0" * self.padding.get(key, 0)
            if self.hold_at is not None and len(self.downloads) == 1:
                return self.send_held(request, body, self.hold_at)
            return self.send(request, status, body, headers, self.announce)
        if match and request.command == "GET" and match[1] in self.records:
            status, headers, body = self.forward(
                "GET", f"/v1/blobs/{self.records[match[1]]}", None, {}
            )
            if self.relabel:
                body = json.dumps({**json.loads(body), "cache_key": match[1]}).encode()
            return self.send(request, status, body, headers)
        length = int(request.headers.get("Content-Length") or 0)
        body = request.rfile.read(length) if length else None
        content_type = request.headers.get("Content-Type")
        headers = {"Content-Type": content_type} if content_type else {}
        status, headers, body = self.forward(request.command, path, body, headers)
        self.send(request, status, body, headers)

    def forward(self, method: str, path: str, body: bytes | None, headers: dict):
        connection = http.client.HTTPConnection("127.0.0.1", self.upstream_port, timeout=30)
        try:
            headers = {**headers, "Authorization": f"Bearer {self.token}"}
            connection.request(method, path, body=body, headers=headers)
            response = connection.getresponse()
            kept = {k: v for k, v in response.getheaders() if k.lower() == "content-type"}
            return response.status, kept, response.read()
        finally:
            connection.close()

    def send_held(self, request, body: bytes, hold_at: int) -> None:
        request.send_response(200)
        request.send_header("Content-Length", str(len(body)))
        request.send_header("Connection", "close")
        request.end_headers()
        request.close_connection = True
        request.wfile.write(body[:hold_at])
        request.wfile.flush()
        self.holding.set()
        self.release.wait(120)
        request.wfile.write(body[hold_at:])

    @staticmethod
    def send(request, status: int, body: bytes, headers: dict, announce: bool = True) -> None:
        request.send_response(status)
        for name, value in headers.items():
            request.send_header(name, value)
        if announce:
            request.send_header("Content-Length", str(len(body)))
        request.send_header("Connection", "close")
        request.end_headers()
        request.close_connection = True
        with contextlib.suppress(ConnectionError):  # an edge that stopped reading: refused
            request.wfile.write(body)


@pytest.fixture
def two_blobs(edge_farm):  # noqa: F811
    """Blob A (the fixture's) and B, another model of the same architecture: same size, other
    bytes, each genuinely compiled and signed by the farm; and the proxy in front of the API."""
    xml_b = models.save_ir(models.conv_net(seed=3), edge_farm.tmp / "b" / "b.xml")
    key_b = ok_json(edge_farm.farm_env, "submit", str(xml_b), "-d", "CPU")["cache_key"]
    proxy = SwappingProxy(edge_farm.api.port, edge_farm.tokens["pull"])
    yield edge_farm, key_b, proxy
    proxy.stop()


def stored(farm, key: str) -> bytes:
    return (farm.home / "store" / "blobs" / f"{key}.blob").read_bytes()


def cache_files(farm) -> list[str]:
    root = farm.blob_cache
    return sorted(p.name for p in [*root.glob("*"), *root.glob("partial/*")] if p.is_file())


def test_a_record_of_another_key_is_refused_and_nothing_is_cached(two_blobs):
    farm, key_b, proxy = two_blobs
    key_a = farm.key
    env = farm.edge_env(url=proxy.url)
    proxy.records[key_a] = key_b  # B's genuine, signed record, and B's bytes, for key A
    proxy.bodies[key_a] = key_b

    swapped = run_farm(env, "pull", str(farm.xml), "--device", "CPU", "--import")
    assert swapped.returncode == 5, swapped.stderr
    assert f"asked for blob {key_a}, the farm answered with the record of {key_b}" in (
        swapped.stderr
    )
    assert proxy.downloads == [] and cache_files(farm) == []
    assert farm.sql("SELECT count(*) FROM pulls") == [(0,)]

    # B's record with A's key written into it: its manifest signature no longer verifies.
    proxy.relabel = True
    relabelled = run_farm(env, "pull", key_a, "--import")
    assert relabelled.returncode == 8, relabelled.stderr  # untrusted (README: exit codes)
    assert f"blob {key_a} has an invalid signature" in relabelled.stderr
    assert proxy.downloads == [] and cache_files(farm) == []


def test_the_bytes_of_another_key_are_refused_and_nothing_is_cached(two_blobs):
    farm, key_b, proxy = two_blobs
    key_a = farm.key
    size_a = len(stored(farm, key_a))
    proxy.bodies[key_a] = key_b
    proxy.fit[key_a] = size_a + 1000  # (two compiles' sizes differ by a few bytes at most)
    env = farm.edge_env(url=proxy.url)

    swapped = run_farm(env, "pull", key_a, "--import")
    assert swapped.returncode == 5, swapped.stderr
    assert f"blob {key_a} is longer than its signed {size_a} bytes" in swapped.stderr
    assert proxy.downloads == [key_a] and cache_files(farm) == []

    proxy.fit[key_a] = size_a  # B's bytes cut to A's size: the signed sha256 refuses them
    cut = run_farm(env, "pull", key_a, "--import")
    assert cut.returncode == 5, cut.stderr
    assert f"downloaded blob {key_a} has sha256" in cut.stderr
    assert "deleted, not imported" in cut.stderr
    assert proxy.downloads == [key_a, key_a] and cache_files(farm) == []
    assert farm.sql("SELECT count(*) FROM pulls") == [(0,)]


def test_a_cached_blob_that_changed_or_is_misplaced_is_never_imported(two_blobs):
    farm, key_b, proxy = two_blobs
    key_a = farm.key
    env = farm.edge_env(url=proxy.url)
    first = ok_json(env, "pull", key_a, "--import")
    assert first["downloaded"] is True
    ok_json(env, "pull", key_b)
    assert ok_json(env, "pull", key_a, "--import")["downloaded"] is False  # bound: as is
    cached_a = farm.blob_cache / f"{key_a}.blob"

    # Changed on disk (one byte, same size): hashed again, refused, downloaded afresh.
    cached_a.chmod(0o644)
    data = bytearray(cached_a.read_bytes())
    data[-100] ^= 0xFF
    cached_a.write_bytes(bytes(data))
    again = ok_json(env, "pull", key_a, "--import")
    assert again["downloaded"] is True and again["import_seconds"] > 0
    assert cached_a.read_bytes() == stored(farm, key_a)

    # Another key's blob, with its own signed manifest, placed under A's names.
    for suffix in (".blob", ".manifest"):
        target = farm.blob_cache / f"{key_a}{suffix}"
        target.unlink()
        shutil.copy2(farm.blob_cache / f"{key_b}{suffix}", target)
    misplaced = ok_json(env, "pull", key_a, "--import")
    assert misplaced["downloaded"] is True
    assert cached_a.read_bytes() == stored(farm, key_a)

    # A blob cached before manifests were kept (no manifest beside it) is hashed before use:
    # the bytes of B left under A's name by the old agent are replaced.
    (farm.blob_cache / f"{key_a}.manifest").unlink()
    cached_a.unlink()
    shutil.copyfile(farm.blob_cache / f"{key_b}.blob", cached_a)
    old = ok_json(env, "pull", key_a, "--import")
    assert old["downloaded"] is True and cached_a.read_bytes() == stored(farm, key_a)
    assert proxy.downloads == [key_a, key_b, key_a, key_a, key_a]
    assert cache_files(farm) == sorted(
        f"{key}{suffix}" for key in (key_a, key_b) for suffix in (".blob", ".manifest")
    )
    pulls = farm.sql("SELECT ok FROM pulls WHERE cache_key = ?", key_a)
    assert pulls == [(1,)] * 5


@pytest.mark.parametrize(
    ("redirect", "announce"),
    [(False, True), (False, False), (True, True), (True, False)],
    ids=["api-announced", "api-unannounced", "presigned-announced", "presigned-unannounced"],
)
def test_a_download_longer_than_its_signed_size_stops_there(two_blobs, redirect, announce):
    farm, _, proxy = two_blobs
    key = farm.key
    size = len(stored(farm, key))
    proxy.padding[key] = 32 * 2**20
    proxy.redirect, proxy.announce = redirect, announce

    def no_file_past_the_signed_size() -> None:
        # One byte past the signed size anywhere is EFBIG: "no room", not the refusal below.
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))

    env = farm.edge_env(url=proxy.url)
    padded = run_farm(env, "pull", key, "--import", preexec_fn=no_file_past_the_signed_size)
    assert padded.returncode == 5, padded.stderr
    assert f"the download of blob {key} is longer than its signed {size} bytes" in padded.stderr
    assert cache_files(farm) == [] and proxy.downloads == [key] * (2 if redirect else 1)
    assert farm.sql("SELECT count(*) FROM pulls") == [(0,)]


def test_the_genuine_path_through_the_proxy_imports_and_caches(two_blobs):
    farm, _, proxy = two_blobs
    env = farm.edge_env(url=proxy.url)
    pulled = ok_json(env, "pull", str(farm.xml), "--device", "CPU", "--import")
    assert pulled["cache_key"] == farm.key and pulled["downloaded"] is True
    assert Path(pulled["path"]).read_bytes() == stored(farm, farm.key)
    assert ok_json(env, "pull", farm.key, "--import")["downloaded"] is False
    assert proxy.downloads == [farm.key]


def test_two_pulls_of_one_blob_at_once_download_it_once_and_both_get_its_bytes(two_blobs):
    """Two `farm pull` processes sharing one edge cache, the second started while the first is
    three quarters through the one-stream download: it waits for the first, then takes the
    blob from the cache. (Both writing the one partial file, the first accepted a file whose
    start the second had emptied: its hash was of the bytes it received, not of the file.)"""
    farm, _, proxy = two_blobs
    key = farm.key
    size = len(stored(farm, key))
    proxy.hold_at = size * 3 // 4
    env = {**os.environ, **farm.edge_env(url=proxy.url)}
    command = [sys.executable, "-m", "farm", "pull", key, "--json"]
    first = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proxy.holding.wait(120), "the first pull never started its download"
        second = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 120  # until it waits for the first, or downloads too
        while len(proxy.downloads) < 2 and not waits_for_a_lock(second.pid):
            assert time.monotonic() < deadline, "the second pull neither waited nor downloaded"
            assert second.poll() is None, second.stderr.read() if second.stderr else ""
            time.sleep(0.05)
    finally:
        proxy.release.set()
    outputs = [process.communicate(timeout=300) for process in (first, second)]
    for process, (_, err) in zip((first, second), outputs, strict=True):
        assert process.returncode == 0, err.decode()
    answers = [json.loads(out) for out, _ in outputs]
    assert [answer["downloaded"] for answer in answers] == [True, False]
    assert proxy.downloads == [key]
    assert (farm.blob_cache / f"{key}.blob").read_bytes() == stored(farm, key)
    assert cache_files(farm) == [f"{key}.blob", f"{key}.manifest"]


def waits_for_a_lock(pid: int) -> bool:
    """Whether process `pid` is blocked waiting for a file lock (`/proc/locks`: "->")."""
    waiting = (line.split() for line in Path("/proc/locks").read_text().splitlines())
    return any(
        fields[1] == "->" and fields[5] == str(pid) for fields in waiting
    )  # N: -> FLOCK ADVISORY WRITE PID


def test_a_download_answered_with_a_passing_fault_is_tried_again(two_blobs):
    """S3 answers 503 SlowDown and 500 InternalError under load, and asks to be tried again."""
    farm, _, proxy = two_blobs
    proxy.failures = [503, 500]
    pulled = ok_json(farm.edge_env(url=proxy.url), "pull", farm.key, "--import")
    assert pulled["downloaded"] is True
    assert Path(pulled["path"]).read_bytes() == stored(farm, farm.key)
    assert proxy.downloads == [farm.key] * 3

    proxy.failures = [404]  # a refusal is not tried again
    (farm.blob_cache / f"{farm.key}.blob").unlink()
    refused = run_farm(farm.edge_env(url=proxy.url), "pull", farm.key)
    assert refused.returncode != 0
    assert proxy.downloads == [farm.key] * 4


def test_a_download_broken_off_before_the_machine_restarted_starts_over(two_blobs):
    """It was not flushed: a crash may have left zeros in the prefix a resume would keep (its
    sha256 then refused the whole blob, after the whole download). A later one resumes."""
    farm, _, _ = two_blobs
    key = farm.key
    genuine = stored(farm, key)
    partial = farm.blob_cache / "partial" / key
    partial.parent.mkdir(parents=True, exist_ok=True)
    partial.parent.chmod(0o700)
    partial.write_bytes(b"\0" * (len(genuine) // 2))  # what a crash may leave of the prefix
    before_boot = filecache.booted_at() - 60
    os.utime(partial, (before_boot, before_boot))
    pulled = ok_json(farm.edge_env(), "pull", key, "--import")
    assert pulled["downloaded"] is True
    assert Path(pulled["path"]).read_bytes() == genuine

    (farm.blob_cache / f"{key}.blob").unlink()
    partial.write_bytes(genuine[: len(genuine) // 2])  # broken off in this boot: resumed
    resumed = ok_json(farm.edge_env(), "pull", key)
    assert resumed["downloaded"] is True
    assert Path(resumed["path"]).read_bytes() == genuine
