"""Signed manifests: blobs.manifest_signature.

A v1 signature covers (cache_key, sha256) only, and an edge acted on fields no one signed
(target, toolchain, weightless, model digests, size, payload offset). Workers now also sign the
manifest of every field an edge acts on (farm/core/signing.py); edges of this version require
it. Nullable: blobs recorded before get theirs from `farm keys resign`, which updates the
signature columns of existing rows, so the table's comment no longer says "never updated".
The v1 `signature` stays, for edges older than manifests. SQLite keeps no comments.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-25 09:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

MANIFEST_SIGNATURE = (
    "Ed25519 signature (base64) by signing_key_id of the blob's manifest: cache_key, sha256, "
    "size_bytes, payload_offset, target, toolchain, weightless and the model's file digests "
    "(farm/core/signing.py); edges check it. Null: unsigned, or signed before manifests (run "
    "`farm keys resign`)."
)
OLD_SIGNATURE = "Ed25519 signature (base64) of (cache_key, sha256) by the worker; null: unsigned."
NEW_SIGNATURE = (
    "Ed25519 signature (base64) of (cache_key, sha256) by signing_key_id (v1, for edges older "
    "than manifest signatures); null: unsigned."
)
OLD_TABLE = (
    "A compiled blob in storage. Inserted once, after its upload is verified; never updated; "
    "deleted only by `farm gc` (recorded in blob_deletions)."
)
NEW_TABLE = (
    "A compiled blob in storage. Inserted once, after its upload is verified; only its "
    "signature columns are updated, by `farm keys resign`; deleted only by `farm gc` "
    "(recorded in blob_deletions)."
)


def _comments(signature: str, previous_signature: str, table: str, previous_table: str) -> None:
    if op.get_bind().dialect.name == "sqlite":
        return
    op.alter_column(
        "blobs",
        "signature",
        existing_type=sa.Text(),
        existing_nullable=True,
        comment=signature,
        existing_comment=previous_signature,
    )
    op.create_table_comment("blobs", table, existing_comment=previous_table)


def upgrade() -> None:
    op.add_column(
        "blobs",
        sa.Column("manifest_signature", sa.Text(), nullable=True, comment=MANIFEST_SIGNATURE),
    )
    _comments(NEW_SIGNATURE, OLD_SIGNATURE, NEW_TABLE, OLD_TABLE)


def downgrade() -> None:
    _comments(OLD_SIGNATURE, NEW_SIGNATURE, OLD_TABLE, NEW_TABLE)
    op.drop_column("blobs", "manifest_signature")
