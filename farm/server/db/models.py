"""The schema. Admins query it with SQL, so every column says what it means (`comment=`).

Invariants live in the database, not only in code: unique cache keys, one active job per cache
key (a partial unique index), sha256 columns that are 64 lower-case hex characters.
Timestamps are UTC, sizes bytes, durations seconds. Changes only through Alembic migrations.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.types import TypeDecorator

from farm.core.sources import FORMATS
from farm.core.vocabulary import ACTIVE_STATES, JOB_STATES

_ACTIVE_SQL = f"state IN ({', '.join(repr(str(s)) for s in ACTIVE_STATES)})"
_FAILED_PULL_SQL = "NOT ok"

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class UTCDateTime(TypeDecorator):
    """Timezone-aware UTC datetimes on every dialect.

    SQLite has no time zones and hands back naive datetimes; mixing those with the aware ones
    the code makes raises TypeError. Values are stored as UTC and read back aware.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect) -> datetime | None:
        if value is not None and value.tzinfo is not None:
            value = value.astimezone(UTC)
        return value

    def process_result_value(self, value: datetime | None, dialect) -> datetime | None:
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        return value


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {dict[str, Any]: JSON, datetime: UTCDateTime()}  # noqa: RUF012


def sha256_checks(column: str) -> tuple[CheckConstraint, CheckConstraint]:
    """`column` holds 64 lower-case hex characters, on PostgreSQL (regex) and SQLite (GLOB)."""
    return (
        CheckConstraint(f"{column} ~ '^[0-9a-f]{{64}}$'", name=f"{column}_sha256").ddl_if(
            dialect="postgresql"
        ),
        CheckConstraint(
            f"length({column}) = 64 AND {column} NOT GLOB '*[^0-9a-f]*'",
            name=f"{column}_sha256",
        ).ddl_if(dialect="sqlite"),
    )


