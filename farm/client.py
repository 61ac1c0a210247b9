"""HTTP client of the farm API, for the CLI and the edge agent (httpx and the standard
library only: edge-safe)."""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import os
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import httpx

from farm.core.errors import ApiError, IntegrityMismatch
from farm.core.hashing import sha256_file
from farm.core.identity import ModelRef
from farm.core.spec import CompileSpec, Toolchain
from farm.core.stages import recipe_json

UPLOAD_CHUNK = 1 << 20
UPLOAD_ATTEMPTS = 30
"""Tries of one upload that the API turns away as busy (503 `too_many_uploads`)."""
UPLOAD_RETRY_MAX_SECONDS = 60.0
"""The longest wait between two tries, whatever the API's Retry-After says."""
PAGE = 1000
"""Rows asked for per request when listing (the API's largest page)."""
DOWNLOAD_CHUNK = 1 << 20
"""Bytes read from the socket, written and hashed per step of a download (one reused buffer)."""
DOWNLOAD_TIMEOUT_SECONDS = 60.0
"""A download that receives nothing for this long is broken off (and resumed by the agent)."""
Progress = Callable[[int], None]


class FarmClient:
    def __init__(self, base_url: str, token: str | None, timeout: float = 60.0) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(
            base_url=base_url.rstrip("/"),
            headers=headers,
            timeout=httpx.Timeout(timeout, connect=10.0),
        )

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> FarmClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        return self._request(method, path, **kwargs).json()

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """The API's answer; ApiError when it refused, or could not be reached."""
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.TransportError as error:
            raise ApiError(
                0,
                "unreachable",
                f"cannot reach the farm API at {self.http.base_url} (FARM_API_URL): {error}",
            ) from error
        _raise_for_error(response)
        return response

    def readiness(self) -> tuple[int, dict]:
        """`/readyz`: its HTTP status (200 ready, 503 not) and its body (`{"ready", "checks"}`);
        ApiError only when the API cannot be reached or answers something else."""
        try:
            response = self.http.get("/readyz")
        except httpx.TransportError as error:
            raise ApiError(
                0,
                "unreachable",
                f"cannot reach the farm API at {self.http.base_url} (FARM_API_URL): {error}",
            ) from error
        if response.status_code not in (200, 503):
            _raise_for_error(response)
        try:
            return response.status_code, response.json()
        except ValueError:
            raise ApiError(
                response.status_code,
                "http_error",
                f"{self.http.base_url}/readyz answered something that is not the farm API's JSON",
            ) from None

    def cache_keys(self, prefix: str) -> list[str]:
        """The cache keys (of blobs and jobs) that start with `prefix`, a few at most."""
        return self._call("GET", "/v1/cache-keys", params={"prefix": prefix})["cache_keys"]

    # --- models and submissions ---------------------------------------------------------------

    def missing(self, digests: list[str]) -> list[str]:
        return self._call("POST", "/v1/models/missing", json={"sha256": digests})["missing"]

    def upload(self, sha256: str, path: Path, progress: Progress | None = None) -> dict:
        """Stream one file up (never held whole in memory); the server checks its sha256.

        An API streaming as many uploads as it may (503 `too_many_uploads`) is tried again
        after its Retry-After, up to UPLOAD_ATTEMPTS times; the bytes a turned-away try had
        reported to `progress` are taken back (a negative count)."""
        size = Path(path).stat().st_size
        for attempt in range(1, UPLOAD_ATTEMPTS + 1):
            sent = 0

            def chunks() -> Iterator[bytes]:
                nonlocal sent
                with open(path, "rb") as source:
                    while chunk := source.read(UPLOAD_CHUNK):
                        sent += len(chunk)
                        if progress:
                            progress(len(chunk))
                        yield chunk

            try:
                response = self.http.put(
                    f"/v1/models/{sha256}",
                    content=chunks(),
                    headers={
                        "Content-Type": "application/octet-stream",
                        "Content-Length": str(size),
                    },
                    timeout=httpx.Timeout(None, connect=10.0),
                )
            except httpx.TransportError as error:
                raise ApiError(
                    0,
                    "unreachable",
                    f"cannot reach the farm API at {self.http.base_url} (FARM_API_URL): {error}",
                ) from error
            busy = response.status_code == 503 and _error_code(response) == "too_many_uploads"
            if not busy or attempt == UPLOAD_ATTEMPTS:
                _raise_for_error(response)
                return response.json()
            if progress and sent:
                progress(-sent)
            time.sleep(_retry_after(response))
        raise AssertionError("unreachable")  # the last attempt returned or raised

    def submit(
        self,
        model: dict[str, str],
        name: str,
        specs: list[dict],
        toolchain: dict[str, Any],
        rebuild: bool = False,
        reference_inputs: str | None = None,
        recipe: list[dict] | None = None,
    ) -> dict:
        body = {"model": model, "model_name": name, "specs": specs, "toolchain": toolchain}
        if reference_inputs:
            body["reference_inputs"] = reference_inputs
        if recipe:
            body["recipe"] = recipe
        return self._call("POST", "/v1/submissions", json={**body, "rebuild": rebuild})

    def submit_model(
        self,
        ref: ModelRef,
        specs: Sequence[CompileSpec],
        toolchain: Toolchain,
        uploading: Callable[[int], AbstractContextManager[Progress]] | None = None,
        rebuild: bool = False,
        reference_inputs: Path | None = None,
    ) -> dict:
        """Submit `ref` for every spec; when a new job needs model files the farm lacks
        (409 `model_missing`), upload only those, then submit again. A hit uploads nothing.
        `uploading(total_bytes)` wraps the uploads and yields the progress callback.
        `rebuild`: replace the specs' quarantined blobs with new compiles. `reference_inputs`:
        an .npz of inputs new jobs compute their reference outputs from (uploaded likewise)."""
        body = [{"target": spec.target.name, **spec.canonical()} for spec in specs]
        sources = {sha: ref.files[role] for role, sha in ref.identity.items()}
        inputs_sha = None
        if reference_inputs is not None:
            inputs_sha = sha256_file(reference_inputs)
            sources[inputs_sha] = reference_inputs
        wire_toolchain = {
            "openvino": toolchain.openvino,
            "runtime_requirements": toolchain.runtime_requirements,
        }
        recipe = recipe_json(ref.recipe) or None
        try:
            return self.submit(
                dict(ref.identity), ref.name, body, wire_toolchain, rebuild, inputs_sha, recipe
            )
        except ApiError as error:
            if error.code != "model_missing":
                raise
        missing = set(self.missing(sorted(sources)))
        files = [(sha, path) for sha, path in sources.items() if sha in missing]
        total = sum(path.stat().st_size for _, path in files)
        with (uploading or _no_progress)(total) as advance:
            for sha, path in files:
                self.upload(sha, path, advance)
        return self.submit(
            dict(ref.identity), ref.name, body, wire_toolchain, rebuild, inputs_sha, recipe
        )

    # --- jobs ---------------------------------------------------------------------------------

    def job(self, job_id: int) -> dict:
        return self._call("GET", f"/v1/jobs/{job_id}")

    def jobs(self, limit: int = 50, **filters: Any) -> list[dict]:
        """Newest first, up to `limit`, a page (of at most `PAGE`) at a time."""
        params = {k: v for k, v in filters.items() if v is not None}
        return self._pages("/v1/jobs", params, limit)

    def log(self, job_id: int) -> str:
        return self.job_log(job_id)["log"]

    def job_log(self, job_id: int) -> dict:
        """`{"id", "state", "log"}` of a job."""
        return self._call("GET", f"/v1/jobs/{job_id}/log")

    def cancel(self, job_id: int) -> dict:
        return self._call("POST", f"/v1/jobs/{job_id}/cancel")

    def workers(self) -> list[dict]:
        """Every registered worker by name, a page (of at most `PAGE`) at a time."""
        return self._pages("/v1/workers", {}, None)

    # --- blobs --------------------------------------------------------------------------------

    def resolve(self, cache_key: str) -> dict | None:
        try:
            return self._call("GET", f"/v1/blobs/{cache_key}")
        except ApiError as error:
            if error.code == "not_found":
                return None
            raise

    def blobs(self, target: str | None = None, limit: int | None = None) -> list[dict]:
        """Newest first, up to `limit` (None: all), a page (of at most `PAGE`) at a time."""
        return self._pages("/v1/blobs", {"target": target} if target else {}, limit)

    def _pages(self, path: str, params: dict[str, Any], limit: int | None) -> list[dict]:
        """Follow `X-Next-Cursor` until `limit` rows or the last page."""
        rows: list[dict] = []
        cursor = None
        while limit is None or len(rows) < limit:
            size = PAGE if limit is None else min(PAGE, limit - len(rows))
            query = {**params, "limit": size, **({"cursor": cursor} if cursor else {})}
            response = self._request("GET", path, params=query)
            rows += response.json()
            cursor = response.headers.get("X-Next-Cursor")
            if not cursor:
                break
        return rows

    def download(
        self,
        cache_key: str,
        dest: Path,
        progress: Progress | None = None,
        max_bytes: int | None = None,
    ) -> str:
        """Stream the blob to `dest`, appending from its current size (a resumed download);
        returns the sha256 of all of `dest`, computed while writing (a resumed download first
        hashes the part it already has).

        The API answers with a redirect to a presigned URL (S3: fetched without our token) or
        with the bytes themselves (local store); both honour HTTP Range. `dest` never grows
        past `max_bytes` (the blob's signed size): a body announced or found longer is an
        `IntegrityMismatch`, and `dest` is removed.
        """
        return self._download(
            f"/v1/blobs/{cache_key}/download", cache_key, dest, progress, max_bytes
        )

    def download_reference(self, cache_key: str, dest: Path, max_bytes: int) -> str:
        """The blob's reference outputs file to `dest` (no longer than its signed size); its
        sha256."""
        dest.unlink(missing_ok=True)
        path = f"/v1/blobs/{cache_key}/reference"
        return self._download(path, cache_key, dest, None, max_bytes)

    def _download(
        self,
        path: str,
        cache_key: str,
        dest: Path,
        progress: Progress | None,
        max_bytes: int | None,
    ) -> str:
        start = dest.stat().st_size if dest.exists() else 0
        ranged = {"Range": f"bytes={start}-"} if start else {}
        try:
            with self.http.stream("GET", path, headers=ranged, follow_redirects=False) as response:
                if not response.is_redirect:
                    return _save(response, dest, start, progress, max_bytes)
                location = response.headers["location"]
            if _proxied(location):
                with httpx.stream(
                    "GET", location, headers=ranged, timeout=httpx.Timeout(60, connect=10)
                ) as response:
                    return _save(response, dest, start, progress, max_bytes)
            return _fetch(location, dest, start, progress, max_bytes)
        except httpx.TransportError as error:
            raise ApiError(
                0, "unreachable", f"download of {cache_key} broke off: {error}"
            ) from error

    def report_pull(
        self,
        cache_key: str,
        agent_id: str,
        ok: bool,
        import_seconds: float | None = None,
        error: str | None = None,
    ) -> dict:
        return self._call(
            "POST",
            f"/v1/blobs/{cache_key}/pulls",
            json={"agent_id": agent_id, "ok": ok, "import_seconds": import_seconds, "error": error},
        )

    def report_verification(self, cache_key: str, report: dict[str, Any]) -> dict:
        """`{"id", "passed", "quarantined"}`: a failed report quarantines the blob."""
        return self._call("POST", f"/v1/blobs/{cache_key}/verifications", json=report)

    def verifications(self, cache_key: str, limit: int = 100) -> list[dict]:
        return self._call("GET", f"/v1/blobs/{cache_key}/verifications", params={"limit": limit})

    def quarantine(self, cache_key: str, reason: str) -> dict:
        return self._call("POST", f"/v1/blobs/{cache_key}/quarantine", json={"reason": reason})

    def release(self, cache_key: str) -> dict:
        return self._call("POST", f"/v1/blobs/{cache_key}/release")

    def delete_blob(self, cache_key: str) -> None:
        self._request("DELETE", f"/v1/blobs/{cache_key}")


