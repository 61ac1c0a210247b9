"""HTTP client of the farm API, for the CLI and the edge agent (httpx and the standard
library only: edge-safe)."""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import os
import queue
import ssl
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from farm.core.emptied import open_emptied, pwrite_all
from farm.core.errors import ApiError, IntegrityMismatch, Kind

if TYPE_CHECKING:  # a submission's and a channel's parts load where they are used, not to list
    from farm.core.identity import ModelRef
    from farm.core.signing import Parts
    from farm.core.spec import CompileSpec, Toolchain

UPLOAD_CHUNK = 1 << 20
UPLOAD_ATTEMPTS = 30
"""Tries of one upload that the API turns away as busy (`UPLOADS_BUSY`)."""
UPLOADS_BUSY = {(503, "too_many_uploads"), (429, "too_many_uploads_for_token")}
"""An API streaming all the uploads it may, or all this token may: wait for Retry-After."""
UPLOAD_RETRY_MAX_SECONDS = 60.0
"""The longest wait between two tries, whatever the API's Retry-After says."""
PAGE = 1000
"""Rows asked for per request when listing (the API's largest page)."""
DOWNLOAD_CHUNK = 1 << 20
"""Bytes read from the socket, written and hashed per step of a download."""
DOWNLOAD_BUFFERS = 3
"""Reused buffers of one download: one filling from the socket while the others are written
and hashed (a download holds DOWNLOAD_BUFFERS x DOWNLOAD_CHUNK, whatever the blob's size)."""
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
            verify=_tls_for(base_url),
        )

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> FarmClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        return _body(self._request(method, path, **kwargs))

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
        body = _body(response)
        if not isinstance(body, dict) or not isinstance(body.get("checks"), dict):
            raise _not_farm(response)
        return response.status_code, body

    def cache_keys(self, prefix: str) -> list[str]:
        """The cache keys (of blobs and jobs) that start with `prefix`, a few at most."""
        return self._call("GET", "/v1/cache-keys", params={"prefix": prefix})["cache_keys"]

    # --- models and submissions ---------------------------------------------------------------

    def missing(self, digests: list[str]) -> list[str]:
        return self._call("POST", "/v1/models/missing", json={"sha256": digests})["missing"]

    def upload(self, sha256: str, path: Path, progress: Progress | None = None) -> dict:
        """Stream one file up (never held whole in memory); the server checks its sha256.

        An API streaming as many uploads as it may (503 `too_many_uploads`), or as this token
        may (429 `too_many_uploads_for_token`), is tried again
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
            busy = (response.status_code, _error_code(response)) in UPLOADS_BUSY
            if not busy or attempt == UPLOAD_ATTEMPTS:
                _raise_for_error(response)
                return _body(response)
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
        max_drift: str | None = None,
    ) -> dict:
        body = {"model": model, "model_name": name, "specs": specs, "toolchain": toolchain}
        if reference_inputs:
            body["reference_inputs"] = reference_inputs
        if recipe:
            body["recipe"] = recipe
        if max_drift:
            body["max_drift"] = max_drift
        return self._call("POST", "/v1/submissions", json={**body, "rebuild": rebuild})

    def submit_model(
        self,
        ref: ModelRef,
        specs: Sequence[CompileSpec],
        toolchain: Toolchain,
        uploading: Callable[[int], AbstractContextManager[Progress]] | None = None,
        rebuild: bool = False,
        reference_inputs: Path | None = None,
        extra_files: Mapping[str, Path] | None = None,
        max_drift: str | None = None,
    ) -> dict:
        """Submit `ref` for every spec; when a new job needs model files the farm lacks
        (409 `model_missing`), upload only those, then submit again. A hit uploads nothing.
        `uploading(total_bytes)` wraps the uploads and yields the progress callback.
        `rebuild`: replace the specs' quarantined blobs with new compiles. `reference_inputs`:
        an .npz of inputs new jobs compute their reference outputs from (uploaded likewise)."""
        from farm.core.hashing import sha256_file
        from farm.core.stages import recipe_json

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
        if extra_files:  # a stage's own inputs (calibration samples): uploaded up front
            wanted = set(self.missing(sorted(extra_files)))
            for sha, path in extra_files.items():
                if sha in wanted:
                    self.upload(sha, path)
        try:
            return self.submit(
                dict(ref.identity),
                ref.name,
                body,
                wire_toolchain,
                rebuild,
                inputs_sha,
                recipe,
                max_drift,
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
            dict(ref.identity), ref.name, body, wire_toolchain, rebuild, inputs_sha, recipe,
            max_drift,
        )  # fmt: skip

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
            rows += _body(response)
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

    def download_parts(
        self, cache_key: str, dest: Path, size: int, parts: Parts, progress: Progress | None = None
    ) -> bool:
        """Download the blob into `dest` (created, or emptied first) as its `parts`, on
        several connections, each part checked against its digest as it arrives
        (`fetch_parts`); whether it did. False, with nothing written: this farm answers with
        the bytes themselves (a local store) or the URL goes through a proxy, and `download`
        fetches the blob as one stream."""
        location = self._presigned_url(cache_key)
        if location is None or _proxied(location):
            return False

        def renew() -> str:
            fresh = self._presigned_url(cache_key)
            if fresh is None:
                raise ApiError(0, "unreachable", f"the farm no longer redirects {cache_key}")
            return fresh

        fetch_parts(location, dest, size, parts.part_bytes, parts.sha256s, progress, renew=renew)
        return True

    def _presigned_url(self, cache_key: str) -> str | None:
        """The presigned URL the farm redirects the blob's download to; None: it answers with
        the bytes themselves (a local store)."""
        path = f"/v1/blobs/{cache_key}/download"
        try:
            with self.http.stream("GET", path, follow_redirects=False) as response:
                if not response.is_redirect:
                    return None
                return response.headers["location"]
        except httpx.TransportError as error:
            raise ApiError(0, "unreachable", f"download of {cache_key} failed: {error}") from error

    def download_reference(self, cache_key: str, dest: Path, max_bytes: int) -> str:
        """The blob's reference outputs file to `dest` (no longer than its signed size); its
        sha256."""
        dest.unlink(missing_ok=True)
        path = f"/v1/blobs/{cache_key}/reference"
        return self._download(path, cache_key, dest, None, max_bytes)

    def stage(self, stage_key: str) -> dict | None:
        """A stage's record (docs §15), or None when the farm has none."""
        try:
            return self._call("GET", f"/v1/stages/{stage_key}")
        except ApiError as error:
            if error.code == "not_found":
                return None
            raise

    def download_stage_file(self, stage_key: str, role: str, dest: Path) -> str:
        """One output file of a done stage to `dest`; its sha256."""
        dest.unlink(missing_ok=True)
        path = f"/v1/stages/{stage_key}/files/{role}"
        return self._download(path, stage_key, dest, None, None)

    # --- pipeline bundles (§17) --------------------------------------------------------------

    def submit_bundle(
        self,
        files: Mapping[str, tuple[str, Path]],
        body: Mapping[str, Any],
        progress: Progress | None = None,
    ) -> dict:
        """Upload the folder's files the farm lacks (`files`: relative path -> (sha256, local
        file)), then submit the bundle (`body`: pipeline, target, options, toolchain)."""
        local = {sha: path for sha, path in files.values()}
        digests = sorted(local)
        missing: list[str] = []
        for start in range(0, len(digests), 16):  # the API answers 16 digests at a time
            missing += self.missing(digests[start : start + 16])
        for sha in missing:
            self.upload(sha, local[sha], progress)
        payload = {**body, "files": {path: sha for path, (sha, _) in files.items()}}
        return self._call("POST", "/v1/bundles", json=payload)

    def bundle_manifest(self, bundle_key: str) -> dict:
        """The signed manifest of a published bundle (ApiError `not_found` otherwise)."""
        return self._call("GET", f"/v1/bundles/{bundle_key}")

    def bundle_build(self, bundle_key: str) -> dict | None:
        """A bundle's build (state and parts), or None when the farm was never asked for it."""
        try:
            return self._call("GET", f"/v1/bundles/{bundle_key}/build")
        except ApiError as error:
            if error.code == "not_found":
                return None
            raise

    def open_bundle_file(self, sha256: str, offset: int) -> _BodyReader:
        """A bundle file's bytes from `offset` on (a presigned redirect followed)."""
        ranged = {"Range": f"bytes={offset}-"} if offset else {}
        path = f"/v1/bundle-files/{sha256}"
        owner = None  # the client of a redirect's own: closed with the reader
        try:
            request = self.http.build_request("GET", path, headers=ranged)
            response = self.http.send(request, stream=True, follow_redirects=False)
            if response.is_redirect:
                location = response.headers["location"]
                response.close()
                request = httpx.Request("GET", location, headers=ranged)
                owner = httpx.Client(timeout=DOWNLOAD_TIMEOUT_SECONDS)
                response = owner.send(request, stream=True)
        except httpx.TransportError as error:
            if owner is not None:
                owner.close()
            raise ApiError(0, "unreachable", f"download of {sha256} failed: {error}") from error
        return _BodyReader.checked(response, offset, owner)

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

    # --- channels -----------------------------------------------------------------------------

    def create_channel(self, name: str) -> dict:
        return self._call("POST", "/v1/channels", json={"name": name})

    def channel(self, name: str, revision: int | None = None) -> dict:
        params = {} if revision is None else {"revision": revision}
        return self._call("GET", f"/v1/channels/{_channel(name)}", params=params)

    def set_channel(self, name: str, entries: list[dict[str, Any]]) -> dict:
        """A new revision; `entries` as `Entry.as_dict` gives them."""
        body = [
            {"name": e["name"], "model": e["model"], "spec": {"target": e["target"], **e["spec"]}}
            for e in entries
        ]
        return self._call(
            "POST", f"/v1/channels/{_channel(name)}/revisions", json={"entries": body}
        )

    def promote_channel(self, name: str, revision: int, percent: int, force: bool) -> dict:
        body = {"revision": revision, "percent": percent, "force": force}
        return self._call("POST", f"/v1/channels/{_channel(name)}/promote", json=body)

    def rollback_channel(self, name: str) -> dict:
        return self._call("POST", f"/v1/channels/{_channel(name)}/rollback")

    def channel_document(self, name: str) -> dict:
        """`{document, signature, signing_key_id, certificate}`: the edge verifies it
        (farm/edge/channel.py)."""
        return self._call("GET", f"/v1/channels/{_channel(name)}/document")

    def report_channel_edge(self, name: str, report: dict[str, Any]) -> None:
        self._request("POST", f"/v1/channels/{_channel(name)}/edges", json=report)

    def channel_status(self, name: str, toolchain: dict[str, Any] | None = None) -> dict:
        params = {}
        if toolchain is not None:
            params = {
                k: v
                for k, v in toolchain.items()
                if k in ("openvino", "runtime_requirements") and v
            }
        return self._call("GET", f"/v1/channels/{_channel(name)}/status", params=params)

    def prebuild(
        self, toolchain: dict[str, Any], channel: str | None, pulled_since_days: float | None
    ) -> list[dict]:
        body = {
            "toolchain": {
                "openvino": toolchain["openvino"],
                "runtime_requirements": toolchain.get("runtime_requirements"),
            },
            "channel": channel,
            "pulled_since_days": pulled_since_days,
        }
        return self._call("POST", "/v1/prebuild", json=body)