class Model(Base):
    __tablename__ = "models"
    __table_args__ = (
        *sha256_checks("digest"),
        CheckConstraint(
            "format IN ({})".format(", ".join(f"'{f}'" for f in FORMATS)), name="format"
        ),
        Index("ix_models_name", "name"),  # 0012: `farm jobs --model NAME`
        {
            "comment": "A model submitted to the farm, identified by the digests of its files. "
            "Inserted on first submission; never updated or deleted."
        },
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, comment="Row id.")
    digest: Mapped[str] = mapped_column(
        String(64),
        unique=True,
        comment="sha256 of the canonical JSON of `files`: the model's identity. Never changes.",
    )
    format: Mapped[str] = mapped_column(
        String(16),
        comment="'ir' (.xml + .bin), 'onnx', or a source format converted by a stage: 'tflite', "
        "'paddle', 'savedmodel', 'pb', 'pt2', 'torchscript', 'huggingface' (docs §15).",
    )
    files: Mapped[dict[str, Any]] = mapped_column(
        comment="sha256 of each file by role ({xml, bin}, {onnx}, {tflite}, ...) or, for a "
        "folder, by relative path. Stored at models/<sha256>."
    )
    size_bytes: Mapped[int] = mapped_column(BigInteger, comment="Total size of the files, bytes.")
    name: Mapped[str] = mapped_column(
        Text, comment="File name at first submission; for display only, not identity."
    )
    created_at: Mapped[datetime] = mapped_column(comment="First submission, UTC.")


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        *sha256_checks("reference_inputs"),
        *sha256_checks("cache_key"),
        *sha256_checks("stage_key"),
        CheckConstraint(
            "state IN ({})".format(", ".join(f"'{s}'" for s in JOB_STATES)), name="state"
        ),
        Index(
            "uq_jobs_active_cache_key",
            "cache_key",
            unique=True,
            sqlite_where=text(_ACTIVE_SQL),
            postgresql_where=text(_ACTIVE_SQL),
        ),
        Index("ix_jobs_state_target", "state", "target"),
        # Migration 0012 (the catalog at scale; plans in docs/schema.md, Indexes): each list
        # filter walks its own index newest first, and worker_status counts by index.
        Index("ix_jobs_cache_key_id", "cache_key", "id"),
        Index("ix_jobs_model_id_id", "model_id", "id"),
        Index("ix_jobs_submitter_id", "submitter", "id"),
        Index("ix_jobs_worker_state", "worker", "state"),
        {
            "comment": "A request to produce the blob of one cache key, and what became of it. "
            "Inserted on submit; state, lease and timing columns change while it runs; "
            "never deleted."
        },
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, comment="The job number users see.")
    cache_key: Mapped[str] = mapped_column(
        String(64), comment="The blob this job produces (caching hash v1)."
    )
    model_id: Mapped[int] = mapped_column(ForeignKey("models.id"), comment="The model compiled.")
    target: Mapped[str] = mapped_column(String(16), comment="'NPU.4000', 'CPU', ...")
    queue: Mapped[str] = mapped_column(
        String(64),
        default="embedded",
        server_default="embedded",
        comment="Celery queue it is sent to ('compile.npu.4000', 'compile.cpu.large'), "
        "or 'embedded' when compiled in the submitting process.",
    )
    spec: Mapped[dict[str, Any]] = mapped_column(
        comment="Canonical compile spec (docs/architecture.md §5)."
    )
    toolchain: Mapped[dict[str, Any]] = mapped_column(
        comment="Toolchain part of the cache key the blob must be produced with."
    )
    state: Mapped[str] = mapped_column(
        String(16),
        comment="queued → running → succeeded | failed | cancelled. Changes as the job runs.",
    )
    submitter: Mapped[str | None] = mapped_column(Text, comment="Who submitted (token name).")
    submission_id: Mapped[str | None] = mapped_column(
        Text, comment="Groups the jobs of one matrix submission."
    )
    attempts: Mapped[int] = mapped_column(
        Integer, default=0, server_default="0", comment="Times a worker claimed this job."
    )
    max_attempts: Mapped[int] = mapped_column(
        Integer, default=3, server_default="3", comment="Claims allowed before it fails."
    )
    error: Mapped[str | None] = mapped_column(Text, comment="Why it failed: one line.")
    log: Mapped[str | None] = mapped_column(
        Text, comment="Properties used, toolchain, timings, and the compiler's output."
    )
    worker: Mapped[str | None] = mapped_column(Text, comment="Host that ran (or runs) it.")
    lease_expires_at: Mapped[datetime | None] = mapped_column(
        comment="A running job whose lease is past may be taken back. Renewed while compiling."
    )
    cancel_requested: Mapped[bool] = mapped_column(
        Boolean, default=False, server_default=text("false"), comment="Set by `farm cancel`."
    )
    cancelled_by: Mapped[str | None] = mapped_column(
        Text,
        comment="Who cancelled it: a token's name, or user@host of an operator; null: "
        "not cancelled.",
    )
    created_at: Mapped[datetime] = mapped_column(comment="Submitted, UTC.")
    sent_at: Mapped[datetime | None] = mapped_column(
        comment="Last time its message was sent to the queue (the reconciler re-sends), UTC."
    )
    started_at: Mapped[datetime | None] = mapped_column(comment="Last claimed by a worker, UTC.")
    finished_at: Mapped[datetime | None] = mapped_column(comment="Reached a final state, UTC.")
    compile_seconds: Mapped[float | None] = mapped_column(
        Float, comment="OpenVINO compile_model time, seconds (blob write excluded)."
    )
    export_seconds: Mapped[float | None] = mapped_column(
        Float, comment="Time OpenVINO spent writing the blob, seconds."
    )
    peak_rss_bytes: Mapped[int | None] = mapped_column(
        BigInteger, comment="Peak resident memory of the compiling process, bytes."
    )
    reference_inputs: Mapped[str | None] = mapped_column(
        String(64),
        comment="sha256 of the submitter's reference inputs (.npz, stored with model files); "
        "null: inputs seeded from the cache key.",
    )
    recipe: Mapped[list[Any] | None] = mapped_column(
        JSON,
        comment="The stages run before the compile, in order ([{stage, args}], docs §15); "
        "null: none (the model is compiled as it is).",
    )
    stage_key: Mapped[str | None] = mapped_column(
        String(64),
        comment="Key of the recipe's last stage: its stage_outputs row holds the model compiled "
        "(join stage_outputs.stage_key); null: no recipe.",
    )


