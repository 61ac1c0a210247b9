"""Settings from the environment (prefix ``FARM_``). Unset means the embedded default.

`SettingsFields` declares every setting once: its name, type, default and meaning. `Settings`
reads them from the environment without pydantic when every ``FARM_`` value is in its plain
form (a decimal integer, ``true``/``false``/``0``/``1``, a path, a URL): the CLI's read
commands start without loading pydantic (issue 30, item 4; bench/startup.py). Any other value,
and any settings given as arguments, go through `farm.core.validated.ValidatedSettings`
(pydantic-settings over the same declaration), which takes what pydantic takes and refuses what
it refuses, with its messages. tests/unit/test_config.py checks that both readers agree.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from functools import cached_property
from pathlib import Path
from typing import Any

from farm.core.text import strip_userinfo, url_password

ENV_PREFIX = "FARM_"
LIBPQ_SCHEMES = ("postgresql", "postgres")
"""The schemes of a libpq connection URL, which `psql` takes as FARM_DATABASE_URL does."""

BOUNDS: dict[str, tuple[int, int]] = {"status_lifetime_seconds": (60, 366 * 86400)}
"""Settings with a range: (least, most), inclusive."""


class SettingsFields:
    """Every setting: its name, type, default and meaning (read by `Settings` and
    `ValidatedSettings` alike)."""

    home: Path = Path(".farm")
    """Embedded mode keeps its SQLite database and blob folder here."""
    database_url: str | None = None
    """SQLAlchemy URL; default ``sqlite:///<home>/farm.db``."""
    storage_url: str | None = None
    """``s3://bucket/prefix`` or a folder; default ``<home>/store``."""

    cache_dir: Path = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "farm"
    """Client-side caches: file digests, and (on edges) downloaded blobs under ``blobs/``."""
    cache_max_bytes: int | None = None
    """Cap of the edge's blob cache; least recently used blobs go first. Unset: no cap."""
    agent_id: str | None = None
    """Name this edge reports its pulls under; default: the host name."""
    broker_url: str | None = None
    """Redis URL of the Celery broker. Set: served mode (jobs go to workers)."""
    s3_endpoint_url: str | None = None
    """S3 endpoint for SeaweedFS/MinIO; unset means AWS S3. A ``user:password@`` in it is
    dropped: boto3 never sends it (it signs with the FARM_S3_* keys), it would only leak into
    presigned URLs and error messages."""
    s3_region: str | None = None
    s3_access_key_id: str | None = None
    """Unset: boto3's standard credential chain (AWS_* variables, profile, instance role)."""
    s3_secret_access_key: str | None = None
    s3_checksums: str = "when_supported"
    """boto3 request checksums; 'when_required' for stores that reject them."""
    large_model_bytes: int = 2 * 2**30
    """Models larger than this go to the `.large` queue of each target."""
    worker_memory_bytes: int | None = None
    """Memory this worker offers; default: the host's. `.large` queues need large_worker_bytes."""
    large_worker_bytes: int = 16 * 2**30
    """A worker consumes `.large` queues only with at least this much memory."""
    lease_seconds: int = 120
    """A running job's lease; its worker renews it every third of this while compiling."""
    max_run_seconds: int = 3 * 3600
    """Hard time limit of one compile."""
    compile_memory_bytes: int | None = None
    """Memory limit of one compile (its child process's address space); a compile over it fails
    its own job. Default: 90% of worker_memory_bytes, or of the host's memory. 0: no limit."""
    max_queue_seconds: int = 24 * 3600
    """A job queued longer than this fails (no worker took it)."""
    max_blob_bytes: int | None = None
    """Largest blob one compile may write, whatever its model; a compile past it fails its job
    and stores nothing. Unset: the ratio below alone."""
    max_blob_ratio: float = 4.0
    """A blob may hold at most this many times its model's bytes, plus blob_bytes_over_model:
    a few KB of IR can broadcast a constant to GBs at compile time (2.6 KB made 240 MB)."""
    blob_bytes_over_model: int = 64 * 2**20
    """What a blob may hold beyond max_blob_ratio times its model (the compiled code)."""
    quarantine_on_failure: bool = True
    """A failed `farm verify` report quarantines its blob (edges refuse it until an admin
    releases it). Any pull token may report: a fleet whose edges' tokens are not trusted that
    far turns this off and quarantines by hand (`farm blobs quarantine`)."""
    channel_min_verifications: int = 1
    """Passed verifications each blob of a channel's candidate revision needs, on devices of
    its target, before a promotion past its first stage (`farm channel promote`); an admin may
    `--force` it (recorded). 0: only failed verifications and quarantines block."""
    reference_outputs: bool = True
    """Run each compiled model's source on CPU in f32 and store its outputs beside the blob, for
    `farm verify` on the edges. Skipped (with the reason recorded) for a model too large for
    compile_memory_bytes; false: never."""
    allow_remote_code: bool = False
    """Let a Hugging Face folder's own Python code (its .py files, an ``auto_map``) run when the
    worker converts it (docs/architecture.md §15), in the sandboxed child only. False: such
    folders are refused, naming this setting."""
    compile_user: str | None = None
    """User (name or uid) the compile child runs as when the worker runs as root, or through
    compile_launcher; default ``nobody``. ``root`` keeps a root worker's child root (not
    recommended: the child parses untrusted models)."""
    compile_launcher: Path | None = None
    """How a worker that is not root starts its compile child as compile_user: a copy of
    util-linux ``setpriv`` with the file capabilities ``cap_setuid,cap_setgid+ep``, executable
    only by the worker's group (the Docker image's ``/usr/local/libexec/farm/compile-launcher``,
    made by docker/compile-sandbox.sh). Unset, such a worker's child runs as the worker."""
    max_attempts: int = 3
    """Claims a new job gets. Every claim counts, whatever ended it: a worker that died (an
    OOM-killed compile) or an infrastructure error (storage, database, broker). Then it fails."""
    resend_after_seconds: int = 300
    """The reconciler re-sends a queued job's message after this long without a claim."""
    stale_upload_seconds: int = 3600
    """The reconciler aborts an unfinished multipart upload idle this long (no part sent),
    and deletes a local store's partial file neither written nor renamed for this long; an
    upload still sending parts is never aborted, however long it runs."""
    model_grace_seconds: int = 24 * 3600
    """`farm gc` deletes model files no job names once they are this old, so a model uploaded
    but not yet submitted survives."""
    worker_heartbeat_seconds: int = 30
    """How often a worker updates its row in `workers`; 3 missed beats and it counts as gone."""

    api_url: str | None = None
    """Set: the CLI talks to this farm API over HTTP instead of the database."""
    token: str | None = None
    """Bearer token for FARM_API_URL."""
    api_requests_per_minute: int = 600
    """Requests one token may make per minute (per API process)."""
    token_cache_seconds: float = 5.0
    """An API process trusts a token it found valid for this long without asking the database
    again: a token revoked elsewhere (`farm token revoke`) works here up to this much longer.
    0: every request looks its token up."""
    max_upload_bytes: int = 64 * 2**30
    """Largest model file the API accepts."""
    max_request_bytes: int = 1 << 20
    """Largest request body the API accepts on any route but the model upload."""
    max_concurrent_uploads: int = 4
    """Model uploads one API process streams at once; more are answered 503
    `too_many_uploads` with Retry-After (the client retries). Each holds up to ~80 MiB."""
    max_uploads_per_token: int = 2
    """Model uploads one token streams at once per API process; more are answered 429
    `too_many_uploads_for_token`, so one client cannot hold every upload slot. 0: no bound."""
    api_upload_min_bytes_per_second: int = 64 * 2**10
    """A model upload must arrive whole within FARM_API_BODY_TIMEOUT_SECONDS plus its
    Content-Length at this rate (408 past it): a client cannot hold an upload slot by dripping
    bytes, each in time for the per-piece timeout. 0: no total deadline."""
    max_queued_jobs_per_submitter: int = 1000
    """Queued jobs one token may have; past it a submission is answered 429
    `too_many_queued_jobs` (the broker keeps every queued message in memory). 0: no bound."""
    max_queues_per_submitter: int = 16
    """Queues (target and toolchain pairs) one token's queued jobs may wait on; a submission
    that would open another is answered 429 `too_many_queues`. 0: no bound."""
    max_stored_bytes_per_submitter: int = 1 << 40
    """Bytes one token may have stored: the model files it uploaded (in the last
    FARM_MODEL_GRACE_SECONDS, or of models it submitted) and the blobs of its jobs. Past it an
    upload or a submission is answered 413 `storage_quota_exceeded`. 0: no quota."""
    max_report_bytes: int = 64 * 2**10
    """Largest verification report an edge may send (413 `report_too_large`)."""
    max_reports_per_blob: int = 200
    """Verification reports one blob keeps; more are answered 429 `too_many_reports`, except a
    failure of a blob not yet quarantined (it quarantines the blob). 0: no bound."""
    max_reports_per_agent: int = 10
    """Verification reports one agent id may make about one blob (429 `too_many_reports`).
    0: no bound."""
    max_matrix: int = 64
    """Most jobs one submission may ask for."""
    presign_seconds: int = 900
    """Longest lifetime of a presigned download URL; never past the expiry of the token that
    asked for it."""
    blob_part_bytes: int = 64 << 20
    """The size of the parts a worker hashes each blob into, after its job is recorded, for a
    store that is not on its disk (S3): an edge downloads them on several connections and
    checks each as it arrives. At least 1 MiB (smaller: 1 MiB)."""
    dashboard_session_seconds: int = 8 * 3600
    """Lifetime of a dashboard session (its cookie holds a session id, never the token); never
    past the token's own expiry."""
    readyz_cache_seconds: float = 2.0
    """`/readyz` answers from its last check for this long, so a burst of probes costs one
    check of the database, broker and store. 0: check on every call."""
    metrics_cache_seconds: float = 60.0
    """`/metrics` and the dashboard's summary cards (whole-table aggregates) are recomputed at
    most this often per API process, in the background; requests in between get the last
    numbers. 0: computed on every request."""
    api_header_timeout_seconds: float = 10.0
    """A connection must send a complete request head within this long of connecting (or of
    its previous response), or the API closes it: slow clients cannot hold connections."""
    api_body_timeout_seconds: float = 30.0
    """The longest wait for the next piece of a request body (answered 408 past it). A body
    of any route but the model upload must also arrive whole within this long."""
    api_keep_alive_seconds: int = 5
    """An idle keep-alive connection is closed after this long."""

    worker_model_cache_bytes: int = 32 * 2**30
    """Workers keep fetched model files under ``FARM_CACHE_DIR/models`` up to this size (LRU),
    so another spec of the same model does not fetch it again. 0: no cache."""
    signing_key: Path | None = None
    """Workers: Ed25519 private key (PEM) that signs each blob. Embedded default:
    ``<home>/keys/signing.pem``, created on first use; served workers without one record
    unsigned blobs, which edges refuse."""
    trusted_keys: str | None = None
    """Edges: comma-separated paths of the public keys (PEM) whose signatures they accept;
    several, so a farm can rotate its key. The embedded farm's own key is always trusted.
    Workers and the embedded farm: besides their own key, the keys whose signed bundle part
    listings they reuse (§17)."""
    allow_unsigned: bool = False
    """Edges: import blobs without checking signatures (development only)."""
    status_key: Path | None = None
    """The API's own key (and an operator's direct CLI's): Ed25519 private key (PEM) that signs
    blob statuses and channel documents, never blobs, with the certificate a blob signing key
    gave it beside it (``<path>.cert``, `farm keys create-status`). Unset: both are signed
    with FARM_SIGNING_KEY where this host holds it (the embedded farm, a one-host farm), else
    not at all, and edges of this version refuse every blob and channel of this farm."""
    status_lifetime_seconds: int = 3600
    """How long an edge may act on a blob status the API signed (whether the farm still offers
    the blob, or quarantined it): the longest a replayed old answer, or a quarantine a proxy
    hides, can work. Edges ask on every pull, so this costs nothing online."""