class _BodyReader(contextlib.AbstractContextManager):
    """A streamed response as a file to read (`read(n)`); `skip` bytes of it dropped first
    (a server that answered a range request with the whole file)."""

    def __init__(
        self, response: httpx.Response, skip: int, owner: httpx.Client | None = None
    ) -> None:
        self.response, self.owner = response, owner
        self._chunks = response.iter_bytes(DOWNLOAD_CHUNK)
        self._pending = b""
        while skip:
            piece = self._next()
            if not piece:
                break
            dropped = min(skip, len(piece))
            self._pending, skip = piece[dropped:], skip - dropped

    def _next(self) -> bytes:
        if self._pending:
            piece, self._pending = self._pending, b""
            return piece
        try:
            return next(self._chunks)
        except StopIteration:
            return b""
        except httpx.TransportError as error:
            raise ApiError(0, "unreachable", f"download broke off: {error}") from error

    @classmethod
    def checked(
        cls, response: httpx.Response, offset: int, owner: httpx.Client | None = None
    ) -> _BodyReader:
        """The reader of `response`, or its error raised (and everything closed)."""
        if response.status_code >= 400:
            response.read()
            response.close()
            if owner is not None:
                owner.close()
            _raise_for_error(response)
        return cls(response, 0 if response.status_code == 206 else offset, owner)

    def read(self, size: int = -1) -> bytes:
        piece = self._next()
        if size >= 0 and len(piece) > size:
            piece, self._pending = piece[:size], piece[size:]
        return piece

    def close(self) -> None:
        self.response.close()
        if self.owner is not None:
            self.owner.close()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _tls_for(base_url: str) -> ssl.SSLContext | bool:
    """How the client checks the API's certificate: httpx's default (the CA bundle) for an
    https API. A plain-http API never gets a TLS connection from this client (every request is
    relative to its base URL; presigned downloads go through the standard library), so it gets
    a context that trusts no certificate at all: it fails closed if ever used, and reading the
    CA bundle it would never use (~20 ms of every `farm` command through the API) is skipped."""
    if urllib.parse.urlsplit(base_url).scheme == "https":
        return True
    return ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)


