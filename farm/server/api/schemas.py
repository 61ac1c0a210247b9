"""Request and response bodies. Unknown fields are refused: a typo is an error, not ignored."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints

from farm.core.sources import MAX_FOLDER_FILES
from farm.core.stages import MAX_STAGES
from farm.core.vocabulary import Outcome


def _no_nul(value: str) -> str:
    # PostgreSQL text cannot hold NUL, and no database UTF-8 holds a lone surrogate (JSON's
    # "\udcff"): refuse both here as bad input rather than fail at INSERT.
    if "\x00" in value:
        raise ValueError("must not contain NUL characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode (no lone surrogates)") from None
    return value


def _printable(value: str) -> str:
    if not value.isprintable():
        raise ValueError("must be printable: no control characters")
    return value


def _file_name(value: str) -> str:
    if "/" in value or "\\" in value or value in (".", ".."):
        raise ValueError("must be a file name, not a path")
    return value


Text = Annotated[str, AfterValidator(_no_nul)]
"""Any text that may reach the database."""
Sha256 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
Name = Annotated[Text, StringConstraints(min_length=1, max_length=256), AfterValidator(_printable)]
"""A name people read in listings and terminals."""
FileName = Annotated[Name, AfterValidator(_file_name)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Error(BaseModel):
    code: str = Field(description="Stable, machine-readable: 'invalid_spec', 'not_found', ...")
    message: str = Field(description="What went wrong and what to do, for a person.")
    details: dict[str, Any] | None = None


class MissingRequest(Strict):
    sha256: list[Sha256] = Field(min_length=1, max_length=16)


class MissingResponse(BaseModel):
    missing: list[str]


class SpecIn(Strict):
    """One compile spec, in the canonical form of docs/architecture.md §5 plus its target."""

    target: Name
    tiles: int | None = None
    performance_hint: Text | None = Field(None, max_length=32)
    compiler_params: Text | None = Field(None, max_length=512)
    shapes: dict[Name, list[int]] = Field(default_factory=dict, max_length=64)
    batch: int | None = None
    layout: dict[Name | Literal[""], Annotated[Text, StringConstraints(max_length=64)]] = Field(
        default_factory=dict, max_length=64
    )
    weightless: bool = False
    config: dict[
        Annotated[str, StringConstraints(max_length=64)],
        Annotated[str, StringConstraints(max_length=256)],
    ] = Field(default_factory=dict, max_length=32)


class ToolchainIn(Strict):
    openvino: Annotated[str, StringConstraints(pattern=r"^\d{4}\.\d+\.\d+$")]
    runtime_requirements: Annotated[Text, StringConstraints(max_length=512)] | None = None


class StageIn(Strict):
    stage: str = Field(max_length=32, description="The stage's kind: 'convert', ...")
    args: dict[str, Any] = Field(
        default_factory=dict, description="Its arguments (canonical form, docs §15)."
    )


class SubmissionRequest(Strict):
    model: dict[str, Sha256] = Field(
        max_length=MAX_FOLDER_FILES,
        description="sha256 of each model file by role: {xml, bin}, {onnx}, {tflite}, "
        "{pdmodel, pdiparams}, {pt2}, ...; or, for a folder source (SavedModel, Hugging Face), "
        "by relative path.",
    )
    recipe: list[StageIn] | None = Field(
        None,
        max_length=MAX_STAGES,
        description="The stages run before the compile (docs §15), e.g. "
        '[{"stage": "convert", "args": {"format": "tflite"}}]; null: none (IR, ONNX).',
    )
    model_name: FileName
    specs: list[SpecIn] = Field(min_length=1, description="One job per spec (a matrix).")
    toolchain: ToolchainIn = Field(description="The toolchain the edge will import with.")
    reference_inputs: Sha256 | None = Field(
        None,
        description="sha256 of reference inputs (.npz) uploaded like a model file "
        "(PUT /v1/models/{sha256}); new jobs compute their reference outputs from them.",
    )
    rebuild: bool = Field(
        False,
        description="Replace the specs' quarantined blobs with new compiles (409 when "
        "a spec's blob is not quarantined).",
    )
    max_drift: str | None = Field(
        None,
        max_length=200,
        description="With a compress or quantize stage: fail new jobs whose compressed model "
        "drifts past this bound ('0.05', 'max-abs=0.05,cosine=0.999,top1=0.98'; docs §15).",
    )


class JobOut(BaseModel):
    id: int
    model_name: str | None = Field(None, description="The model's file name (display only).")
    cache_key: str
    target: str
    toolchain: dict[str, Any] = Field(description="The toolchain it compiles for (its key part).")
    state: str
    queue: str
    worker: str | None
    submitter: str | None
    submission_id: str | None
    cancelled_by: str | None = Field(None, description="Who cancelled it (a token's name).")
    spec: dict[str, Any]
    error: str | None
    attempts: int
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    compile_seconds: float | None
    export_seconds: float | None
    peak_rss_bytes: int | None
    note: str | None = Field(
        None, description="Why a queued job may wait (the broker did not take it; no live worker)."
    )
    phases: list[dict[str, Any]] | None = Field(
        None,
        description="Where its last attempt's time went, in order: the wait in the queue, then "
        "fetch, convert, compress, compile, reference, upload, record ({phase, seconds}); only "
        "for one job, not in lists.",
    )


class SubmissionResult(BaseModel):
    cache_key: str
    target: str
    outcome: Outcome
    job: JobOut | None
    reason: str | None = None
    """Why an `unavailable` spec (an embedded farm that cannot compile it) has no job."""


class SubmissionResponse(BaseModel):
    submission_id: str
    results: list[SubmissionResult]


class BlobOut(BaseModel):
    cache_key: str
    target: str
    model: dict[str, str]
    """sha256 of each model file by role: an edge checks a weightless blob's .bin with it."""
    model_name: str | None = None
    """The model's file name at first submission (display only, not identity)."""
    openvino: str
    toolchain: dict[str, Any]
    size_bytes: int
    sha256: str
    payload_offset: int
    weightless: bool
    signature: str | None
    """v1: Ed25519 signature (base64) of (cache_key, sha256), for edges older than manifests."""
    signing_key_id: str | None
    """Which key signed both signatures: sha256 of its raw public key, 16 hex characters."""
    manifest_signature: str | None
    """Ed25519 signature (base64) of the manifest of every field above an edge acts on
    (farm/core/signing.py `Manifest`); edges check it before acting on any of them."""
    spec: dict[str, Any]
    compile_seconds: float | None
    export_seconds: float | None
    created_at: datetime
    reference_sha256: str | None = None
    """sha256 of the reference outputs file (GET .../reference); null: none, see the note."""
    reference_size_bytes: int | None = None
    reference_signature: str | None = None
    """Ed25519 signature by signing_key_id binding the reference file to this blob."""
    part_bytes: int | None = None
    """The size of the parts `part_sha256s` lists (the last one shorter); null: none."""
    part_sha256s: list[str] | None = None
    """sha256 of each part: an edge that verified `parts_signature` checks each as it arrives."""
    parts_signature: str | None = None
    """Ed25519 signature by signing_key_id binding the part digests to this blob."""
    reference_note: str | None = None
    """Why the blob has no reference outputs."""
    reference_state: str | None = None
    """pending (the reference run follows the blob: a verification waits for it), ready or
    skipped (see the note); null: a blob recorded before reference states."""
    quarantined_at: datetime | None = None
    """Set: a verification failed (or an admin quarantined it); edges refuse it."""
    quarantine_reason: str | None = None
    status: dict[str, Any] | None = None
    """On a resolve: the blob's state (ok or quarantined), signed now by the farm's status key
    with its expiry (`farm.core.status.BlobStatus`); what edges of this version act on."""
    compression: dict[str, Any] | None = None
    """The compress or quantize stage the model was made by (docs §15): kind, stage_key,
    args, metrics (size_before, size_after, ratio, drift, ...), tool_versions; null: none."""


