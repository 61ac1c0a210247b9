"""The edge agent: resolve a cache key, check the blob fits this machine, download it (resumed,
verified) into the local cache, import it, and report the pull. docs/architecture.md §10.

The agent trusts the keys it was given, not the farm: it refuses a record of another cache key
than the one it asked for, verifies the signed manifest (farm/core/signing.py) before acting
on anything, and from then on reads only the manifest's fields. A cached blob is bound to the
manifest it was verified against, and checked against it again on every use.

The agent talks to a `BlobSource`: the farm API's `FarmClient` on an edge, or the farm's own
database and store for an operator on the farm's network. Edge-safe: no SQLAlchemy, Celery,
boto3 or FastAPI.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import socket
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from farm.core import hashing
from farm.core.errors import (
    ApiError,
    BlobQuarantined,
    DiskFull,
    Incompatible,
    IntegrityMismatch,
    ModelFileError,
    NotFound,
    SignatureError,
)
from farm.core.filecache import BlobCache, booted_at, same_file
from farm.core.signing import Manifest, TrustedKeys
from farm.core.spec import CompileSpec, Target, Toolchain
from farm.core.status import verify_status
from farm.edge.importer import import_blob, import_config, import_failure
from farm.toolchain import host_toolchain

DOWNLOAD_ATTEMPTS = 5
"""Tries of one download; each resumes where the last broke off."""
RETRY_BACKOFF_SECONDS = 0.5
"""First pause between tries; doubles after each."""
TRANSIENT_STATUSES = frozenset({0, 429, 500, 502, 503, 504})
"""Download answers another try may not get: none at all (0, the network), too many requests,
and a server's passing fault (S3 asks for its 503 SlowDown and 500 InternalError to be
retried)."""
DISK_MARGIN_BYTES = 64 * 2**20
"""Free space kept besides the blob itself: a download that would fill the disk is refused."""

Progress = Callable[[int], None] | None


class BlobSource(Protocol):
    def resolve(self, cache_key: str) -> dict | None: ...

    def download(
        self,
        cache_key: str,
        dest: Path,
        progress: Progress = None,
        max_bytes: int | None = None,
    ) -> str | None:
        """Append the blob to `dest`; the sha256 of all of `dest` when computed on the way
        (None: the agent reads the file again to hash it). `dest` never grows past
        `max_bytes` (the signed size): a longer body is an `IntegrityMismatch`, and `dest` is
        removed (the agent checks the size again after any source)."""

    def report_pull(
        self,
        cache_key: str,
        agent_id: str,
        ok: bool,
        import_seconds: float | None = None,
        error: str | None = None,
    ) -> Any: ...

    def download_reference(self, cache_key: str, dest: Path, max_bytes: int) -> str | None:
        """Write the blob's reference outputs file to `dest` (`farm verify`)."""
        ...

    def report_verification(self, cache_key: str, report: dict[str, Any]) -> Any: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class Fetched:
    cache_key: str
    path: Path
    blob: dict
    """The farm's record with every field an edge acts on taken from the verified manifest."""
    downloaded: bool
    """False when the blob was already in the local cache."""


def default_agent_id() -> str:
    return socket.gethostname()


def incompatibilities(blob: Mapping[str, Any], here: Toolchain) -> list[str]:
    """Why `blob` cannot be imported by `here` (this machine's toolchain); empty if it can."""
    toolchain = blob.get("toolchain") or {}
    problems = []
    built = toolchain.get("openvino") or blob.get("openvino", "")
    if built.split("-")[0] != here.openvino:
        problems.append(f"it was built with OpenVINO {built}; this machine has {here.openvino}")
    if not Target.parse(blob["target"]).is_npu:
        wanted = toolchain.get("runtime_requirements")
        if wanted != here.runtime_requirements:
            problems.append(
                f"its CPU runtime requirements are {wanted!r}; this machine's are "
                f"{here.runtime_requirements!r} (a CPU blob imports only on an exact match)"
            )
    return problems


def verify_weights(blob: Mapping[str, Any], weights: Path) -> None:
    """A weightless blob imports with any `.bin` of the right size, silently wrong: check that
    `weights` is the very file the blob was compiled from."""
    wanted = (blob.get("model") or {}).get("bin")
    if wanted is None:
        raise IntegrityMismatch("the farm records no .bin digest for this weightless blob")
    actual = hashing.sha256_file(weights)
    if actual != wanted:
        raise IntegrityMismatch(
            f"{weights} is not the weights file this blob was compiled with "
            f"(sha256 {actual[:16]}…, the blob needs {wanted[:16]}…); refusing to import"
        )


