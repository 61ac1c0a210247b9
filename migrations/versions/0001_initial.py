"""Initial schema: models, jobs, blobs, pulls.

Revision ID: 0001
Revises:
Create Date: 2026-11-22 14:12:00.829616
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from farm.migrations.checks import sha256_check

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "models",
        sa.Column("id", sa.Integer(), nullable=False, comment="Row id."),
        sa.Column(
            "digest",
            sa.String(length=64),
            nullable=False,
            comment="sha256 of the canonical JSON of `files`: the model's identity. Never changes.",
        ),
        sa.Column(
            "format", sa.String(length=8), nullable=False, comment="'ir' (.xml + .bin) or 'onnx'."
        ),
        sa.Column(
            "files",
            sa.JSON(),
            nullable=False,
            comment="sha256 of each file by role: {xml, bin} or {onnx}. Stored at models/<sha256>.",
        ),
        sa.Column(
            "size_bytes", sa.BigInteger(), nullable=False, comment="Total size of the files, bytes."
        ),
        sa.Column(
            "name",
            sa.Text(),
            nullable=False,
            comment="File name at first submission; for display only, not identity.",
        ),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            nullable=False,
            comment="First submission, UTC.",
        ),
        sha256_check("digest", "ck_models_digest_sha256"),
        sa.CheckConstraint("format IN ('ir', 'onnx')", name=op.f("ck_models_format")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_models")),
        sa.UniqueConstraint("digest", name=op.f("uq_models_digest")),
        comment="A model submitted to the farm, identified by the digests of its files.",
    )
    op.create_table(
        "jobs",
        sa.Column("id", sa.Integer(), nullable=False, comment="The job number users see."),
        sa.Column(
            "cache_key",
            sa.String(length=64),
            nullable=False,
            comment="The blob this job produces (caching hash v1).",
        ),
        sa.Column("model_id", sa.Integer(), nullable=False, comment="The model compiled."),
        sa.Column("target", sa.String(length=16), nullable=False, comment="'NPU.4000', 'CPU', ..."),
        sa.Column(
            "spec", sa.JSON(), nullable=False, comment="Canonical compile spec (DESIGN.md §5)."
        ),
        sa.Column(
            "toolchain",
            sa.JSON(),
            nullable=False,
            comment="Toolchain part of the cache key the blob must be produced with.",
        ),
        sa.Column(
            "state",
            sa.String(length=16),
            nullable=False,
            comment="queued → running → succeeded | failed | cancelled. Changes as the job runs.",
        ),
        sa.Column("submitter", sa.Text(), nullable=True, comment="Who submitted (token name)."),
        sa.Column(
            "submission_id",
            sa.Text(),
            nullable=True,
            comment="Groups the jobs of one matrix submission.",
        ),
        sa.Column(
            "attempts",
            sa.Integer(),
            server_default="0",
            nullable=False,
            comment="Times a worker claimed this job.",
        ),
        sa.Column(
            "max_attempts",
            sa.Integer(),
            server_default="3",
            nullable=False,
            comment="Claims allowed before it fails.",
        ),
        sa.Column("error", sa.Text(), nullable=True, comment="Why it failed: one line."),
        sa.Column(
            "log",
            sa.Text(),
            nullable=True,
            comment="Properties used, toolchain, timings, and the compiler's output.",
        ),
        sa.Column("worker", sa.Text(), nullable=True, comment="Host that ran (or runs) it."),
        sa.Column(
            "lease_expires_at",
            sa.DateTime(timezone=True),
            nullable=True,
            comment="A running job whose lease is past may be taken back. Renewed while compiling.",
        ),
        sa.Column(
            "cancel_requested",
            sa.Boolean(),
            server_default=sa.text("(false)"),
            nullable=False,
            comment="Set by `farm cancel`.",
        ),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), nullable=False, comment="Submitted, UTC."
        ),
        sa.Column(
            "started_at",
            sa.DateTime(timezone=True),
            nullable=True,
            comment="Last claimed by a worker, UTC.",
        ),
        sa.Column(
            "finished_at",
            sa.DateTime(timezone=True),
            nullable=True,
            comment="Reached a final state, UTC.",
        ),
        sa.Column(
            "compile_seconds",
            sa.Float(),
            nullable=True,
            comment="OpenVINO compile_model time, seconds (blob write excluded).",
        ),
        sa.Column(
            "export_seconds",
            sa.Float(),
            nullable=True,
            comment="Time OpenVINO spent writing the blob, seconds.",
        ),
        sa.Column(
            "peak_rss_bytes",
            sa.BigInteger(),
            nullable=True,
            comment="Peak resident memory of the compiling process, bytes.",
        ),
        sha256_check("cache_key", "ck_jobs_cache_key_sha256"),
        sa.CheckConstraint(
            "state IN ('queued', 'running', 'succeeded', 'failed', 'cancelled')",
            name=op.f("ck_jobs_state"),
        ),
        sa.ForeignKeyConstraint(["model_id"], ["models.id"], name=op.f("fk_jobs_model_id_models")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_jobs")),
        comment="A request to produce the blob of one cache key, and what became of it.",
    )
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.create_index("ix_jobs_state_target", ["state", "target"], unique=False)
        batch_op.create_index(
            "uq_jobs_active_cache_key",
            ["cache_key"],
            unique=True,
            sqlite_where=sa.text("state IN ('queued', 'running')"),
            postgresql_where=sa.text("state IN ('queued', 'running')"),
        )

    op.create_table(
        "blobs",
        sa.Column("id", sa.Integer(), nullable=False, comment="Row id."),
        sa.Column(
            "cache_key",
            sa.String(length=64),
            nullable=False,
            comment="Caching hash v1: the blob's identity.",
        ),
        sa.Column("job_id", sa.Integer(), nullable=True, comment="The job that produced it."),
        sa.Column("model_id", sa.Integer(), nullable=False, comment="Its model."),
        sa.Column("target", sa.String(length=16), nullable=False, comment="'NPU.4000', 'CPU', ..."),
        sa.Column("spec", sa.JSON(), nullable=False, comment="Canonical compile spec."),
        sa.Column(
            "toolchain",
            sa.JSON(),
            nullable=False,
            comment="What produced it: openvino, openvino_build, npu_compiler, runtime_requirements.",  # noqa: E501
        ),
        sa.Column(
            "openvino_version",
            sa.String(length=32),
            nullable=False,
            comment="OpenVINO release (X.Y.Z) that produced it (copy of toolchain).",
        ),
        sa.Column(
            "storage_key", sa.Text(), nullable=False, comment="Object key: blobs/<cache_key>.blob."
        ),
        sa.Column(
            "size_bytes", sa.BigInteger(), nullable=False, comment="Size of the stored file, bytes."
        ),
        sa.Column(
            "sha256",
            sa.String(length=64),
            nullable=False,
            comment="sha256 of the whole stored file, computed while it was written.",
        ),
        sa.Column(
            "payload_offset",
            sa.Integer(),
            nullable=False,
            comment="Bytes of OpenVINO cache header before the export payload.",
        ),
        sa.Column(
            "weightless",
            sa.Boolean(),
            nullable=False,
            comment="True: no weights inside; the edge supplies the model's .bin.",
        ),
        sa.Column("compile_seconds", sa.Float(), nullable=True, comment="Compile time, s."),
        sa.Column("export_seconds", sa.Float(), nullable=True, comment="Blob write time, s."),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), nullable=False, comment="Recorded, UTC."
        ),
        sha256_check("cache_key", "ck_blobs_cache_key_sha256"),
        sha256_check("sha256", "ck_blobs_sha256_sha256"),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name=op.f("fk_blobs_job_id_jobs")),
        sa.ForeignKeyConstraint(["model_id"], ["models.id"], name=op.f("fk_blobs_model_id_models")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_blobs")),
        sa.UniqueConstraint("cache_key", name=op.f("uq_blobs_cache_key")),
        comment="A compiled blob in storage. Written once, after its upload is verified.",
    )
    op.create_table(
        "pulls",
        sa.Column("id", sa.Integer(), nullable=False, comment="Row id."),
        sa.Column("blob_id", sa.Integer(), nullable=False, comment="The blob pulled."),
        sa.Column(
            "cache_key",
            sa.String(length=64),
            nullable=False,
            comment="Its cache key (copy, for SQL).",
        ),
        sa.Column("agent_id", sa.Text(), nullable=False, comment="The edge agent that pulled it."),
        sa.Column(
            "import_seconds",
            sa.Float(),
            nullable=True,
            comment="import_model time on the edge, seconds.",
        ),
        sa.Column("ok", sa.Boolean(), nullable=False, comment="Imported successfully."),
        sa.Column("error", sa.Text(), nullable=True, comment="Why the import failed."),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), nullable=False, comment="Reported, UTC."
        ),
        sha256_check("cache_key", "ck_pulls_cache_key_sha256"),
        sa.ForeignKeyConstraint(["blob_id"], ["blobs.id"], name=op.f("fk_pulls_blob_id_blobs")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_pulls")),
        comment="One edge download and import of a blob, as the edge reported it.",
    )


def downgrade() -> None:
    op.drop_table("pulls")
    op.drop_table("blobs")
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_index(
            "uq_jobs_active_cache_key",
            sqlite_where=sa.text("state IN ('queued', 'running')"),
            postgresql_where=sa.text("state IN ('queued', 'running')"),
        )
        batch_op.drop_index("ix_jobs_state_target")

    op.drop_table("jobs")
    op.drop_table("models")
