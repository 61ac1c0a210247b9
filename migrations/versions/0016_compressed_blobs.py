"""Compression (docs/architecture.md §15, compress and quantize stages).

- jobs.max_drift: the submitter's `--max-drift` bound; a job whose compressed model drifts
  past it fails with the figures and publishes nothing. Not part of any key.
- view compressed_blobs: one row per blob compiled from a compressed or quantized model, with
  the compression's arguments, sizes, drift and NNCF version, and the source model.

The figures are read out of `stage_outputs.metrics` (JSON) with each dialect's own operator,
so the view has the same columns and values on PostgreSQL and SQLite.

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-24 21:30:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None

VIEW = "compressed_blobs"
COMMENT = (
    "Per blob compiled from a compressed or quantized model: the stage (kind, key, args), the "
    "weights before and after, the drift from the uncompressed model, NNCF version and source."
)
# (column, JSON path in its document, SQL type on PostgreSQL)
FIGURES = (
    ("size_before", ("metrics", "size_before"), "bigint"),
    ("size_after", ("metrics", "size_after"), "bigint"),
    ("size_ratio", ("metrics", "ratio"), "double precision"),
    ("max_abs_diff", ("metrics", "drift", "max_abs_diff"), "double precision"),
    ("mean_abs_diff", ("metrics", "drift", "mean_abs_diff"), "double precision"),
    ("min_cosine", ("metrics", "drift", "min_cosine"), "double precision"),
    ("top1_agreement", ("metrics", "drift", "top1_agreement"), "double precision"),
    ("mode", ("args", "mode"), "text"),
    ("precision", ("args", "precision"), "text"),
    ("nncf_version", ("tool_versions", "nncf"), "text"),
)


def _json(dialect: str, path: tuple[str, ...], sql_type: str) -> str:
    column, *keys = path
    if dialect == "postgresql":
        inner = "".join(f"->'{key}'" for key in keys[:-1])
        return f"(s.{column}{inner}->>'{keys[-1]}')::{sql_type}"
    return f"json_extract(s.{column}, '$.{'.'.join(keys)}')"


def _sql(dialect: str) -> str:
    figures = ",\n               ".join(
        f"{_json(dialect, path, sql_type)} AS {name}" for name, path, sql_type in FIGURES
    )
    return f"""
        SELECT b.cache_key, b.target, s.kind, s.stage_key,
               {figures},
               s.seconds AS stage_seconds,
               m.digest AS source_digest, m.name AS source_name, m.format AS source_format,
               b.created_at
        FROM blobs b
        JOIN jobs j ON j.id = b.job_id
        JOIN stage_outputs s ON s.stage_key = j.stage_key
        LEFT JOIN stage_outputs p ON p.stage_key = s.input_stage_key
        LEFT JOIN models m ON m.id = COALESCE(s.input_model_id, p.input_model_id)
        WHERE s.kind IN ('compress', 'quantize')
        """


MAX_DRIFT_COMMENT = (
    "The submitter's --max-drift bound on the compressed model's drift (max-abs=..,cosine=..,"
    "top1=..); null: none. Checked against the stage's recorded drift, not keyed."
)


def upgrade() -> None:
    dialect = op.get_bind().dialect.name
    # Plain ADD COLUMN (no batch rebuild: views read jobs).
    op.add_column(
        "jobs", sa.Column("max_drift", sa.Text(), nullable=True, comment=MAX_DRIFT_COMMENT)
    )
    op.execute(f"CREATE VIEW {VIEW} AS {_sql(dialect)}")
    if dialect == "postgresql":
        op.execute(f"COMMENT ON VIEW {VIEW} IS '{COMMENT}'")


def downgrade() -> None:
    op.execute(f"DROP VIEW {VIEW}")
    op.drop_column("jobs", "max_drift")
