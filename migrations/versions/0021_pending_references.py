"""Reference outputs off the job's critical path (docs/architecture.md §6, §14): a blob is
recorded, and its job succeeds, as soon as the blob is stored; its reference run follows.

- blobs.reference_state: 'pending', 'ready' or 'skipped' (null for rows of before, whose
  other reference columns say it all; backfilled here from them);
- blobs.reference_attempts, blobs.reference_lease_expires_at: the run's claim and lease, so
  the reconciler finds a run whose process died and sends it again, or records it skipped
  past its attempts (a partial index on the pending ones);
- the blobs table's comment names the update.

Revision ID: 0021
Revises: 0020
Create Date: 2026-11-24 23:30:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None

PENDING = "reference_state = 'pending'"
OLD_COMMENT = (
    "A compiled blob in storage. Inserted once, after its upload is verified; only its "
    "signature columns are updated, by `farm keys resign`, and its quarantine, by a failed "
    "verification or an admin; deleted by `farm gc` or a rebuild (recorded in blob_deletions)."
)
NEW_COMMENT = (
    "A compiled blob in storage. Inserted once, after its upload is verified, with its "
    "reference outputs pending; then its reference columns are set once, when the reference "
    "run ends (ready or skipped), its signature columns by `farm keys resign`, and its "
    "quarantine by a failed verification or an admin; deleted by `farm gc` or a rebuild "
    "(recorded in blob_deletions)."
)


def upgrade() -> None:
    postgresql = op.get_bind().dialect.name == "postgresql"
    # Plain ALTER TABLE ... ADD COLUMN (SQLite's batch mode would rebuild a table views read);
    # the CHECK constraints are PostgreSQL's only, as in 0011.
    op.add_column(
        "blobs",
        sa.Column(
            "reference_state",
            sa.String(16),
            nullable=True,
            comment="'pending' (recorded with the blob; computed after it, off the job's "
            "critical path), 'ready' (reference_sha256 set) or 'skipped' (reference_note says "
            "why); null: recorded before migration 0021 (read the other reference columns).",
        ),
    )
    op.add_column(
        "blobs",
        sa.Column(
            "reference_attempts",
            sa.Integer(),
            nullable=False,
            server_default="0",
            comment="Runs of the reference claimed so far (each against FARM_MAX_ATTEMPTS); "
            "the latest one's number is its claim.",
        ),
    )
    op.add_column(
        "blobs",
        sa.Column(
            "reference_lease_expires_at",
            sa.DateTime(timezone=True),
            nullable=True,
            comment="While a reference run holds it: renewed by its process; past it, the "
            "reconciler sends it again (or records it skipped past its attempts). Null: "
            "unclaimed.",
        ),
    )
    op.execute(
        "UPDATE blobs SET reference_state = CASE WHEN reference_sha256 IS NOT NULL THEN 'ready' "
        "WHEN reference_note IS NOT NULL THEN 'skipped' END"
    )
    if postgresql:
        op.create_check_constraint(
            op.f("ck_blobs_reference_state"),
            "blobs",
            "reference_state IS NULL OR reference_state IN ('pending', 'ready', 'skipped')",
        )
        op.create_check_constraint(
            op.f("ck_blobs_reference_ready_recorded"),
            "blobs",
            "reference_state <> 'ready' OR reference_sha256 IS NOT NULL",
        )
        op.create_table_comment("blobs", NEW_COMMENT, existing_comment=OLD_COMMENT)
    op.create_index(
        "ix_blobs_reference_pending",
        "blobs",
        ["reference_lease_expires_at"],
        sqlite_where=sa.text(PENDING),
        postgresql_where=sa.text(PENDING),
    )


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.create_table_comment("blobs", OLD_COMMENT, existing_comment=NEW_COMMENT)
    op.drop_index("ix_blobs_reference_pending", table_name="blobs")
    for column in ("reference_lease_expires_at", "reference_attempts", "reference_state"):
        op.drop_column("blobs", column)  # drops its constraints with it
