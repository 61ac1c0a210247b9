"""The schema. Admins query it with SQL, so every column says what it means (`comment=`).

Invariants live in the database, not only in code: unique cache keys, one active job per cache
key (a partial unique index), sha256 columns that are 64 lower-case hex characters.
Timestamps are UTC, sizes bytes, durations seconds. Changes only through Alembic migrations.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
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

from farm.core.sources import FORMATS
from farm.core.vocabulary import ACTIVE_STATES, JOB_STATES, REFERENCE_STATES
from farm.server.db.types import UTCDateTime

_ACTIVE_SQL = f"state IN ({', '.join(repr(str(s)) for s in ACTIVE_STATES)})"
_FAILED_PULL_SQL = "NOT ok"

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


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
    max_drift: Mapped[str | None] = mapped_column(
        Text,
        comment="The submitter's --max-drift bound on the compressed model's drift (max-abs=..,"
        "cosine=..,top1=..); null: none. Checked against the stage's recorded drift, not keyed.",
    )


_PENDING_REFERENCE_SQL = "reference_state = 'pending'"
BLOBS_COMMENT = (
    "A compiled blob in storage. Inserted once, after its upload is verified, with its "
    "reference outputs pending; then its reference columns are set once, when the reference "
    "run ends (ready or skipped), its part digests once, after it is recorded, its signature "
    "columns by `farm keys resign`, and its quarantine by a failed verification or an admin; "
    "deleted by `farm gc` or a rebuild (recorded in blob_deletions)."
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
            "reference_state IS NULL OR reference_state IN ({})".format(
                ", ".join(f"'{s}'" for s in REFERENCE_STATES)
            ),
            name="reference_state",
        ),
        CheckConstraint(
            "reference_state <> 'ready' OR reference_sha256 IS NOT NULL",
            name="reference_ready_recorded",
        ),
        CheckConstraint(
            "(quarantined_at IS NULL) = (quarantine_reason IS NULL)", name="quarantine_has_reason"
        ),
        CheckConstraint(
            "(part_bytes IS NULL) = (part_sha256s IS NULL) "
            "AND (part_bytes IS NULL) = (parts_signature IS NULL)",
            name="parts_recorded_whole",
        ),
        # Migration 0012: pages of the blob list, newest first, all or per target.
        Index("ix_blobs_created_at_id", "created_at", "id"),
        Index("ix_blobs_target_created_at_id", "target", "created_at", "id"),
        # Migration 0021: the reconciler's look for reference runs that were lost.
        Index(
            "ix_blobs_reference_pending",
            "reference_lease_expires_at",
            sqlite_where=text(_PENDING_REFERENCE_SQL),
            postgresql_where=text(_PENDING_REFERENCE_SQL),
        ),
        {"comment": BLOBS_COMMENT},
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
    reference_state: Mapped[str | None] = mapped_column(
        String(16),
        comment="'pending' (recorded with the blob; computed after it, off the job's critical "
        "path), 'ready' (reference_sha256 set) or 'skipped' (reference_note says why); null: "
        "recorded before migration 0021 (read the other reference columns).",
    )
    reference_attempts: Mapped[int] = mapped_column(
        Integer,
        default=0,
        server_default="0",
        comment="Runs of the reference claimed so far (each against FARM_MAX_ATTEMPTS); the "
        "latest one's number is its claim.",
    )
    reference_lease_expires_at: Mapped[datetime | None] = mapped_column(
        comment="While a reference run holds it: renewed by its process; past it, the "
        "reconciler sends it again (or records it skipped past its attempts). Null: unclaimed."
    )
    part_bytes: Mapped[int | None] = mapped_column(
        BigInteger,
        comment="The size of the parts part_sha256s lists (the last one shorter); null: none "
        "hashed (a blob in a local store, or recorded before parts).",
    )
    part_sha256s: Mapped[list[str] | None] = mapped_column(
        JSON(none_as_null=True),
        comment="sha256 of each part, in order: an edge checks each as it downloads it "
        "(farm/server/blobs/parts.py).",
    )
    parts_signature: Mapped[str | None] = mapped_column(
        Text,
        comment="Ed25519 signature (base64) by signing_key_id binding part_bytes and "
        "part_sha256s to the blob (farm/core/signing.py parts_message).",
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


class JobPhase(Base):
    __tablename__ = "job_phases"
    __table_args__ = (
        CheckConstraint("seconds >= 0", name="seconds_counted"),
        Index("ix_job_phases_job_id_attempt", "job_id", "attempt"),
        {
            "comment": "Where a job's time went: one row per phase of an attempt (fetch, "
            "its stages, drift, compile, reference, upload, record), timed by the worker. "
            "Inserted when the attempt ends; never updated or deleted."
        },
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, comment="Row id.")
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id"), comment="The job.")
    attempt: Mapped[int] = mapped_column(Integer, comment="Its attempt (jobs.attempts then).")
    phase: Mapped[str] = mapped_column(
        String(16),
        comment="'fetch'; the stages its recipe ran, named after them ('convert', 'compress', "
        "'convert+compress', ...; 'convert+compile' when one child converted and compiled); "
        "'drift', 'compile', 'reference', 'upload' or 'record'.",
    )
    started_at: Mapped[datetime] = mapped_column(comment="When the phase began, UTC.")
    seconds: Mapped[float] = mapped_column(Float, comment="How long it took, s.")


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
        CheckConstraint("role IN ('pull', 'submit', 'release', 'admin')", name="role"),
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
        String(16),
        comment="'pull' (resolve, download, report), 'submit' (+ jobs), 'release' (+ move "
        "channels), 'admin' (all).",
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
    quarantine_reason: Mapped[str | None] = mapped_column(
        Text,
        comment="Its quarantine reason when it was retired while quarantined (a rebuild "
        "into the same bytes starts quarantined with it); null: it was not quarantined.",
    )


class ModelUpload(Base):
    __tablename__ = "model_uploads"
    __table_args__ = (
        *sha256_checks("sha256"),
        Index("ix_model_uploads_submitter_created_at", "submitter", "created_at"),
        {
            "comment": "Who stored which model file through the API, for the per-submitter "
            "storage quota (FARM_MAX_STORED_BYTES_PER_SUBMITTER). Inserted per stored upload; "
            "never updated; counted for FARM_MODEL_GRACE_SECONDS (after that a file no job "
            "names is collected, and one a job names counts through its model)."
        },
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, comment="Row id.")
    sha256: Mapped[str] = mapped_column(String(64), comment="The file's sha256 (its name).")
    submitter: Mapped[str] = mapped_column(Text, comment="The token that uploaded it.")
    size_bytes: Mapped[int] = mapped_column(BigInteger, comment="Its size, bytes.")
    created_at: Mapped[datetime] = mapped_column(comment="Stored, UTC.")


class DashboardSession(Base):
    __tablename__ = "dashboard_sessions"
    __table_args__ = (
        *sha256_checks("session_sha256"),
        {
            "comment": "Dashboard logins: the browser's cookie holds a random session id, "
            "never the API token. Inserted at login; deleted at logout and once expired."
        },
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, comment="Row id.")
    session_sha256: Mapped[str] = mapped_column(
        String(64), unique=True, comment="sha256 of the session id; the id itself is not stored."
    )
    token_id: Mapped[int] = mapped_column(
        ForeignKey("api_tokens.id", ondelete="CASCADE"),
        comment="The token that logged in; checked (revoked, expired) on every request.",
    )
    created_at: Mapped[datetime] = mapped_column(comment="Logged in, UTC.")
    expires_at: Mapped[datetime] = mapped_column(
        comment="Refused from then on, UTC (FARM_DASHBOARD_SESSION_SECONDS, or the token's "
        "expiry if sooner)."
    )


class Channel(Base):
    __tablename__ = "channels"
    __table_args__ = (
        CheckConstraint("percent BETWEEN 0 AND 100", name="percent"),
        {
            "comment": "A release channel: what a fleet runs (docs/architecture.md §16). Inserted "
            "by `farm channel create`; its rollout columns and signed document change with "
            "each move (set, promote, rollback, recorded in channel_moves); never deleted."
        },
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, comment="Row id.")
    name: Mapped[str] = mapped_column(String(63), unique=True, comment="The channel's name.")
    created_by: Mapped[str] = mapped_column(Text, comment="Who created it (token or operator).")
    created_at: Mapped[datetime] = mapped_column(comment="Created, UTC.")
    sequence: Mapped[int] = mapped_column(
        Integer,
        comment="Sequence of the current signed document; grows by one with every move. Edges "
        "refuse a document older than one they accepted.",
    )
    stable_revision: Mapped[int | None] = mapped_column(
        Integer, comment="The revision every edge runs (outside a stage); null: none yet."
    )
    candidate_revision: Mapped[int | None] = mapped_column(
        Integer, comment="The revision being rolled out to `percent` % of edges; null: none."
    )
    percent: Mapped[int] = mapped_column(
        Integer, comment="Share of edges (by a hash of their agent id) that run the candidate."
    )
    previous_revisions: Mapped[list[Any]] = mapped_column(
        JSON,
        comment="Earlier stable revisions, oldest first: where `farm channel rollback` returns "
        "to; kept from gc.",
    )
    document: Mapped[dict[str, Any]] = mapped_column(
        comment="The signed channel document edges act on (farm/core/channels.py)."
    )
    signature: Mapped[str | None] = mapped_column(
        Text, comment="Ed25519 signature (base64) of the document; null: unsigned farm."
    )
    signing_key_id: Mapped[str | None] = mapped_column(String(16), comment="Which key signed it.")
    updated_at: Mapped[datetime] = mapped_column(comment="Last move, UTC.")


class ChannelRevision(Base):
    __tablename__ = "channel_revisions"
    __table_args__ = (
        Index("uq_channel_revisions_channel_number", "channel_id", "number", unique=True),
        {
            "comment": "One revision of a channel: the models and specs it runs. Inserted by "
            "`farm channel set`; never updated or deleted."
        },
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, comment="Row id.")
    channel_id: Mapped[int] = mapped_column(ForeignKey("channels.id"), comment="Its channel.")
    number: Mapped[int] = mapped_column(Integer, comment="Revision number, from 1, per channel.")
    entries: Mapped[list[Any]] = mapped_column(
        JSON,
        comment="The models it runs: per entry a name, the model's file digests, the target "
        "and the canonical compile spec.",
    )
    created_by: Mapped[str] = mapped_column(Text, comment="Who made it.")
    created_at: Mapped[datetime] = mapped_column(comment="Made, UTC.")


class ChannelMove(Base):
    __tablename__ = "channel_moves"
    __table_args__ = (
        CheckConstraint("action IN ('create', 'set', 'promote', 'rollback')", name="action"),
        Index("ix_channel_moves_channel_id_id", "channel_id", "id"),
        {
            "comment": "The audit of every move of a channel: who, when, what, and whether a gate "
            "was forced. Inserted with each move; never updated or deleted."
        },
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, comment="Row id.")
    channel_id: Mapped[int] = mapped_column(ForeignKey("channels.id"), comment="Its channel.")
    sequence: Mapped[int] = mapped_column(Integer, comment="Document sequence after the move.")
    action: Mapped[str] = mapped_column(
        String(16), comment="'create', 'set', 'promote' or 'rollback'."
    )
    revision: Mapped[int | None] = mapped_column(
        Integer, comment="The revision made, promoted or returned to."
    )
    percent: Mapped[int | None] = mapped_column(Integer, comment="Promote: the share, percent.")
    stable_revision: Mapped[int | None] = mapped_column(Integer, comment="Stable after the move.")
    candidate_revision: Mapped[int | None] = mapped_column(
        Integer, comment="Candidate after the move."
    )
    forced: Mapped[bool] = mapped_column(
        Boolean, comment="An admin forced it past the verification gates."
    )
    gate_report: Mapped[str | None] = mapped_column(
        Text, comment="What the gates refused (the reasons a forced move overrode)."
    )
    actor: Mapped[str] = mapped_column(Text, comment="Who moved it (token or operator).")
    created_at: Mapped[datetime] = mapped_column(comment="When, UTC.")


class ChannelEdge(Base):
    __tablename__ = "channel_edges"
    __table_args__ = (
        {
            "comment": "What each edge following a channel runs, as it last reported. Upserted "
            "per report (one row per channel and agent); never deleted."
        },
    )

    channel_id: Mapped[int] = mapped_column(
        ForeignKey("channels.id"), primary_key=True, comment="The channel it follows."
    )
    agent_id: Mapped[str] = mapped_column(String(255), primary_key=True, comment="The edge agent.")
    revision: Mapped[int | None] = mapped_column(
        Integer, comment="The revision it runs; null: none yet."
    )
    sequence: Mapped[int | None] = mapped_column(
        Integer, comment="The highest document sequence it accepted."
    )
    openvino: Mapped[str | None] = mapped_column(String(64), comment="Its OpenVINO release.")
    runtime_requirements: Mapped[str | None] = mapped_column(
        Text, comment="Its CPU runtime requirements string (null: no CPU entry)."
    )
    targets: Mapped[list[Any]] = mapped_column(JSON, comment="The targets of its entries.")
    ok: Mapped[bool] = mapped_column(Boolean, comment="Its last switch (or check) succeeded.")
    error: Mapped[str | None] = mapped_column(
        Text, comment="Why its last switch failed (it stays on `revision`); null when ok."
    )
    wanted_revision: Mapped[int | None] = mapped_column(
        Integer, comment="The revision the document chose for it at its last sync."
    )
    reported_at: Mapped[datetime] = mapped_column(comment="Last report, UTC.")


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


class MetricCount(Base):
    """Migration 0022: what `/metrics` and the dashboard's cards count, kept by triggers (never
    written by the application). Sum `n` and `total` per label set."""

    __tablename__ = "metric_counts"
    __table_args__ = (
        {
            "comment": "Counters behind /metrics and the dashboard's cards: per label set, "
            "the sum of its rows is the count. Appended by triggers on jobs, blobs, pulls and "
            "verifications in the writing transaction; folded (one row per label set) by "
            "farm_fold_metric_counts(). Never edited by hand."
        },
    )

    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer(), "sqlite"), primary_key=True, comment="Row id."
    )
    family: Mapped[str] = mapped_column(
        String(32),
        comment="'jobs', 'compile_seconds', 'blobs', 'quarantined', 'pulls' or 'verifications'.",
    )
    label1: Mapped[str] = mapped_column(Text, comment="jobs: state; others: target.")
    label2: Mapped[str] = mapped_column(
        Text,
        comment="jobs: target; compile_seconds: bucket bound ('+Inf' last); pulls: "
        "'true'/'false' (ok); verifications: 'passed'/'failed'; else ''.",
    )
    label3: Mapped[str] = mapped_column(Text, comment="jobs: queue; else ''.")
    n: Mapped[int] = mapped_column(BigInteger, comment="Change of the count.")
    total: Mapped[float] = mapped_column(
        Float, comment="Change of the sum: compile seconds, blob bytes; else 0."
    )


BUNDLE_STATES = ("queued", "running", "done", "failed")
BUNDLE_PIPELINES = ("llm", "vlm", "whisper", "text2image")


class BundleBuild(Base):
    __tablename__ = "bundle_builds"
    __table_args__ = (
        *sha256_checks("bundle_key"),
        CheckConstraint(
            "state IN ({})".format(", ".join(f"'{s}'" for s in BUNDLE_STATES)), name="state"
        ),
        CheckConstraint(
            "pipeline IN ({})".format(", ".join(f"'{s}'" for s in BUNDLE_PIPELINES)),
            name="pipeline",
        ),
        {
            "comment": "A GenAI pipeline bundle asked of the served farm (docs §17), one row per "
            "bundle key. Inserted 'queued' by the first submit of the key (its folder's files "
            "uploaded as model files); 'running' once a part is claimed; 'done' when the last "
            "of its parts (bundle_build_parts) finished and the signed manifest is published at "
            "bundles/<bundle_key>.json; 'failed' with the failed part's reason, or with farm gc's "
            "when gc removed its manifest. A failed row is queued again by the next submit of "
            "the key. Never deleted."
        },
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, comment="Row id.")
    bundle_key: Mapped[str] = mapped_column(
        String(64), unique=True, comment="sha256 of the bundle key document (§17)."
    )
    pipeline: Mapped[str] = mapped_column(
        String(16), comment="'llm', 'vlm', 'whisper' or 'text2image'."
    )
    files: Mapped[dict[str, Any]] = mapped_column(
        comment="The folder: sha256 of each file by relative path. Stored at models/<sha256>."
    )
    convert_task: Mapped[str | None] = mapped_column(
        String(64),
        comment="A Hugging Face folder's optimum task (exported by the part first); null: an "
        "OpenVINO pipeline folder.",
    )
    target: Mapped[str] = mapped_column(String(64), comment="'CPU' or an NPU platform.")
    options: Mapped[dict[str, Any]] = mapped_column(
        comment="Canonical GenAI options of the key (with 'convert' for a Hugging Face folder)."
    )
    toolchain: Mapped[dict[str, Any]] = mapped_column(
        comment="The key's toolchain part: OpenVINO, GenAI and tokenizers releases (CPU: also "
        "the runtime requirements)."
    )
    memory_bytes: Mapped[int] = mapped_column(
        BigInteger, comment="Estimated compile memory of its largest part, bytes."
    )
    state: Mapped[str] = mapped_column(
        String(16), comment="'queued', 'running', 'done' or 'failed'."
    )
    error: Mapped[str | None] = mapped_column(
        Text, comment="Why it failed (the failed part's reason); null otherwise."
    )
    submitter: Mapped[str | None] = mapped_column(
        String(255), comment="Token name of the last submit that queued it."
    )
    created_at: Mapped[datetime] = mapped_column(comment="First submitted, UTC.")
    updated_at: Mapped[datetime] = mapped_column(comment="Last change of state, UTC.")
    finished_at: Mapped[datetime | None] = mapped_column(comment="Done or failed, UTC.")
    pulled_at: Mapped[datetime | None] = mapped_column(
        comment="Last fetch of its signed manifest through the API, UTC (recorded at most once "
        "an hour); what farm gc reads. Null: never fetched."
    )


class BundlePart(Base):
    __tablename__ = "bundle_parts"
    __table_args__ = (
        *sha256_checks("part_key"),
        CheckConstraint(
            "state IN ({})".format(", ".join(f"'{s}'" for s in BUNDLE_STATES)), name="state"
        ),
        CheckConstraint("state <> 'done' OR output_files IS NOT NULL", name="done_output"),
        Index("ix_bundle_parts_state", "state"),
        {
            "comment": "One part of pipeline bundles (the whole pipeline, or one sub-model), "
            "compiled once per part key (docs §17): a part shared by two bundles compiles "
            "once. Inserted 'queued' by the first submit that needs it; 'running' with a worker "
            "and a lease (single flight: a claim is a conditional UPDATE); 'done' with its "
            "output files, or 'failed' with the reason. A running part whose lease expired is "
            "queued again by the reconciler; a failed one by the next submit. Never deleted."
        },
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, comment="Row id.")
    part_key: Mapped[str] = mapped_column(
        String(64), unique=True, comment="sha256 of the part key document (§17)."
    )
    name: Mapped[str] = mapped_column(
        String(64), comment="'pipeline' (the whole pipeline) or a sub-model's name."
    )
    bundle_build_id: Mapped[int] = mapped_column(
        ForeignKey("bundle_builds.id"),
        comment="The build whose folder, target and options it compiles (the first to need it).",
    )
    queue: Mapped[str] = mapped_column(
        String(255), comment="The Celery queue it is sent to (toolchain, .large, .with-genai)."
    )
    memory_bytes: Mapped[int] = mapped_column(
        BigInteger, comment="Estimated compile memory, bytes (what chose its queue)."
    )
    state: Mapped[str] = mapped_column(
        String(16), comment="'queued', 'running', 'done' or 'failed'."
    )
    worker: Mapped[str | None] = mapped_column(
        String(255), comment="The worker that runs it (last claimed it)."
    )
    attempts: Mapped[int] = mapped_column(Integer, comment="Claims so far (each counts).")
    lease_expires_at: Mapped[datetime | None] = mapped_column(
        comment="While running: past this, the reconciler queues it again (its worker died)."
    )
    sent_at: Mapped[datetime | None] = mapped_column(
        comment="Its message last handed to the broker, UTC; null: not sent yet."
    )
    output_files: Mapped[dict[str, Any] | None] = mapped_column(
        comment="What it compiled, by path in the bundle: {sha256, size}; stored at "
        "bundle-files/<sha256>. Null until done."
    )
    metrics: Mapped[dict[str, Any] | None] = mapped_column(
        comment="What the compile measured (seconds; the reference run's output)."
    )
    error: Mapped[str | None] = mapped_column(Text, comment="Why it failed; null otherwise.")
    created_at: Mapped[datetime] = mapped_column(comment="First needed, UTC.")
    started_at: Mapped[datetime | None] = mapped_column(comment="Last claimed, UTC.")
    finished_at: Mapped[datetime | None] = mapped_column(comment="Done or failed, UTC.")
    seconds: Mapped[float | None] = mapped_column(Float, comment="Time the compile ran, s.")


class BundleBuildPart(Base):
    __tablename__ = "bundle_build_parts"
    __table_args__ = (
        Index("ix_bundle_build_parts_part_id", "part_id"),
        {
            "comment": "Which parts make up which bundle (a part may be in several). Inserted "
            "with the build's parts at its first submit; never updated or deleted."
        },
    )

    bundle_build_id: Mapped[int] = mapped_column(
        ForeignKey("bundle_builds.id"), primary_key=True, comment="The bundle."
    )
    part_id: Mapped[int] = mapped_column(
        ForeignKey("bundle_parts.id"), primary_key=True, comment="One of its parts."
    )
