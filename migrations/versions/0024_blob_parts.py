"""A blob's part digests (farm/server/blobs/parts.py): the sha256 of each 64 MiB part, signed,
so an edge downloads the parts on several connections and checks each as it arrives.

- blobs.part_bytes, blobs.part_sha256s, blobs.parts_signature: set once, by the worker, after
  the blob is recorded (null: none hashed; the edge then checks the whole file), re-signed by
  `farm keys resign`; all three or none (a CHECK constraint on PostgreSQL, as in 0011);
- the blobs table's comment names the update.

Revision ID: 0024
Revises: 0023
Create Date: 2026-11-29 07:30:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0024"
down_revision = "0023"
branch_labels = None
depends_on = None

OLD_COMMENT = (
    "A compiled blob in storage. Inserted once, after its upload is verified, with its "
    "reference outputs pending; then its reference columns are set once, when the reference "
    "run ends (ready or skipped), its signature columns by `farm keys resign`, and its "
    "quarantine by a failed verification or an admin; deleted by `farm gc` or a rebuild "
    "(recorded in blob_deletions)."
)
NEW_COMMENT = (
    "A compiled blob in storage. Inserted once, after its upload is verified, with its "
    "reference outputs pending; then its reference columns are set once, when the reference "
    "run ends (ready or skipped), its part digests once, after it is recorded, its signature "
    "columns by `farm keys resign`, and its quarantine by a failed verification or an admin; "
    "deleted by `farm gc` or a rebuild (recorded in blob_deletions)."
)
COLUMNS = ("part_bytes", "part_sha256s", "parts_signature")


def upgrade() -> None:
    # Plain ALTER TABLE ... ADD COLUMN (SQLite's batch mode would rebuild a table views read);
    # the CHECK constraint is PostgreSQL's only, as in 0011.
    op.add_column(
        "blobs",
        sa.Column(
            "part_bytes",
            sa.BigInteger(),
            nullable=True,
            comment="The size of the parts part_sha256s lists (the last one shorter); null: "
            "none hashed (a blob in a local store, or recorded before parts).",
        ),
    )
    op.add_column(
        "blobs",
        sa.Column(
            "part_sha256s",
            sa.JSON(),
            nullable=True,
            comment="sha256 of each part, in order: an edge checks each as it downloads it "
            "(farm/server/blobs/parts.py).",
        ),
    )
    op.add_column(
        "blobs",
        sa.Column(
            "parts_signature",
            sa.Text(),
            nullable=True,
            comment="Ed25519 signature (base64) by signing_key_id binding part_bytes and "
            "part_sha256s to the blob (farm/core/signing.py parts_message).",
        ),
    )
    if op.get_bind().dialect.name == "postgresql":
        op.create_check_constraint(
            op.f("ck_blobs_parts_recorded_whole"),
            "blobs",
            "(part_bytes IS NULL) = (part_sha256s IS NULL) "
            "AND (part_bytes IS NULL) = (parts_signature IS NULL)",
        )
        op.create_table_comment("blobs", NEW_COMMENT, existing_comment=OLD_COMMENT)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.create_table_comment("blobs", OLD_COMMENT, existing_comment=NEW_COMMENT)
    for column in reversed(COLUMNS):
        op.drop_column("blobs", column)  # drops its constraint with it