class Blob(Base):
    __tablename__ = "blobs"
    __table_args__ = (
        *sha256_checks("cache_key"),
        *sha256_checks("sha256"),
        *sha256_checks("reference_sha256"),
        CheckConstraint(
            "(reference_sha256 IS NULL) = (reference_size_bytes IS NULL)",
            name="reference_recorded_whole",
        ),
        CheckConstraint(
            "(quarantined_at IS NULL) = (quarantine_reason IS NULL)", name="quarantine_has_reason"
        ),
        # Migration 0012: pages of the blob list, newest first, all or per target.
        Index("ix_blobs_created_at_id", "created_at", "id"),
        Index("ix_blobs_target_created_at_id", "target", "created_at", "id"),
        {
            "comment": "A compiled blob in storage. Inserted once, after its upload is verified; "
            "only its signature columns are updated, by `farm keys resign`, and its quarantine, "
            "by a failed verification or an admin; deleted by `farm gc` or a rebuild (recorded "
            "in blob_deletions)."
        },
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, comment="Row id.")
    cache_key: Mapped[str] = mapped_column(
        String(64), unique=True, comment="Caching hash v1: the blob's identity."
    )
    job_id: Mapped[int | None] = mapped_column(
        ForeignKey("jobs.id"), comment="The job that produced it."
    )
    model_id: Mapped[int] = mapped_column(ForeignKey("models.id"), comment="Its model.")
    target: Mapped[str] = mapped_column(String(16), comment="'NPU.4000', 'CPU', ...")
    spec: Mapped[dict[str, Any]] = mapped_column(comment="Canonical compile spec.")
    toolchain: Mapped[dict[str, Any]] = mapped_column(
        comment="What produced it: openvino, openvino_build, npu_compiler, runtime_requirements."
    )
    openvino_version: Mapped[str] = mapped_column(
        String(32), comment="OpenVINO release (X.Y.Z) that produced it (copy of toolchain)."
    )
    storage_key: Mapped[str] = mapped_column(Text, comment="Object key: blobs/<cache_key>.blob.")
    size_bytes: Mapped[int] = mapped_column(BigInteger, comment="Size of the stored file, bytes.")
    sha256: Mapped[str] = mapped_column(
        String(64), comment="sha256 of the whole stored file, computed while it was written."
    )
    payload_offset: Mapped[int] = mapped_column(
        Integer, comment="Bytes of OpenVINO cache header before the export payload."
    )
    weightless: Mapped[bool] = mapped_column(
        Boolean, comment="True: no weights inside; the edge supplies the model's .bin."
    )
    compile_seconds: Mapped[float | None] = mapped_column(Float, comment="Compile time, s.")
    export_seconds: Mapped[float | None] = mapped_column(Float, comment="Blob write time, s.")
    created_at: Mapped[datetime] = mapped_column(comment="Recorded, UTC.")
    signature: Mapped[str | None] = mapped_column(
        Text,
        comment="Ed25519 signature (base64) of (cache_key, sha256) by signing_key_id (v1, for "
        "edges older than manifest signatures); null: unsigned.",
    )
    signing_key_id: Mapped[str | None] = mapped_column(
        String(16),
        comment="Which key signed it: sha256 of the raw public key, 16 hex characters.",
    )
    manifest_signature: Mapped[str | None] = mapped_column(
        Text,
        comment="Ed25519 signature (base64) by signing_key_id of the blob's manifest: cache_key, "
        "sha256, size_bytes, payload_offset, target, toolchain, weightless and the model's file "
        "digests (farm/core/signing.py); edges check it. Null: unsigned, or signed before "
        "manifests (run `farm keys resign`).",
    )
    reference_sha256: Mapped[str | None] = mapped_column(
        String(64),
        comment="sha256 of the reference file (inputs and CPU f32 outputs, .npz); null: none "
        "(see reference_note).",
    )
    reference_size_bytes: Mapped[int | None] = mapped_column(BigInteger, comment="Its size, bytes.")
    reference_signature: Mapped[str | None] = mapped_column(
        Text,
        comment="Ed25519 signature (base64) by signing_key_id binding the reference file to the "
        "blob (farm/core/signing.py reference_message).",
    )
    reference_note: Mapped[str | None] = mapped_column(
        Text,
        comment="Why the blob has no reference outputs (too big for the worker's memory budget, "
        "dynamic shapes, ...).",
    )
    quarantined_at: Mapped[datetime | None] = mapped_column(
        comment="When it was quarantined (edges refuse it); null: not quarantined."
    )
    quarantine_reason: Mapped[str | None] = mapped_column(
        Text, comment="Why: the failed verification (its id, device, errors) or the admin."
    )

    model: Mapped[Model] = relationship(lazy="joined")
    """Its model (the digests of its files: an edge checks a weightless blob's .bin)."""


