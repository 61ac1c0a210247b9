"""The job_phases comments name every phase the runner records: the stage phase is named after
the recipe's stages ('convert+compress'; 'convert+compile' when one child converted and
compiled), and a compression's drift is a phase of its own. Comments only: no data changes.

Revision ID: 0023
Revises: 0022
Create Date: 2026-11-25 02:20:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0023"
down_revision = "0022"
branch_labels = None
depends_on = None

OLD_TABLE = (
    "Where a job's time went: one row per phase of an attempt (fetch, convert, compress, "
    "compile, reference, upload, record), timed by the worker. Inserted when the attempt ends; "
    "never updated or deleted."
)
NEW_TABLE = (
    "Where a job's time went: one row per phase of an attempt (fetch, its stages, drift, "
    "compile, reference, upload, record), timed by the worker. Inserted when the attempt ends; "
    "never updated or deleted."
)
OLD_PHASE = "'fetch', 'convert', 'compress', 'compile', 'reference', 'upload' or 'record'."
NEW_PHASE = (
    "'fetch'; the stages its recipe ran, named after them ('convert', 'compress', "
    "'convert+compress', ...; 'convert+compile' when one child converted and compiled); "
    "'drift', 'compile', 'reference', 'upload' or 'record'."
)


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return  # SQLite keeps no comments
    op.create_table_comment("job_phases", NEW_TABLE, existing_comment=OLD_TABLE)
    op.alter_column(
        "job_phases",
        "phase",
        existing_type=sa.String(16),
        existing_nullable=False,
        comment=NEW_PHASE,
        existing_comment=OLD_PHASE,
    )


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.create_table_comment("job_phases", OLD_TABLE, existing_comment=NEW_TABLE)
    op.alter_column(
        "job_phases",
        "phase",
        existing_type=sa.String(16),
        existing_nullable=False,
        comment=OLD_PHASE,
        existing_comment=NEW_PHASE,
    )