_PLAIN: dict[str, re.Pattern[str]] = {
    "int": re.compile(r"-?(0|[1-9][0-9]*)"),
    "float": re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?"),
    "bool": re.compile(r"true|false|0|1"),
}
"""The plain forms `Settings` reads itself, by type; every other form goes to pydantic."""


FIELD_TYPES: dict[str, str] = {
    name: str(annotation).partition(" | ")[0]
    for name, annotation in SettingsFields.__annotations__.items()
}
"""Each setting's type: ``str``, ``int``, ``float``, ``bool`` or ``Path`` (or that or None)."""


_NOT_PLAIN = object()


def _plain(kind: str, text: str) -> Any:
    """`text` as a setting of type `kind`, or `_NOT_PLAIN` if pydantic must read it (any
    type but these five: a setting of another type is always read by pydantic)."""
    if kind in ("str", "Path"):
        return Path(text) if kind == "Path" else text
    pattern = _PLAIN.get(kind)
    if pattern is None or pattern.fullmatch(text) is None:
        return _NOT_PLAIN
    if kind == "bool":
        return text in ("true", "1")
    return int(text) if kind == "int" else float(text)


class Settings(SettingsFields):
    """The settings of this process: the environment's ``FARM_*`` variables, then `overrides`
    (keyword arguments, by setting name)."""

    def __init__(self, **overrides: Any) -> None:
        values = None if overrides else _read_plain(os.environ)
        if values is None:
            from farm.core.validated import ValidatedSettings  # pydantic: only when needed

            validated = ValidatedSettings(**overrides)
            values = {name: getattr(validated, name) for name in FIELD_TYPES}
        for name, value in values.items():
            setattr(self, name, value)
        if self.s3_endpoint_url:
            self.s3_endpoint_url = strip_userinfo(self.s3_endpoint_url)

    def model_copy(self, *, update: Mapping[str, Any] | None = None) -> Settings:
        """These settings with `update` applied (validated), as pydantic's `model_copy`."""
        fields = {name: getattr(self, name) for name in FIELD_TYPES}
        return Settings(**{**fields, **(update or {})})

    def __repr__(self) -> str:
        shown = ", ".join(f"{name}={getattr(self, name)!r}" for name in FIELD_TYPES)
        return f"Settings({shown})"

    @property
    def secrets(self) -> list[str]:
        """The passwords and keys in these settings, to redact from what is printed or logged
        (`farm.core.text.redact`)."""
        found = [url_password(url) for url in (self.database_url, self.broker_url)]
        found += [url_password(self.storage_url), self.s3_secret_access_key, self.token]
        return [secret for secret in found if secret]

    @property
    def served(self) -> bool:
        return self.broker_url is not None

    @cached_property
    def resolved_database_url(self) -> str:
        """The SQLAlchemy URL. A libpq URL (``postgresql://``, what `psql` takes) runs on
        psycopg, the PostgreSQL driver farm installs; SQLAlchemy alone would pick psycopg2."""
        url = self.database_url or f"sqlite:///{self.home.resolve() / 'farm.db'}"
        scheme, sep, rest = url.partition("://")
        if sep and scheme in LIBPQ_SCHEMES:
            return f"postgresql+psycopg://{rest}"
        return url

    @cached_property
    def resolved_storage_url(self) -> str:
        return self.storage_url or str(self.home.resolve() / "store")

    @property
    def resolved_compile_memory_bytes(self) -> int | None:
        """None: no limit. With ``farm worker --concurrency N``, set about 1/N of the default."""
        if self.compile_memory_bytes is not None:
            return self.compile_memory_bytes or None
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return int((self.worker_memory_bytes or host) * 0.9)

    @property
    def embedded_signing_key(self) -> Path:
        return self.home.resolve() / "keys" / "signing.pem"

    @property
    def resolved_signing_key(self) -> Path | None:
        return self.signing_key or (None if self.served else self.embedded_signing_key)

    @property
    def trusted_key_paths(self) -> list[Path]:
        return [Path(p.strip()) for p in (self.trusted_keys or "").split(",") if p.strip()]


def _read_plain(environ: Mapping[str, str]) -> dict[str, Any] | None:
    """The settings `environ` gives, each one it sets in its plain form; None when some value is
    not (pydantic then reads them all), or when two variables differ only in case."""
    given: dict[str, str] = {}
    for variable, text in environ.items():
        name = variable.lower()
        if name.startswith(ENV_PREFIX.lower()) and name[len(ENV_PREFIX) :] in FIELD_TYPES:
            if name in given:
                return None
            given[name] = text
    values: dict[str, Any] = {}
    for name, kind in FIELD_TYPES.items():
        found = given.get(ENV_PREFIX.lower() + name)
        if found is None:
            values[name] = getattr(SettingsFields, name)
            continue
        value = _plain(kind, found)
        if value is _NOT_PLAIN:
            return None
        if name in BOUNDS and not BOUNDS[name][0] <= value <= BOUNDS[name][1]:
            return None
        values[name] = value
    return values


def get_settings() -> Settings:
    return Settings()