class Pull(Base):
    __tablename__ = "pulls"
    __table_args__ = (
        *sha256_checks("cache_key"),
        # Migration 0012: a blob's pull count, last pull and failures from the index alone
        # (gc, blob_usage, the dashboard), and the foreign-key check when gc deletes a blob.
        Index("ix_pulls_blob_id_created_at_ok", "blob_id", "created_at", "ok"),
        # The README's "failed imports", newest first, without reading every pull.
        Index(
            "ix_pulls_failed_created_at",
            "created_at",
            sqlite_where=text(_FAILED_PULL_SQL),
            postgresql_where=text(_FAILED_PULL_SQL),
        ),
        {
            "comment": "One edge download and import of a blob, as the edge reported it. "
            "Inserted per report; never updated; deleted with its blob by `farm gc`."
        },
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, comment="Row id.")
    blob_id: Mapped[int] = mapped_column(ForeignKey("blobs.id"), comment="The blob pulled.")
    cache_key: Mapped[str] = mapped_column(String(64), comment="Its cache key (copy, for SQL).")
    agent_id: Mapped[str] = mapped_column(Text, comment="The edge agent that pulled it.")
    import_seconds: Mapped[float | None] = mapped_column(
        Float, comment="import_model time on the edge, seconds."
    )
    ok: Mapped[bool] = mapped_column(Boolean, comment="Imported successfully.")
    error: Mapped[str | None] = mapped_column(Text, comment="Why the import failed.")
    created_at: Mapped[datetime] = mapped_column(comment="Reported, UTC.")


class Verification(Base):
    __tablename__ = "verifications"
    __table_args__ = (
        *sha256_checks("cache_key"),
        *sha256_checks("blob_sha256"),
        CheckConstraint("runs >= 0", name="runs_counted"),
        CheckConstraint("error IS NULL OR NOT passed", name="error_fails"),
        Index("ix_verifications_blob_id", "blob_id"),
        Index("ix_verifications_cache_key_id", "cache_key", "id"),
        Index("ix_verifications_target_device", "target", "device_name"),
        {
            "comment": "One edge's run of a blob against its reference outputs. Inserted per "
            "report; never updated; blob_id set null when the blob is deleted."
        },
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, comment="Row id.")
    blob_id: Mapped[int | None] = mapped_column(
        ForeignKey("blobs.id", ondelete="SET NULL"),
        comment="The blob verified; null once it was deleted (history stays).",
    )
    cache_key: Mapped[str] = mapped_column(String(64), comment="Its cache key.")
    blob_sha256: Mapped[str] = mapped_column(String(64), comment="sha256 of the bytes verified.")
    target: Mapped[str] = mapped_column(String(16), comment="The blob's target.")
    agent_id: Mapped[str] = mapped_column(Text, comment="The edge agent that ran it.")
    device_name: Mapped[str] = mapped_column(
        Text, comment="The device's full name (OpenVINO FULL_DEVICE_NAME)."
    )
    openvino_version: Mapped[str] = mapped_column(String(64), comment="The edge's OpenVINO.")
    driver_version: Mapped[str | None] = mapped_column(
        Text, comment="The NPU driver version (NPU_DRIVER_VERSION); null on CPU."
    )
    passed: Mapped[bool] = mapped_column(Boolean, comment="Every output within tolerance.")
    max_abs_error: Mapped[float | None] = mapped_column(
        Float, comment="Worst absolute error, any output."
    )
    mean_abs_error: Mapped[float | None] = mapped_column(
        Float, comment="Worst mean absolute error."
    )
    min_cosine: Mapped[float | None] = mapped_column(Float, comment="Lowest cosine similarity.")
    tolerance: Mapped[dict[str, Any]] = mapped_column(comment="{atol, rtol, min_cosine} applied.")
    outputs: Mapped[list[Any]] = mapped_column(JSON, comment="Per output: name and figures.")
    runs: Mapped[int] = mapped_column(Integer, comment="Timed inferences.")
    latency_p50_ms: Mapped[float | None] = mapped_column(Float, comment="Median latency, ms.")
    latency_p90_ms: Mapped[float | None] = mapped_column(Float, comment="p90 latency, ms.")
    latency_min_ms: Mapped[float | None] = mapped_column(Float, comment="Best latency, ms.")
    import_seconds: Mapped[float | None] = mapped_column(Float, comment="import_model time, s.")
    peak_rss_bytes: Mapped[int | None] = mapped_column(
        BigInteger,
        comment="The edge process's peak resident memory during the verification.",
    )
    error: Mapped[str | None] = mapped_column(
        Text, comment="Why it could not run (import or inference failed); null when it ran."
    )
    created_at: Mapped[datetime] = mapped_column(comment="Reported.")