def _channel(name: str) -> str:
    """A channel name checked before it goes into a URL path."""
    from farm.core.channels import check_name

    return check_name(name)


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
    """ApiError for an error answer of the farm API (`{"code", "message"}`); one that is not
    the farm API's says so, rather than pass for the farm's refusal (a token refused)."""
    if response.status_code < 400:
        return
    response.read()
    try:
        body = response.json()
    except ValueError:
        body = None
    if not (
        isinstance(body, dict)
        and isinstance(body.get("code"), str)
        and isinstance(body.get("message"), str)
    ):
        raise _not_farm(response)
    raise ApiError(response.status_code, body["code"], body["message"], body.get("details"))


def _body(response: httpx.Response) -> Any:
    """The JSON of a farm API answer; an answer that is not JSON is not the farm API's."""
    try:
        return response.json()
    except ValueError:
        raise _not_farm(response) from None


def _not_farm(response: httpx.Response) -> ApiError:
    """The error of an answer that is not the farm API's (another service at FARM_API_URL, a
    web page, a proxy's error page): an infrastructure error, whatever its HTTP status."""
    url = response.request.url.copy_with(query=None, fragment=None)
    content = response.headers.get("content-type", "no content type").split(";")[0]
    return ApiError(
        response.status_code,
        "not_farm_api",
        f"{url} answered HTTP {response.status_code} ({content}) that is not the farm API's "
        "answer: FARM_API_URL names something else than a farm API (`farm api`), or a proxy "
        "in front of it answered instead",
        kind=Kind.INFRASTRUCTURE,
    )


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
    connection = _connector(url)()
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
            raise _http_error(response)
        resumed = start and response.status == 206
        capped = _Capped(dest, start if resumed else 0, limit)
        capped.announced(response.length)
        digest = _digest_of(dest) if resumed else hashlib.sha256()
        with open(dest, "ab" if resumed else "wb") as sink, _HashingWriter(sink, digest) as writer:
            while True:
                buffer = writer.free_buffer()
                try:
                    count = response.readinto(buffer)
                except (OSError, http.client.HTTPException) as error:
                    writer.give_back(buffer)
                    raise ApiError(
                        0, "unreachable", f"download from {parts.netloc} broke off: {error}"
                    ) from error
                if not count or not capped.fits(count):
                    writer.give_back(buffer)
                    break  # the end, the connection closed early (checked below), or too long
                writer.write(buffer, count)
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