@contextlib.contextmanager
def _no_progress(_total: int) -> Iterator[Progress]:
    yield lambda _count: None


def _error_code(response: httpx.Response) -> str | None:
    """The `code` of an error answer of the farm API, if it has one."""
    try:
        return response.json().get("code")
    except (ValueError, AttributeError):
        return None


def _retry_after(response: httpx.Response) -> float:
    """Seconds to wait before trying again: the answer's Retry-After, within bounds."""
    try:
        seconds = float(response.headers.get("Retry-After", "1"))
    except ValueError:
        seconds = 1.0
    return min(max(seconds, 0.0), UPLOAD_RETRY_MAX_SECONDS)


def _raise_for_error(response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    response.read()
    try:
        body = response.json()
        raise ApiError(
            response.status_code,
            body.get("code", "http_error"),
            body.get("message", response.text),
            body.get("details"),
        )
    except ValueError:
        raise ApiError(
            response.status_code,
            "http_error",
            f"HTTP {response.status_code}: {response.text[:200]}",
        ) from None


def _save(
    response: httpx.Response,
    dest: Path,
    start: int,
    progress: Progress | None,
    limit: int | None = None,
) -> str:
    if response.status_code == 416 and start:
        return _digest_of(dest).hexdigest()  # nothing left to fetch
    _raise_for_error(response)
    resumed = start and response.status_code == 206
    capped = _Capped(dest, start if resumed else 0, limit)
    announced = response.headers.get("content-length", "")
    if announced.isdigit() and response.headers.get("content-encoding", "identity") == "identity":
        capped.announced(int(announced))  # (an encoded body's length is not the blob's)
    digest = _digest_of(dest) if resumed else hashlib.sha256()
    with open(dest, "ab" if resumed else "wb") as sink:
        for chunk in response.iter_bytes(DOWNLOAD_CHUNK):
            if not capped.fits(len(chunk)):
                break
            sink.write(chunk)
            digest.update(chunk)
            if progress:
                progress(len(chunk))
    capped.done()
    return digest.hexdigest()


class _Capped:
    """The size limit of one download file: the blob's signed size. A body longer than the
    limit stops before the byte that would pass it (nothing past the limit is ever written:
    a malicious URL once made an edge write 304 MB for a 12 kB blob before the digest check),
    and the partial file is removed."""

    def __init__(self, dest: Path, size: int, limit: int | None) -> None:
        self.dest, self.size, self.limit, self.over = dest, size, limit, False

    def announced(self, length: int | None) -> None:
        """Refuse before writing anything when the Content-Length is already too long."""
        if length is not None and self.limit is not None and self.size + length > self.limit:
            self.over = True
            self.done()

    def fits(self, count: int) -> bool:
        if self.limit is not None and self.size + count > self.limit:
            self.over = True
            return False
        self.size += count
        return True

    def done(self) -> None:
        if self.over:
            self.dest.unlink(missing_ok=True)
            raise IntegrityMismatch(
                f"the download of blob {self.dest.name} is longer than its signed "
                f"{self.limit} bytes; stopped there and deleted, not imported"
            )


def _fetch(
    url: str, dest: Path, start: int, progress: Progress | None, limit: int | None = None
) -> str:
    """GET a presigned URL into `dest` (from byte `start`) with the standard library.

    httpx reads a response body in 64 kB pieces, each copied through h11's buffers: at about
    250 MB/s on one core it was the bottleneck of a blob download (bench/edge.py). Here the
    socket fills one reused 1 MB buffer, which is written and hashed in place.
    """
    parts = urllib.parse.urlsplit(url)
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    if not parts.hostname:
        raise ApiError(0, "unreachable", f"the download URL has no host: {url[:200]}")
    connection = kind(parts.hostname, parts.port, timeout=DOWNLOAD_TIMEOUT_SECONDS)
    target = urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, ""))
    try:
        try:
            connection.request("GET", target, headers={"Range": f"bytes={start}-"} if start else {})
            response = connection.getresponse()
        except (OSError, http.client.HTTPException) as error:
            raise ApiError(
                0, "unreachable", f"download from {parts.netloc} failed: {error}"
            ) from error
        if response.status == 416 and start:
            return _digest_of(dest).hexdigest()  # nothing left to fetch
        if response.status >= 400:
            text = response.read(2000).decode("utf-8", errors="replace")
            raise ApiError(response.status, "http_error", f"HTTP {response.status}: {text[:200]}")
        resumed = start and response.status == 206
        capped = _Capped(dest, start if resumed else 0, limit)
        capped.announced(response.length)
        digest = _digest_of(dest) if resumed else hashlib.sha256()
        buffer = bytearray(DOWNLOAD_CHUNK)
        view = memoryview(buffer)
        with open(dest, "ab" if resumed else "wb") as sink:
            while True:
                try:
                    count = response.readinto(buffer)
                except (OSError, http.client.HTTPException) as error:
                    raise ApiError(
                        0, "unreachable", f"download from {parts.netloc} broke off: {error}"
                    ) from error
                if not count:
                    break  # the end, or the connection closed early (checked below)
                if not capped.fits(count):
                    break
                sink.write(view[:count])
                digest.update(view[:count])
                if progress:
                    progress(count)
        capped.done()
        if response.length:  # bytes announced by Content-Length but never received
            raise ApiError(
                0,
                "unreachable",
                f"download from {parts.netloc} broke off {response.length} bytes early",
            )
        return digest.hexdigest()
    finally:
        connection.close()


def _proxied(url: str) -> bool:
    """True when the environment sends `url` through a proxy (which httpx knows to use)."""
    parts = urllib.parse.urlsplit(url)
    proxies = urllib.request.getproxies()
    wanted = parts.scheme in proxies or "all" in proxies
    return wanted and not urllib.request.proxy_bypass(parts.hostname or "")


def _digest_of(path: Path):
    """A running sha256 of what `path` already holds (the part of a resumed download)."""
    digest = hashlib.sha256()
    with open(path, "rb") as source:
        while chunk := source.read(DOWNLOAD_CHUNK):
            digest.update(chunk)
    return digest


def from_environment() -> FarmClient:
    return FarmClient(os.environ["FARM_API_URL"], os.environ.get("FARM_TOKEN"))