class Worker(Base):
    __tablename__ = "workers"
    __table_args__ = (
        {
            "comment": "Compile workers: what each serves, and when it was last seen. "
            "Upserted at worker start; heartbeat_at updated while alive; stopped_at set on a "
            "clean shutdown; never deleted."
        },
    )

    name: Mapped[str] = mapped_column(
        String(255), primary_key=True, comment="Celery node name (worker@host)."
    )
    host: Mapped[str] = mapped_column(Text, comment="Host name.")
    pid: Mapped[int] = mapped_column(Integer, comment="Main process id on the host.")
    targets: Mapped[dict[str, Any]] = mapped_column(
        comment="Target → null if it compiles here, else why not (the start-up probe)."
    )
    queues: Mapped[list[str]] = mapped_column(JSON, comment="Queues it consumes.")
    converters: Mapped[dict[str, Any] | None] = mapped_column(
        JSON,
        comment="Converter → its versions ({torch: {torch: '2.13.0'}}), those the worker can "
        "run stages with (docs §15); null: none, or registered before 0015.",
    )
    toolchains: Mapped[dict[str, Any] | None] = mapped_column(
        JSON,
        comment="Target → the toolchain key part it compiles with (OpenVINO release; CPU: "
        "also the runtime requirements); its queues follow from it.",
    )
    openvino_version: Mapped[str] = mapped_column(String(64), comment="OpenVINO full build.")
    memory_bytes: Mapped[int] = mapped_column(BigInteger, comment="Memory it offers, bytes.")
    started_at: Mapped[datetime] = mapped_column(comment="Started, UTC.")
    heartbeat_at: Mapped[datetime] = mapped_column(
        comment="Last heartbeat, UTC. Updated every FARM_WORKER_HEARTBEAT_SECONDS while alive."
    )
    stopped_at: Mapped[datetime | None] = mapped_column(comment="Clean shutdown, UTC.")


class ApiToken(Base):
    __tablename__ = "api_tokens"
    __table_args__ = (
        *sha256_checks("token_sha256"),
        CheckConstraint("role IN ('pull', 'submit', 'admin')", name="role"),
        {
            "comment": "Bearer tokens of the HTTP API. Only their sha256 is stored. Inserted by "
            "`farm token create`; last_used_at updated at most once a minute; revoked_at set "
            "once by `farm token revoke`."
        },
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, comment="Row id.")
    name: Mapped[str] = mapped_column(
        String(128), unique=True, comment="Who holds it ('edge-042', 'ci'); recorded as submitter."
    )
    role: Mapped[str] = mapped_column(
        String(16), comment="'pull' (resolve, download, report), 'submit' (+ jobs), 'admin' (all)."
    )
    token_sha256: Mapped[str] = mapped_column(
        String(64), unique=True, comment="sha256 of the token; the token itself is never stored."
    )
    created_at: Mapped[datetime] = mapped_column(comment="Created, UTC.")
    revoked_at: Mapped[datetime | None] = mapped_column(comment="Revoked, UTC; null while valid.")
    last_used_at: Mapped[datetime | None] = mapped_column(comment="Last authenticated request.")
    expires_at: Mapped[datetime | None] = mapped_column(
        comment="Expires, UTC: from then on requests get 401 token_expired; null: never."
    )


DELETION_STATES = ("pending", "deleted", "kept")