class PullOut(BaseModel):
    id: int
    """The pull report's row id."""


class PullIn(Strict):
    agent_id: Name
    ok: bool
    import_seconds: float | None = Field(None, ge=0, le=86400)
    error: Annotated[Text, StringConstraints(max_length=4000)] | None = None


Figure = Annotated[float, Field(ge=0, allow_inf_nan=False)]


Cosine = Annotated[float, Field(ge=-1, le=1, allow_inf_nan=False)]


class ToleranceIn(Strict):
    atol: Figure
    rtol: Figure
    min_cosine: Cosine


class OutputFigures(Strict):
    """One output's comparison; null figures: missing, of another shape, or not finite."""

    name: Annotated[Text, StringConstraints(max_length=256)]
    max_abs_error: Figure | None = None
    mean_abs_error: Figure | None = None
    cosine: Cosine | None = None
    passed: bool


class VerificationIn(Strict):
    """An edge's run of a blob against its reference outputs (`farm verify`)."""

    blob_sha256: Sha256
    """sha256 of the bytes it ran: a report about a blob since rebuilt is refused (409)."""
    agent_id: Name
    device_name: Annotated[Text, StringConstraints(max_length=256)]
    openvino_version: Annotated[Text, StringConstraints(max_length=64)]
    driver_version: Annotated[Text, StringConstraints(max_length=128)] | None = None
    passed: bool
    max_abs_error: Figure | None = None
    mean_abs_error: Figure | None = None
    min_cosine: Cosine | None = None
    tolerance: ToleranceIn
    outputs: list[OutputFigures] = Field(max_length=4096)
    runs: int = Field(ge=0, le=1_000_000)
    latency_p50_ms: Figure | None = None
    latency_p90_ms: Figure | None = None
    latency_min_ms: Figure | None = None
    import_seconds: Figure | None = None
    peak_rss_bytes: int | None = Field(None, ge=0)
    error: Annotated[Text, StringConstraints(max_length=4000)] | None = None


class QuarantineIn(Strict):
    reason: Annotated[Text, StringConstraints(min_length=1, max_length=1000)]


class WorkerOut(BaseModel):
    name: str
    host: str
    live: bool
    queues: list[str]
    targets: dict[str, Any]
    toolchains: dict[str, Any] | None = Field(
        None, description="Target → the toolchain it compiles with (what its queues serve)."
    )
    converters: dict[str, Any] | None = Field(
        None, description="Converter → its versions: the stages it runs (docs §15)."
    )
    openvino: str
    memory_bytes: int
    heartbeat_at: datetime
    stopped_at: datetime | None
