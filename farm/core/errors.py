"""Every error farm raises on purpose, in one place, under one root: `FarmError`.

Each error carries a `kind` (what went wrong, from the caller's point of view) and a stable
`code` (a machine-readable name, the API's error code). Callers decide by kind, never by class
name: the CLI's exit code and the API's HTTP status each come from one table keyed by `Kind`
(`farm.cli.common.EXIT_CODES`, `farm.server.api.errors.HTTP_STATUS`), so a new error class
needs no new table entry, and an edge install (no SQLAlchemy, no boto3) maps what it meets
without importing what it lacks.

Where an error used to derive from a standard exception (`ValueError`, `LookupError`,
`OSError`), it still does, so existing `except ValueError` callers keep working.

Standard library only: the edge imports this module.
"""

from __future__ import annotations

import enum
from typing import Any


class Kind(enum.Enum):
    """What kind of failure an error is; the CLI and the API each map a kind to one answer."""

    BAD_INPUT = "bad_input"
    """The caller's input is wrong (spec, model file, cache key, token name): fix it, retry."""
    NOT_FOUND = "not_found"
    """No such job, blob or token."""
    CONFLICT = "conflict"
    """The request needs something first (upload the model files, then submit again)."""
    CANNOT_RUN_HERE = "cannot_run_here"
    """This host cannot compile for the target, or cannot import the blob."""
    INTEGRITY = "integrity"
    """Bytes do not match what was recorded: refused, never used."""
    UNTRUSTED = "untrusted"
    """A blob that is unsigned, signed by a key this machine does not trust, or whose signature
    does not verify: refused, never imported. Fixed by trust (FARM_TRUSTED_KEYS) or by the
    farm's operator (`farm keys resign`), not by retrying."""
    INFRASTRUCTURE = "infrastructure"
    """Storage, database, broker, disk or the API failed; retrying later may succeed."""
    UNAUTHORIZED = "unauthorized"
    """No valid token (missing, invalid, revoked or expired)."""
    FORBIDDEN = "forbidden"
    """A valid token whose role does not allow this."""
    RATE_LIMITED = "rate_limited"
    """Too many requests for this token; retry later."""
    JOB_FAILED = "job_failed"
    """A job ran and did not produce its blob (cancelled, timed out)."""
    GAVE_UP = "gave_up"
    """The caller stopped waiting; what it waited for goes on (a job no worker took yet)."""
    REJECTED = "rejected"
    """The blob does not compute its reference numbers: a verification outside tolerance, or
    a blob quarantined because one was."""


