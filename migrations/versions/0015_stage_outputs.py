"""Stages (docs/architecture.md §15): the stage_outputs catalog, a job's recipe, source formats.

- stage_outputs: one row per content-addressed stage (convert, compress, ...): its input (a
  source model or the stage before), canonical args, recorded tool versions, its output IR
  (an ordinary models row), state and lease (single flight: the unique stage_key).
- jobs.recipe, jobs.stage_key: the stages a job runs before its compile, and the last one's key
  (the join from a blob's job to the stage that made the model it compiled).
- workers.converters: the converters (with versions) a worker runs stages with.
- models.format: wider, and every source format (tflite, paddle, savedmodel, pb, pt2,
  torchscript, huggingface) besides ir and onnx.

SQLite rebuilds `models` for its new CHECK (batch mode) with legacy ALTER TABLE on, so that the
rename does not re-check the admin views that read `models`.

Revision ID: 0015
Revises: 0012
Create Date: 2026-11-24 21:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from farm.migrations.checks import sha256_check

revision = "0015"
down_revision = "0012"
branch_labels = None
depends_on = None

OLD_FORMATS = ("ir", "onnx")
NEW_FORMATS = ("ir", "onnx", "tflite", "paddle", "savedmodel", "pb", "pt2", "torchscript",
               "huggingface")  # fmt: skip


def _formats_check(formats: tuple[str, ...]) -> str:
    return "format IN ({})".format(", ".join(f"'{f}'" for f in formats))


FORMAT_COMMENTS = (
    "'ir' (.xml + .bin) or 'onnx'.",
    "'ir' (.xml + .bin), 'onnx', or a source format converted by a stage: 'tflite', "
    "'paddle', 'savedmodel', 'pb', 'pt2', 'torchscript', 'huggingface' (docs §15).",
)
FILES_COMMENTS = (
    "sha256 of each file by role: {xml, bin} or {onnx}. Stored at models/<sha256>.",
    "sha256 of each file by role ({xml, bin}, {onnx}, {tflite}, ...) or, for a folder, by "
    "relative path. Stored at models/<sha256>.",
)


def _set_formats(formats: tuple[str, ...], length: int) -> None:
    new = formats == NEW_FORMATS
    if op.get_bind().dialect.name == "postgresql":
        op.drop_constraint(op.f("ck_models_format"), "models", type_="check")
        op.alter_column(
            "models",
            "format",
            type_=sa.String(length),
            comment=FORMAT_COMMENTS[new],
            existing_comment=FORMAT_COMMENTS[not new],
        )
        op.alter_column(
            "models",
            "files",
            comment=FILES_COMMENTS[new],
            existing_comment=FILES_COMMENTS[not new],
            existing_type=sa.JSON(),
        )
        op.create_check_constraint(op.f("ck_models_format"), "models", _formats_check(formats))
        return
    op.execute("PRAGMA legacy_alter_table=ON")
    try:
        with op.batch_alter_table("models") as batch:
            # Names through the naming convention: "format" is ck_models_format.
            batch.drop_constraint("format", type_="check")
            batch.alter_column("format", type_=sa.String(length))
            batch.create_check_constraint("format", _formats_check(formats))
    finally:
        op.execute("PRAGMA legacy_alter_table=OFF")


def upgrade() -> None:
    postgresql = op.get_bind().dialect.name == "postgresql"
    _set_formats(NEW_FORMATS, 16)
    op.add_column(
        "jobs",
        sa.Column(
            "recipe",
            sa.JSON(),
            nullable=True,
            comment="The stages run before the compile, in order ([{stage, args}], docs §15); "
            "null: none (the model is compiled as it is).",
        ),
    )
    op.add_column(
        "jobs",
        sa.Column(
            "stage_key",
            sa.String(64),
            nullable=True,
            comment="Key of the recipe's last stage: its stage_outputs row holds the model "
            "compiled (join stage_outputs.stage_key); null: no recipe.",
        ),
    )
    if postgresql:  # SQLite adds no CHECK to an existing table (as in 0011)
        op.create_check_constraint(
            op.f("ck_jobs_stage_key_sha256"), "jobs", "stage_key ~ '^[0-9a-f]{64}$'"
        )
    op.add_column(
        "workers",
        sa.Column(
            "converters",
            sa.JSON(),
            nullable=True,
            comment="Converter → its versions ({torch: {torch: '2.13.0'}}), those the worker "
            "can run stages with (docs §15); null: none, or registered before 0015.",
        ),
    )
    op.create_table(
        "stage_outputs",
        sa.Column("id", sa.Integer(), nullable=False, comment="Row id."),
        sa.Column(
            "stage_key",
            sa.String(64),
            nullable=False,
            comment="sha256 of input, kind and canonical args (§15).",
        ),
        sa.Column("kind", sa.String(32), nullable=False, comment="'convert', 'compress', ..."),
        sa.Column(
            "input_model_id",
            sa.Integer(),
            sa.ForeignKey("models.id", name=op.f("fk_stage_outputs_input_model_id_models")),
            nullable=True,
            comment="The source model it reads; null: reads a stage.",
        ),
        sa.Column(
            "input_stage_key",
            sa.String(64),
            nullable=True,
            comment="The stage whose output it reads; null: reads a source model.",
        ),
        sa.Column("args", sa.JSON(), nullable=False, comment="Canonical arguments of the stage."),
        sa.Column(
            "tool_versions",
            sa.JSON(),
            nullable=True,
            comment="Versions of the tools that ran it ({openvino, torch, optimum-intel, ...}); "
            "recorded, not keyed.",
        ),
        sa.Column(
            "output_files",
            sa.JSON(),
            nullable=True,
            comment="sha256 of each output file by role ({xml, bin}); null until done.",
        ),
        sa.Column(
            "output_model_id",
            sa.Integer(),
            sa.ForeignKey("models.id", name=op.f("fk_stage_outputs_output_model_id_models")),
            nullable=True,
            comment="The output IR, an ordinary models row; null until done.",
        ),
        sa.Column(
            "metrics",
            sa.JSON(),
            nullable=True,
            comment="What the stage measured (sizes, drift, seconds, peak RSS).",
        ),
        sa.Column("state", sa.String(16), nullable=False, comment="'running', 'done' or 'failed'."),
        sa.Column("error", sa.Text(), nullable=True, comment="Why it failed; null otherwise."),
        sa.Column(
            "job_id",
            sa.Integer(),
            sa.ForeignKey("jobs.id", name=op.f("fk_stage_outputs_job_id_jobs")),
            nullable=True,
            comment="The job that ran it (last claimed it).",
        ),
        sa.Column(
            "lease_expires_at",
            sa.DateTime(timezone=True),
            nullable=True,
            comment="While running: past this, another job may take it over (its job died).",
        ),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), nullable=False, comment="First claimed, UTC."
        ),
        sa.Column(
            "finished_at", sa.DateTime(timezone=True), nullable=True, comment="Done or failed, UTC."
        ),
        sa.Column("seconds", sa.Float(), nullable=True, comment="Time the stage ran, seconds."),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_stage_outputs")),
        sa.UniqueConstraint("stage_key", name=op.f("uq_stage_outputs_stage_key")),
        sha256_check("stage_key", "ck_stage_outputs_stage_key_sha256"),
        sha256_check("input_stage_key", "ck_stage_outputs_input_stage_key_sha256"),
        sa.CheckConstraint(
            "state IN ('running', 'done', 'failed')", name=op.f("ck_stage_outputs_state")
        ),
        sa.CheckConstraint(
            "(input_model_id IS NULL) <> (input_stage_key IS NULL)",
            name=op.f("ck_stage_outputs_one_input"),
        ),
        sa.CheckConstraint(
            "state <> 'done' OR output_model_id IS NOT NULL",
            name=op.f("ck_stage_outputs_done_output"),
        ),
        comment="One stage of a recipe (convert, compress, ...) applied to a source or to the "
        "output of the stage before, content-addressed by stage_key (docs §15). Inserted "
        "'running' by the job that claims it (single flight), then 'done' with its output "
        "model, or 'failed' with the reason; a failed row is taken over by the next job that "
        "needs it. A done row is never recomputed.",
    )


def downgrade() -> None:
    op.drop_table("stage_outputs")
    op.drop_column("workers", "converters")
    op.drop_column("jobs", "stage_key")  # drops its constraint with it
    op.drop_column("jobs", "recipe")
    op.execute(
        "DELETE FROM models WHERE format NOT IN ({})".format(
            ", ".join(f"'{f}'" for f in OLD_FORMATS)
        )
    )
    _set_formats(OLD_FORMATS, 8)
