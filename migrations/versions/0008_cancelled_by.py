"""Who cancelled a job: jobs.cancelled_by.

Only a job's submitter or an admin may cancel it (SECURITY.md, "Who may do what"); the column
records which token (or which operator, through the database) did. A plain ALTER TABLE on
both dialects, as in 0005.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-24 03:30:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "jobs",
        sa.Column(
            "cancelled_by",
            sa.Text(),
            nullable=True,
            comment="Who cancelled it: a token's name, or user@host of an operator; null: "
            "not cancelled.",
        ),
    )


def downgrade() -> None:
    op.drop_column("jobs", "cancelled_by")