class FarmError(Exception):
    """The root of every farm error. `kind` and `code` are class defaults an instance may
    override; `details` is JSON-ready data for scripts (the API returns it)."""

    kind: Kind = Kind.INFRASTRUCTURE
    code: str = "error"

    def __init__(self, message: str = "", *, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.details = details or {}

    def __str__(self) -> str:
        return self.message or super().__str__()


# --- bad input -----------------------------------------------------------------------------


class SpecError(FarmError, ValueError):
    """A compile spec that is invalid, ambiguous or unsupported for its target."""

    kind, code = Kind.BAD_INPUT, "invalid_spec"


class ModelFileError(FarmError, ValueError):
    """Model files that are missing, unreadable or of an unknown format."""

    kind, code = Kind.BAD_INPUT, "invalid_model"


class CompileError(FarmError):
    """The model or spec cannot be compiled: the job fails with this message, no retry."""

    kind, code = Kind.BAD_INPUT, "compile_failed"
    output: str = ""
    """What the compiler printed before it failed, when it ran in a child (the sandbox)."""


class PipelineError(FarmError, ValueError):
    """A GenAI pipeline folder or pipeline option that cannot be compiled as asked: the
    message names the file or the option to fix."""

    kind, code = Kind.BAD_INPUT, "invalid_pipeline"


class ModelError(CompileError):
    """The model files cannot be read, or the spec does not fit the model."""

    code = "invalid_model"


class ConversionError(CompileError):
    """A stage (converting a source, compressing a model) failed: the message names the file
    and the converter's reason. Nothing it half-made is recorded or reused."""

    code = "conversion_failed"


class ConverterUnavailable(FarmError, RuntimeError):
    """No worker (or not this host) has the converter a recipe needs: the message names it and
    the extra that installs it (``pip install 'farm[convert]'``)."""

    kind, code = Kind.CANNOT_RUN_HERE, "converter_unavailable"
    output: str = ""


class BlobFormatError(FarmError, ValueError):
    """A file that is not an OpenVINO cache entry farm can read."""

    kind, code = Kind.BAD_INPUT, "invalid_blob"


class CacheError(FarmError, ValueError):
    """A cache key that is not one, or a cache that cannot hold the blob."""

    kind, code = Kind.BAD_INPUT, "cache_error"


class KeyFileError(FarmError, ValueError):
    """A signing or trusted key file that is missing, unreadable or not an Ed25519 key."""

    kind, code = Kind.BAD_INPUT, "invalid_key_file"


class TokenError(FarmError, ValueError):
    """A token name or role that is not allowed, or a name already in use."""

    kind, code = Kind.BAD_INPUT, "invalid_token"


class CompressionArgsError(SpecError):
    """Compression or quantization arguments that are invalid, or that the target cannot run
    (NF4 weights below NPU 4000)."""

    code = "invalid_compression"


class CalibrationError(FarmError, ValueError):
    """A calibration folder for `--quantize` that is unreadable, too small, or whose arrays do
    not fit the model's inputs."""

    kind, code = Kind.BAD_INPUT, "invalid_calibration"


class BlobTooLarge(CompileError):
    """The compile wrote a blob past its size limit (`FARM_MAX_BLOB_BYTES`): the job fails and
    nothing is stored."""

    code = "blob_too_large"


# --- not found and conflicts ---------------------------------------------------------------


class NotFound(FarmError, LookupError):
    """No job or blob by that id or cache key."""

    kind, code = Kind.NOT_FOUND, "not_found"


class BlobNotAvailable(FarmError, LookupError):
    """The farm has no blob for this model and spec yet (and no local compile was allowed)."""

    kind, code = Kind.NOT_FOUND, "blob_not_available"


class Conflict(FarmError):
    """The request contradicts the farm's current state (a report about bytes since replaced,
    a rebuild of a blob that is not quarantined)."""

    kind, code = Kind.CONFLICT, "conflict"


class PromotionBlocked(FarmError):
    """A channel's rollout may not go further: a blob of the revision failed verifications,
    is quarantined, or has too few passed verifications on devices of its target. An admin
    may force it (`--force`, recorded)."""

    kind, code = Kind.CONFLICT, "promotion_blocked"


class ModelMissing(FarmError, LookupError):
    """The store lacks model files a new job needs; upload them and submit again."""

    kind, code = Kind.CONFLICT, "model_missing"

    def __init__(self, missing: list[str]) -> None:
        super().__init__(
            f"the farm lacks model files {', '.join(missing)}; upload them first",
            details={"missing": missing},
        )
        self.missing = missing


# --- this host cannot ----------------------------------------------------------------------


class CompilerUnavailable(FarmError, RuntimeError):
    """This host cannot compile for the target (compiler library or device missing).

    Not the model's fault: the job belongs on a host that can compile for the target.
    """

    kind, code = Kind.CANNOT_RUN_HERE, "compiler_unavailable"
    output: str = ""
    """What the compiler printed before it gave up, when it ran in a child (the sandbox)."""


class ReferencePending(FarmError):
    """The blob's reference outputs are still being computed (they follow the blob): a
    verification cannot judge it yet. Never a failure of the blob."""

    kind, code = Kind.CANNOT_RUN_HERE, "reference_pending"


class Incompatible(FarmError):
    """This host cannot import the blob (another OpenVINO, target or CPU runtime)."""

    kind, code = Kind.CANNOT_RUN_HERE, "incompatible"


class NotInstalled(FarmError):
    """This install lacks the libraries a command needs (an edge install running an operator
    command): the message names the extra to install (`farm[server]`)."""

    kind, code = Kind.CANNOT_RUN_HERE, "not_installed"


class NeedsDatabase(FarmError):
    """A command that works on the farm's database itself, run where only the API is configured
    (FARM_API_URL without FARM_DATABASE_URL): refused rather than run on a local database."""

    kind, code = Kind.CANNOT_RUN_HERE, "needs_database"


# --- integrity -----------------------------------------------------------------------------


class IntegrityMismatch(FarmError):
    """Stored or downloaded bytes do not match their recorded sha256."""

    kind, code = Kind.INTEGRITY, "integrity_mismatch"


class SignatureError(FarmError):
    """A blob record that is unsigned, signed by an untrusted key, or whose signature fails."""

    kind, code = Kind.UNTRUSTED, "signature_invalid"


class ChannelReplay(SignatureError):
    """A channel document older than one this edge already accepted (a replay), or a second
    document with the same sequence: refused, the edge stays on its revision."""

    code = "channel_replay"


class BlobQuarantined(FarmError):
    """The blob failed a verification somewhere (or an admin quarantined it): not imported."""

    kind, code = Kind.REJECTED, "quarantined"


class DriftExceeded(FarmError):
    """A compressed or quantized model drifts from the uncompressed one past the submitter's
    `--max-drift`: nothing is published from it."""

    kind, code = Kind.REJECTED, "drift_exceeded"


class VerificationFailed(FarmError):
    """The blob's outputs on this device are outside the tolerance of its reference."""

    kind, code = Kind.REJECTED, "verification_failed"


class ModelFileCorrupt(IntegrityMismatch):
    """A stored model file whose bytes do not have the digest it is stored under. The worker
    that found it removes it, so the farm reports it missing and takes the genuine bytes."""

    code = "model_file_corrupt"


# --- infrastructure ------------------------------------------------------------------------


class StorageError(FarmError):
    """The store failed or holds something it should not (the caller may retry)."""

    kind, code = Kind.INFRASTRUCTURE, "storage_error"


class InvalidKey(StorageError, ValueError):
    """A storage key that could escape the store's root or is not a plain relative path."""

    code = "invalid_storage_key"


class ChecksumMismatch(StorageError):
    """The bytes written or read do not have the sha256 they were expected to have."""

    code = "digest_mismatch"


class AlreadyStored(ChecksumMismatch):
    """The key holds an object already, with other bytes: objects are written once."""


class ServiceUnavailable(FarmError):
    """The database, broker or store does not answer (or is misconfigured)."""

    kind, code = Kind.INFRASTRUCTURE, "service_unavailable"


class DatabaseUnavailable(ServiceUnavailable):
    """The database refused or lost the connection (down, restarting, wrong URL)."""

    code = "database_unavailable"


class BrokerUnavailable(ServiceUnavailable):
    """The broker did not take a job's message (down, restarting, wrong URL). The job is
    recorded all the same: the reconciler sends it when the broker is back."""

    code = "broker_unavailable"


class WorkDiskFull(FarmError):
    """The worker's temporary directory has no room for a compile's files. An infrastructure
    error: the job is retried (perhaps by a worker with more room), then fails with this."""

    kind, code = Kind.INFRASTRUCTURE, "work_disk_full"


class DiskFull(FarmError, OSError):
    """The edge's cache has no room for the blob."""

    kind, code = Kind.INFRASTRUCTURE, "disk_full"


class SandboxUnavailable(FarmError):
    """The worker cannot set up the compile sandbox (no such compile user, a temporary
    directory that user cannot reach): the host's fault, so the job is retried."""

    kind, code = Kind.INFRASTRUCTURE, "sandbox_unavailable"


# --- authorization -------------------------------------------------------------------------


class Forbidden(FarmError):
    """A valid caller that may not do this (another submitter's job)."""

    kind, code = Kind.FORBIDDEN, "forbidden"


class TokenExpired(FarmError):
    """A token past its expiry: 401 `token_expired`."""

    kind, code = Kind.UNAUTHORIZED, "token_expired"


# --- limits an admin sets ----------------------------------------------------------------


class LimitReached(FarmError):
    """A request that would pass a bound the admin sets (a `FARM_*` setting, named in the
    message and in `details.setting`), so that no one client takes what belongs to all. The API
    answers `status`: 429 for a count that frees up as work finishes (retry later), 413 for a
    size or a quota (ask less, or ask the admin)."""

    kind, code = Kind.RATE_LIMITED, "limit_reached"
    status = 429

    def __init__(self, message: str, *, setting: str, limit: int | float) -> None:
        super().__init__(
            f"{message} (limit: {setting}={limit:g})",
            details={"setting": setting, "limit": limit},
        )
        self.setting = setting


class TooManyUploads(LimitReached):
    """This token already streams as many model uploads as one token may at once
    (`FARM_MAX_UPLOADS_PER_TOKEN`); answered before the body is read."""

    code = "too_many_uploads_for_token"
    headers = {"Retry-After": "1", "Connection": "close"}  # noqa: RUF012


class TooManyQueuedJobs(LimitReached):
    """The submitter has as many queued jobs as it may (`FARM_MAX_QUEUED_JOBS_PER_SUBMITTER`)."""

    code = "too_many_queued_jobs"
    headers = {"Retry-After": "30"}  # noqa: RUF012


class TooManyQueues(LimitReached):
    """The submitter's queued jobs already wait on as many queues (target and toolchain pairs)
    as it may (`FARM_MAX_QUEUES_PER_SUBMITTER`): each queue is a list the broker keeps."""

    code = "too_many_queues"
    headers = {"Retry-After": "30"}  # noqa: RUF012


class TooManyReports(LimitReached):
    """A blob holds as many verification reports as it may, in all or from this agent
    (`FARM_MAX_REPORTS_PER_BLOB`, `FARM_MAX_REPORTS_PER_AGENT`)."""

    code = "too_many_reports"


class ReportTooLarge(LimitReached):
    """A verification report larger than `FARM_MAX_REPORT_BYTES`."""

    kind, code = Kind.BAD_INPUT, "report_too_large"
    status = 413


class StorageQuotaExceeded(LimitReached):
    """The submitter's stored bytes (model files it uploaded, blobs of its jobs) would pass
    `FARM_MAX_STORED_BYTES_PER_SUBMITTER`."""

    kind, code = Kind.BAD_INPUT, "storage_quota_exceeded"
    status = 413


# --- jobs that ran -------------------------------------------------------------------------


class CompileCancelled(FarmError):
    """`farm cancel` stopped the compile."""

    kind, code = Kind.JOB_FAILED, "cancelled"


class WaitTimeout(FarmError):
    """`farm submit --wait` gave up on a job that stayed queued past `--wait-timeout`."""

    kind, code = Kind.GAVE_UP, "wait_timeout"


class CompileTimeout(FarmError):
    """The compile ran past `FARM_MAX_RUN_SECONDS` and was killed."""

    kind, code = Kind.JOB_FAILED, "compile_timeout"
    output: str = ""
    """What the compiler printed before it was killed."""


# --- the HTTP API ----------------------------------------------------------------------------

_KIND_OF_STATUS = {
    401: Kind.UNAUTHORIZED,
    403: Kind.FORBIDDEN,
    404: Kind.NOT_FOUND,
    409: Kind.CONFLICT,
    429: Kind.RATE_LIMITED,
}


class ApiError(FarmError):
    """An answer of the farm API with an HTTP `status`, a stable `code` and a `message`: raised
    by the server's routes (which set the status) and by the client (which read it)."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        details: dict[str, Any] | None = None,
        *,
        kind: Kind | None = None,
    ) -> None:
        super().__init__(message, details=details)
        self.status, self.code = status, code
        if kind is not None:  # the client's own reading of an answer (not the farm API's)
            self.kind = kind
            return
        by_status = _KIND_OF_STATUS.get(
            status, Kind.BAD_INPUT if 400 <= status < 500 else Kind.INFRASTRUCTURE
        )
        by_code = kind_of_code(code)
        # A code names the error's kind, unless the server answered it as the client's fault
        # (a 4xx `digest_mismatch` is bad input, though the store's own mismatch is not).
        client_fault = 400 <= status < 500
        self.kind = (
            by_code
            if by_code is not None and not (client_fault and by_code is Kind.INFRASTRUCTURE)
            else by_status
        )


def kind_of_code(code: str) -> Kind | None:
    """The kind of the farm error with this `code`, so an answer of the API keeps the kind the
    server's error had (a `compiler_unavailable` is exit 4 on both sides of HTTP)."""
    pending: list[type[FarmError]] = [FarmError]
    kinds: dict[str, Kind] = {}
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        if cls is not ApiError and "code" in vars(cls):
            kinds.setdefault(cls.code, cls.kind)
    return kinds.get(code)