class BlobDeletion(Base):
    __tablename__ = "blob_deletions"
    __table_args__ = (
        *sha256_checks("cache_key"),
        *sha256_checks("sha256"),
        CheckConstraint(
            "state IN ({})".format(", ".join(f"'{s}'" for s in DELETION_STATES)), name="state"
        ),
        {
            "comment": "What `farm gc` removed: one row per blob row it deleted, kept as a record. "
            "Inserted in the transaction that deletes the blob row; state changes once, when "
            "its object is deleted from storage (or kept because the cache key is in use again)."
        },
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, comment="Row id.")
    cache_key: Mapped[str] = mapped_column(String(64), comment="Cache key of the deleted blob.")
    storage_key: Mapped[str] = mapped_column(Text, comment="Its object key in storage.")
    target: Mapped[str] = mapped_column(String(16), comment="Its target.")
    size_bytes: Mapped[int] = mapped_column(BigInteger, comment="Its size, bytes.")
    sha256: Mapped[str] = mapped_column(String(64), comment="sha256 of the stored file.")
    blob_created_at: Mapped[datetime] = mapped_column(comment="When the blob was recorded, UTC.")
    pulls: Mapped[int] = mapped_column(
        Integer, comment="Pull reports deleted with it (keeps pull counts monotonic)."
    )
    failed_pulls: Mapped[int] = mapped_column(
        Integer, comment="Of those, reports of a failed import."
    )
    last_pulled_at: Mapped[datetime | None] = mapped_column(
        comment="Its last pull report, UTC; null if never pulled."
    )
    reason: Mapped[str] = mapped_column(Text, comment="Why: 'unpulled for 30 days'.")
    deleted_at: Mapped[datetime] = mapped_column(comment="Blob row deleted, UTC.")
    state: Mapped[str] = mapped_column(
        String(16),
        comment="'pending': the object is still in storage and the next `farm gc` deletes it; "
        "'deleted': gone from storage; 'kept': the cache key was in use again, object kept.",
    )
    object_deleted_at: Mapped[datetime | None] = mapped_column(
        comment="When the object was deleted from storage (or kept), UTC; null while pending."
    )
    reference_storage_key: Mapped[str | None] = mapped_column(
        Text, comment="Object key of its reference outputs, deleted with it; null: none."
    )


STAGE_STATES = ("running", "done", "failed")


class StageOutput(Base):
    __tablename__ = "stage_outputs"
    __table_args__ = (
        *sha256_checks("stage_key"),
        *sha256_checks("input_stage_key"),
        CheckConstraint(
            "state IN ({})".format(", ".join(f"'{s}'" for s in STAGE_STATES)), name="state"
        ),
        CheckConstraint("(input_model_id IS NULL) <> (input_stage_key IS NULL)", name="one_input"),
        CheckConstraint("state <> 'done' OR output_model_id IS NOT NULL", name="done_output"),
        {
            "comment": "One stage of a recipe (convert, compress, ...) applied to a source or to "
            "the output of the stage before, content-addressed by stage_key (docs §15). "
            "Inserted 'running' by the job that claims it (single flight), then 'done' with its "
            "output model, or 'failed' with the reason; a failed row is taken over by the next "
            "job that needs it. A done row is never recomputed."
        },
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, comment="Row id.")
    stage_key: Mapped[str] = mapped_column(
        String(64), unique=True, comment="sha256 of input, kind and canonical args (§15)."
    )
    kind: Mapped[str] = mapped_column(String(32), comment="'convert', 'compress', ...")
    input_model_id: Mapped[int | None] = mapped_column(
        ForeignKey("models.id"), comment="The source model it reads; null: reads a stage."
    )
    input_stage_key: Mapped[str | None] = mapped_column(
        String(64), comment="The stage whose output it reads; null: reads a source model."
    )
    args: Mapped[dict[str, Any]] = mapped_column(comment="Canonical arguments of the stage.")
    tool_versions: Mapped[dict[str, Any] | None] = mapped_column(
        comment="Versions of the tools that ran it ({openvino, torch, optimum-intel, ...}); "
        "recorded, not keyed."
    )
    output_files: Mapped[dict[str, Any] | None] = mapped_column(
        comment="sha256 of each output file by role ({xml, bin}); null until done."
    )
    output_model_id: Mapped[int | None] = mapped_column(
        ForeignKey("models.id"), comment="The output IR, an ordinary models row; null until done."
    )
    metrics: Mapped[dict[str, Any] | None] = mapped_column(
        comment="What the stage measured (sizes, drift, seconds, peak RSS)."
    )
    state: Mapped[str] = mapped_column(String(16), comment="'running', 'done' or 'failed'.")
    error: Mapped[str | None] = mapped_column(Text, comment="Why it failed; null otherwise.")
    job_id: Mapped[int | None] = mapped_column(
        ForeignKey("jobs.id"), comment="The job that ran it (last claimed it)."
    )
    lease_expires_at: Mapped[datetime | None] = mapped_column(
        comment="While running: past this, another job may take it over (its job died)."
    )
    created_at: Mapped[datetime] = mapped_column(comment="First claimed, UTC.")
    finished_at: Mapped[datetime | None] = mapped_column(comment="Done or failed, UTC.")
    seconds: Mapped[float | None] = mapped_column(Float, comment="Time the stage ran, seconds.")