class _HashingWriter:
    """Writes and hashes a download's chunks on a thread of its own while the next chunk is
    read from the socket: hashlib and file writes release the GIL, so the sha256 overlaps the
    transfer instead of following it (one thread did both at about 0.88x raw boto3's speed).
    Chunks are written in the order they were read; the first write error is raised by the
    `with` block's exit (or the next `write`)."""

    def __init__(self, sink: Any, digest: Any) -> None:
        self._sink, self._digest = sink, digest
        self._free: queue.Queue[bytearray] = queue.Queue()
        for _ in range(DOWNLOAD_BUFFERS):
            self._free.put(bytearray(DOWNLOAD_CHUNK))
        self._full: queue.Queue[tuple[bytearray, int] | None] = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._drain, name="download-hash", daemon=True)

    def __enter__(self) -> _HashingWriter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._full.put(None)
        self._thread.join()
        if self._error is not None and exc[0] is None:
            raise self._error

    def free_buffer(self) -> bytearray:
        """A buffer to read into: waits while every buffer is still being written."""
        return self._free.get()

    def give_back(self, buffer: bytearray) -> None:
        self._free.put(buffer)

    def write(self, buffer: bytearray, count: int) -> None:
        if self._error is not None:
            raise self._error
        self._full.put((buffer, count))

    def _drain(self) -> None:
        while (item := self._full.get()) is not None:
            buffer, count = item
            if self._error is None:
                try:
                    with memoryview(buffer) as view:
                        self._sink.write(view[:count])
                        self._digest.update(view[:count])
                except BaseException as error:  # raised in the reading thread
                    self._error = error
            self._free.put(buffer)


