"""blob_deletions.quarantine_reason: a rebuild into the same bytes stays quarantined.

A blob retired while quarantined (`farm submit --rebuild`, `farm blobs delete`) keeps its
quarantine reason in its own column, so a new blob of the same cache key and bytes starts
quarantined with it (farm/server/blobs/verifications.py `inherited_quarantine`): only an admin
lifts a quarantine. Rows retired before this revision get theirs back from `reason`, which
those two paths wrote as "<why> after quarantine: <quarantine reason>".

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-24 21:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

MARK = "after quarantine: "


def upgrade() -> None:
    # Plain ALTER TABLE ... ADD COLUMN: SQLite's batch mode would rebuild the table.
    op.add_column(
        "blob_deletions",
        sa.Column(
            "quarantine_reason",
            sa.Text(),
            nullable=True,
            comment="Its quarantine reason when it was retired while quarantined (a rebuild "
            "into the same bytes starts quarantined with it); null: it was not quarantined.",
        ),
    )
    deletions = sa.table(
        "blob_deletions", sa.column("reason", sa.Text), sa.column("quarantine_reason", sa.Text)
    )
    position = sa.func.instr if op.get_bind().dialect.name == "sqlite" else sa.func.strpos
    op.execute(
        deletions.update()
        .where(deletions.c.reason.contains(MARK))
        .values(
            quarantine_reason=sa.func.substr(
                deletions.c.reason, position(deletions.c.reason, MARK) + len(MARK)
            )
        )
    )


def downgrade() -> None:
    op.drop_column("blob_deletions", "quarantine_reason")