class EdgeAgent:
    def __init__(
        self,
        source: BlobSource,
        cache: BlobCache,
        trust: TrustedKeys | None,
        agent_id: str | None = None,
        toolchain: Callable[[Target], Toolchain] | None = None,
        allow_quarantined: bool = False,
        status_required: bool = True,
    ) -> None:
        """`trust`: the keys whose signatures this edge accepts; None imports unsigned blobs.
        `allow_quarantined`: import blobs the farm quarantined (a failed verification) too.
        `status_required`: False only for a source that reads the farm's database itself (an
        operator's direct CLI), whose unsigned quarantine field is the database's own word."""
        self.source = source
        self.cache = cache
        self.trust = trust
        self.agent_id = agent_id or default_agent_id()
        self.toolchain = toolchain or host_toolchain
        self.allow_quarantined = allow_quarantined
        self.status_required = status_required

    def resolve(self, cache_key: str) -> dict:
        blob = self.source.resolve(cache_key)
        if blob is None:
            raise NotFound(f"the farm has no blob for cache key {cache_key}; submit it first")
        _same_key(cache_key, blob)
        return blob

    def check(self, blob: Mapping[str, Any], cache_key: str | None = None) -> Manifest:
        """Before any download: the record is of `cache_key` (the key this edge asked for),
        a trusted key signed its manifest, the farm's signed status of it is current and not
        quarantined, and this machine can import it. Returns the manifest: everything after
        this acts on its fields only."""
        _same_key(cache_key or str(blob.get("cache_key")), blob)
        manifest = Manifest.from_record(blob)
        if self.trust is not None:
            self.trust.verify_manifest(
                manifest,
                blob.get("signing_key_id"),
                blob.get("manifest_signature"),
                blob.get("signature"),
            )
        if self.quarantined(blob, manifest) and not self.allow_quarantined:
            raise BlobQuarantined(
                f"blob {manifest.cache_key} is quarantined by the farm: "
                f"{blob.get('quarantine_reason') or 'no reason given'}; nothing was downloaded "
                "(an admin releases it with `farm blobs release`; --allow-quarantined imports "
                "it anyway where the farm still hands it out, to an admin's token)"
            )
        problems = incompatibilities(
            manifest.fields(), self.toolchain(Target.parse(manifest.target))
        )
        if problems:
            raise Incompatible(
                f"blob {manifest.cache_key} cannot be imported here: {'; '.join(problems)}; "
                "nothing was downloaded"
            )
        return manifest

    def quarantined(self, blob: Mapping[str, Any], manifest: Manifest) -> bool:
        """Whether the farm quarantined the blob: by its signed, current status (SignatureError
        when there is none, or it is stale or of another blob) on an edge that checks
        signatures; by the record's unsigned `quarantined_at` on one that does not."""
        if self.trust is None or (blob.get("status") is None and not self.status_required):
            return bool(blob.get("quarantined_at"))
        status = verify_status(self.trust, blob, manifest, time.time())
        return status.state == "quarantined"

    def fetch(self, cache_key: str, progress: Progress = None, blob: dict | None = None) -> Fetched:
        """The verified blob in the local cache: from the cache, or downloaded (resumed after a
        broken connection, no longer than its signed size, checked against its signed sha256)
        after the checks of `check`. `blob` is the farm's record of it, when the caller
        resolved it already."""
        record = blob or self.resolve(cache_key)
        manifest = self.check(record, cache_key)
        signed = {
            "manifest": manifest.document(),
            "signing_key_id": record.get("signing_key_id"),
            "manifest_signature": record.get("manifest_signature"),
        }
        verified = {**record, **manifest.fields()}
        cached = self._cached(manifest, signed)
        if cached is not None:
            return Fetched(cache_key, cached, verified, downloaded=False)
        partial = self.cache.partial_path(cache_key)
        with _downloading(partial):
            cached = self._cached(manifest, signed)  # put by the process this one waited for
            if cached is not None:
                return Fetched(cache_key, cached, verified, downloaded=False)
            _forget_if_written_before_this_boot(partial)
            self._ensure_room(manifest.size_bytes - _size(partial))
            path = self._fetched_in_parts(record, manifest, partial, signed, progress)
            if path is not None:
                return Fetched(cache_key, path, verified, downloaded=True)
            digest = self._download(cache_key, partial, manifest.size_bytes, progress)
            actual = digest or hashing.sha256_file(partial)
            if actual != manifest.sha256:
                partial.unlink(missing_ok=True)
                raise IntegrityMismatch(
                    f"downloaded blob {cache_key} has sha256 {actual}, its signed manifest says "
                    f"{manifest.sha256}; deleted, not imported"
                )
            path = self.cache.put(cache_key, partial, signed)
        return Fetched(cache_key, path, verified, downloaded=True)

    def _fetched_in_parts(
        self,
        record: Mapping[str, Any],
        manifest: Manifest,
        partial: Path,
        signed: dict[str, Any],
        progress: Progress,
    ) -> Path | None:
        """A new blob downloaded as its signed parts, on several connections, each checked as
        it arrives (bench/README.md "edge"), and put into the cache; None when it was not.

        Only for parts a trusted key bound to the verified manifest (with FARM_ALLOW_UNSIGNED
        nothing binds them to the record's sha256: never), a source that can, and no download
        to resume. The parts go to a file of their own (`<key>.parts`), held under an exclusive
        lock from its open to its rename into the cache, so another process pulling the same
        blob (which then takes the one stream) never writes into a file this one checked, and a
        download killed midway is started again, never resumed as if it were a prefix.
        Otherwise, and after any failure to download, `_download` fetches one stream, checked
        against the manifest's sha256, which the parts' signature names: either way the bytes
        are the ones signed. A part whose bytes differ refuses the blob."""
        download_parts = getattr(self.source, "download_parts", None)
        if download_parts is None or self.trust is None or _size(partial) > 0:
            return None
        parts = self.trust.verified_parts(record, manifest)
        if parts is None:
            return None
        target = partial.with_name(f"{partial.name}.parts")
        try:
            lock = os.open(target, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        except OSError:
            return None  # not a regular file of ours: the one stream
        held = False
        try:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return None  # another process downloads these parts now
            held = True
            if not same_file(lock, target):
                return None  # put into the cache, or removed, by the process that held it
            self._ensure_room(manifest.size_bytes)
            try:
                size, key = manifest.size_bytes, manifest.cache_key
                if not download_parts(key, target, size, parts, progress):
                    return None
            except (ApiError, OSError):
                # `target` is gone; the one stream asks for the blob again, with its retries,
                # and says what is wrong if it still is (a refusal, a full disk).
                return None
            except IntegrityMismatch as error:
                raise IntegrityMismatch(
                    f"downloaded blob {manifest.cache_key}: {error}; deleted, not imported",
                    details=error.details,
                ) from None
            return self.cache.put(manifest.cache_key, target, signed)  # each part checked
        finally:
            if held and same_file(lock, target):  # not in the cache: a lock file, or nothing
                target.unlink(missing_ok=True)
            os.close(lock)

    def _cached(self, manifest: Manifest, signed: dict[str, Any]) -> Path | None:
        """The cached blob, if it is bound to `manifest`: the manifest kept beside it is for
        this key, signed by a key trusted now, the one just verified, and the file is unchanged
        since it was verified (its stamp, core/filecache.py). A file that is not bound (changed
        on disk, placed under another key's name, kept by an older farm, signed by a retired
        key) is hashed again: kept and bound anew if its bytes are the manifest's, else
        replaced by a fresh download. Never imported unverified."""
        key = manifest.cache_key
        path = self.cache.get(key)
        if path is None:
            return None
        if self._bound(self.cache.manifest(key), manifest):
            return path
        try:
            if _size(path) == manifest.size_bytes and hashing.sha256_file(path) == manifest.sha256:
                self.cache.bind(key, signed)
                return path
        except FileNotFoundError:
            return None  # evicted meanwhile
        self.cache.discard(key)
        return None

    def _bound(self, kept: Mapping[str, Any] | None, manifest: Manifest) -> bool:
        if kept is None or kept.get("manifest") != manifest.document():
            return False
        if self.trust is None:
            return True
        try:
            self.trust.verify_manifest(
                Manifest.from_record(kept["manifest"]),
                kept.get("signing_key_id"),
                kept.get("manifest_signature"),
            )
        except (SignatureError, IntegrityMismatch):
            return False
        return True

    def load(
        self,
        cache_key: str,
        device: str | None = None,
        weights: Path | None = None,
        blob: dict | None = None,
        report: bool = True,
        spec: CompileSpec | None = None,
    ):
        """Fetch, import from a memory map, report the pull (unless `report` is False: a
        verification is reported as such, not as an app's pull): an `ImportedBlob`. `spec`:
        the spec the caller computed `cache_key` from (a CPU blob is imported with its
        properties; else the record's, when its signed key was computed from it)."""
        fetched = self.fetch(cache_key, blob=blob)
        blob = fetched.blob
        device = device or Target.parse(blob["target"]).device
        try:
            if blob.get("weightless"):
                if weights is None:
                    wanted = (blob.get("model") or {}).get("bin") or "?"
                    raise ModelFileError(
                        f"blob {cache_key} is weightless: import it with --weights MODEL.bin, "
                        f"the model's own weights file (sha256 {wanted}), or pull it by the "
                        "model (farm pull MODEL.xml --device ...)"
                    )
                verify_weights(blob, weights)
            lease = self.cache.hold(cache_key)
            try:
                config = import_config(blob, spec)
                imported = import_blob(fetched.path, device, weights, lease, config)
            except RuntimeError as error:  # what OpenVINO raises, as an error one can act on
                lease.close()
                target = Target.parse(blob["target"])
                raise import_failure(fetched.path, target, weights, error) from error
            except BaseException:
                lease.close()
                raise
            # The lease ends with the imported model (whoever drops it last), not before.
            weakref.finalize(imported, lease.close)
        except Exception as error:
            if report:
                self._report(cache_key, ok=False, error=f"{type(error).__name__}: {error}")
            raise
        if report:
            self._report(cache_key, ok=True, import_seconds=imported.import_seconds)
        return imported

    def report_download(self, cache_key: str) -> None:
        """A pull without an import (prefetch): recorded with no import time."""
        self._report(cache_key, ok=True)

    def _report(self, cache_key: str, ok: bool, **details: Any) -> None:
        try:
            self.source.report_pull(cache_key, self.agent_id, ok, **details)
        except (ApiError, BlobQuarantined) as error:
            # The farm refuses an ok pull of a quarantined blob; this edge imported it only
            # with --allow-quarantined, and the import stands.
            if getattr(error, "code", None) != "quarantined":
                raise

    def _download(self, cache_key: str, partial: Path, size: int, progress: Progress) -> str | None:
        """Download with retries; the sha256 of the file if the source computed it."""
        if _size(partial) > size:
            partial.unlink()  # not a prefix of this blob
        pause = RETRY_BACKOFF_SECONDS
        for attempt in range(1, DOWNLOAD_ATTEMPTS + 1):
            try:
                digest = self.source.download(cache_key, partial, progress, max_bytes=size)
            except OSError as error:
                if error.errno not in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
                    raise
                partial.unlink(missing_ok=True)
                raise DiskFull(
                    f"no room to download {cache_key} into {self.cache.root} ({error.strerror}); "
                    "the partial download was removed"
                ) from error
            except ApiError as error:
                if error.status not in TRANSIENT_STATUSES or attempt == DOWNLOAD_ATTEMPTS:
                    raise  # refused by the farm, or the fault stays
                time.sleep(pause)
                pause *= 2
                continue
            if _size(partial) > size:  # a source that does not stop at the limit itself
                partial.unlink(missing_ok=True)
                raise IntegrityMismatch(
                    f"the download of blob {cache_key} was longer than its signed {size} bytes; "
                    "deleted, not imported"
                )
            if _size(partial) == size:
                return digest
        raise IntegrityMismatch(
            f"download of {cache_key} kept ending early ({_size(partial)} of {size} bytes)"
        )

    def _ensure_room(self, needed: int) -> None:
        self.cache.evict()
        free = shutil.disk_usage(self.cache.root).free
        if free < needed + DISK_MARGIN_BYTES:
            raise DiskFull(
                f"the blob needs {needed} more bytes in {self.cache.root} but only {free} are "
                "free; free some space or set FARM_CACHE_DIR / FARM_CACHE_MAX_BYTES"
            )


def _forget_if_written_before_this_boot(partial: Path) -> None:
    """Start a download over rather than resume one broken off in an earlier boot: it was not
    flushed, so a crash may have left ranges of zeros in the prefix it would resume from (its
    sha256 would then refuse the whole blob, deleted, after the whole download)."""
    with contextlib.suppress(FileNotFoundError):
        if partial.stat().st_mtime < booted_at():
            partial.unlink()


@contextlib.contextmanager
def _downloading(partial: Path) -> Iterator[None]:
    """Held while this process downloads a blob into `partial` and puts it into the cache:
    another process pulling the same blob into the same cache waits here, then finds it
    cached. (The one stream's hash is of the bytes received, not of the file: a second
    writer of the same partial file could empty its start under a download that then
    passed its check.) The lock file goes when released; a waiter left holding a file no
    longer at its name takes the lock again."""
    path = partial.with_name(f"{partial.name}.lock")
    while True:
        lock = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if same_file(lock, path):
                break
        except BaseException:
            os.close(lock)
            raise
        os.close(lock)
    try:
        yield
    finally:
        path.unlink(missing_ok=True)  # while held: no other process holds this file
        os.close(lock)


def _same_key(asked: str, blob: Mapping[str, Any]) -> None:
    """The farm (or whatever answers in its name) must answer the key that was asked."""
    answered = blob.get("cache_key")
    if answered != asked:
        raise IntegrityMismatch(
            f"asked for blob {asked}, the farm answered with the record of {str(answered)[:64]}; "
            "refusing it (a proxy or the farm's API swapped it): nothing was downloaded"
        )


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0