def fetch_parts(
    url: str,
    dest: Path,
    size: int,
    part_bytes: int,
    sha256s: Sequence[str],
    progress: Progress | None = None,
    connections: int = 4,
    renew: Callable[[], str] | None = None,
) -> None:
    """GET a presigned URL of a `size`-byte object into `dest` (created, or emptied first), as
    parts of `part_bytes` (the last one shorter) fetched with Range requests over up to
    `connections` connections at once; part i must hash to `sha256s[i]` (lowercase hex).

    Each thread keeps its connection for all its parts and writes and hashes every chunk as it
    arrives, at its offset, through one reused DOWNLOAD_CHUNK buffer: memory stays about
    `connections` x DOWNLOAD_CHUNK, whatever the part size. `progress` gets the bytes received,
    from several threads, one call at a time.

    Raises ValueError, before any request, when `sha256s` does not hold one digest per part.
    IntegrityMismatch (naming the part and its offset) for a part whose sha256 differs, whose
    body is longer than its range, or shorter than it without a Content-Length, or whose
    Content-Range is not the range asked of a `size`-byte object (a body cut short of the
    length it announced is a broken connection: `unreachable`). ApiError for an HTTP error
    status or an answer that is not 206 (`http_error`), or a transport failure or timeout
    (status 0, `unreachable`). On the first error the other threads take no further part, and
    `dest` is removed before it is raised. OSError, before any request and touching nothing,
    when `dest` cannot be opened, a symbolic link there included.

    `renew`: a fresh URL of the same object. Given, a part whose connection breaks, or whose
    URL has expired (403), is asked for again on a new connection to a renewed URL, up to
    PART_ATTEMPTS times, while the parts already checked stay: a download that outlives its
    URL's lifetime (FARM_PRESIGN_SECONDS) goes on.
    """
    spans = _spans(size, part_bytes)
    if len(sha256s) != len(spans):
        raise ValueError(
            f"{len(sha256s)} part digests for {len(spans)} parts of {part_bytes} bytes "
            f"in {size} bytes"
        )
    if connections < 1:
        raise ValueError(f"connections={connections}: at least 1")
    source = _PartSource(url, renew)
    tries = [0] * len(spans)
    pending: queue.SimpleQueue[int] = queue.SimpleQueue()
    for index in range(len(spans)):
        pending.put(index)
    failed = threading.Event()
    errors: list[BaseException] = []
    lock = threading.Lock()

    def advance(count: int) -> None:
        if progress is not None:
            with lock:
                progress(count)

    def work() -> None:
        buffer = bytearray(DOWNLOAD_CHUNK)
        connection = None
        try:
            while not failed.is_set():
                try:
                    index = pending.get_nowait()
                except queue.Empty:
                    return
                url_now = source.current()
                if connection is None:
                    connection = url_now.connect()
                part = _Part(index, *spans[index], size, sha256s[index], dest.name)
                try:
                    part.fetch(connection, url_now, fd, buffer, failed, advance)
                except ApiError as error:
                    connection.close()
                    connection = None
                    tries[index] += 1
                    if not source.retries(error) or tries[index] >= PART_ATTEMPTS:
                        raise
                    source.renew_after(url_now)
                    pending.put(index)
        except BaseException as error:  # raised by the calling thread
            errors.append(error)
            failed.set()
        finally:
            if connection is not None:
                connection.close()

    workers = [
        threading.Thread(target=work, name=f"download-part-{n}", daemon=True)
        for n in range(min(connections, len(spans)))
    ]
    fd = open_emptied(dest)  # never O_TRUNC: ext4 would flush the whole file at its close
    try:
        try:
            os.ftruncate(fd, size)
            for worker in workers:
                worker.start()
            for worker in workers:
                worker.join()
        except BaseException:
            failed.set()
            raise
        finally:
            # Even on Ctrl-C: once closed, the descriptor's number may name another file, which
            # a thread still running would write into.
            for worker in workers:
                if worker.is_alive():
                    worker.join()
            os.close(fd)
        if errors:
            raise errors[0]
    except BaseException:
        dest.unlink(missing_ok=True)
        raise


PART_ATTEMPTS = 4
"""Tries of one part in `fetch_parts` when its connection breaks or its URL expires."""


@dataclass(frozen=True)
class _PartUrl:
    target: str
    netloc: str
    connect: Callable[[], http.client.HTTPConnection]

    @classmethod
    def of(cls, url: str) -> _PartUrl:
        parts = urllib.parse.urlsplit(url)
        target = urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, ""))
        return cls(target, parts.netloc, _connector(url))


class _PartSource:
    """The URL `fetch_parts` asks its parts of, renewed (once for all threads) when a part's
    request breaks or finds it expired."""

    def __init__(self, url: str, renew: Callable[[], str] | None) -> None:
        self._url = _PartUrl.of(url)
        self._renew = renew
        self._lock = threading.Lock()

    def current(self) -> _PartUrl:
        with self._lock:
            return self._url

    def retries(self, error: ApiError) -> bool:
        return self._renew is not None and error.status in (0, 403)

    def renew_after(self, failed: _PartUrl) -> None:
        assert self._renew is not None
        with self._lock:
            if self._url is failed:  # no other thread renewed it since
                self._url = _PartUrl.of(self._renew())


def _spans(size: int, part_bytes: int) -> list[tuple[int, int]]:
    """The (first, last) byte offsets, inclusive, of each part of a `size`-byte object."""
    if size < 0 or part_bytes < 1:
        raise ValueError(f"size={size} and part_bytes={part_bytes}: size >= 0, part_bytes >= 1")
    return [(a, min(a + part_bytes, size) - 1) for a in range(0, size, part_bytes)]


class _Part:
    """One part of a `fetch_parts`: its range, the object's size and the part's sha256."""

    def __init__(
        self, index: int, first: int, last: int, size: int, sha256: str, name: str
    ) -> None:
        self.index, self.first, self.last = index, first, last
        self.size, self.sha256, self.name = size, sha256, name

    def fetch(
        self,
        connection: http.client.HTTPConnection,
        url: _PartUrl,
        fd: int,
        buffer: bytearray,
        failed: threading.Event,
        progress: Progress,
    ) -> None:
        """GET the part of `url` on `connection` and write it at its offset into `fd`, hashing
        it; stops early, closing the connection, once `failed` is set."""
        ranged = {"Range": f"bytes={self.first}-{self.last}"}
        try:
            connection.request("GET", url.target, headers=ranged)
            response = connection.getresponse()
        except (OSError, http.client.HTTPException) as error:
            raise ApiError(
                0, "unreachable", f"download from {url.netloc} failed: {error}"
            ) from error
        try:
            self._read(response, url.netloc, fd, buffer, failed, progress)
        finally:
            if not response.isclosed():
                # Bytes of this answer may be left on the socket: the connection cannot carry
                # another request (and an answer to `Connection: close` owns the socket).
                response.close()
                connection.close()

    def _read(
        self,
        response: http.client.HTTPResponse,
        netloc: str,
        fd: int,
        buffer: bytearray,
        failed: threading.Event,
        progress: Progress,
    ) -> None:
        if response.status >= 400:
            raise _http_error(response)
        if response.status != 206:
            raise ApiError(
                response.status,
                "http_error",
                f"HTTP {response.status} to a request for bytes={self.first}-{self.last}, not "
                f"206 (partial content): {netloc} does not serve ranges",
            )
        answered = response.getheader("Content-Range")
        if answered != f"bytes {self.first}-{self.last}/{self.size}":
            raise self._mismatch(f"answered Content-Range {answered!r}")
        remaining = self.last - self.first + 1
        if response.length is not None and response.length != remaining:
            raise self._mismatch(f"announced {response.length} bytes")
        digest, offset = hashlib.sha256(), self.first
        with memoryview(buffer) as view:
            while remaining:
                if failed.is_set():
                    return
                try:
                    count = response.readinto(view[: min(remaining, len(view))])
                except (OSError, http.client.HTTPException) as error:
                    raise ApiError(
                        0, "unreachable", f"download from {netloc} broke off: {error}"
                    ) from error
                if not count and response.length is not None:
                    raise ApiError(
                        0,
                        "unreachable",
                        f"download from {netloc} broke off {remaining} bytes early",
                    )
                if not count:  # the end of a body without Content-Length
                    raise self._mismatch(f"ended {remaining} bytes early")
                pwrite_all(fd, view[:count], offset)
                digest.update(view[:count])
                offset, remaining = offset + count, remaining - count
                progress(count)
        try:
            longer = response.read(1)  # (a body without Content-Length that goes on)
        except (OSError, http.client.HTTPException) as error:
            raise ApiError(
                0, "unreachable", f"download from {netloc} broke off: {error}"
            ) from error
        if longer:
            raise self._mismatch("sent more bytes than the range")
        if digest.hexdigest() != self.sha256:
            raise self._mismatch(f"has sha256 {digest.hexdigest()}, not the recorded {self.sha256}")

    def _mismatch(self, what: str) -> IntegrityMismatch:
        return IntegrityMismatch(
            f"part {self.index} (offset {self.first}, bytes {self.first}-{self.last} of "
            f"{self.size}) of the download of {self.name} {what}; the download was deleted, "
            "not imported",
            details={"part": self.index, "offset": self.first},
        )


def _connector(url: str) -> Callable[[], http.client.HTTPConnection]:
    """A maker of connections (each opened by its first request) to the host of a presigned
    `url`: plain HTTP, or TLS checked against the CA bundle, loaded once for all of them."""
    parts = urllib.parse.urlsplit(url)
    host, port = parts.hostname, parts.port
    if not host:
        raise ApiError(0, "unreachable", f"the download URL has no host: {url[:200]}")
    if parts.scheme != "https":
        return lambda: http.client.HTTPConnection(host, port, timeout=DOWNLOAD_TIMEOUT_SECONDS)
    context = ssl.create_default_context()
    context.set_alpn_protocols(["http/1.1"])  # what http.client sets on a context of its own
    return lambda: http.client.HTTPSConnection(
        host, port, timeout=DOWNLOAD_TIMEOUT_SECONDS, context=context
    )


def _http_error(response: http.client.HTTPResponse) -> ApiError:
    """The error of a 4xx or 5xx answer to a presigned download (S3's XML, not the farm's)."""
    text = response.read(2000).decode("utf-8", errors="replace")
    return ApiError(response.status, "http_error", f"HTTP {response.status}: {text[:200]}")


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
