"""Signed blobs: blobs.signature and blobs.signing_key_id.

Workers sign (cache_key, sha256) with an Ed25519 key; edges import only blobs signed by a key
they trust (farm/signing.py). Nullable: blobs recorded before, or by an unsigned farm, stay.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-23 06:45:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "blobs",
        sa.Column(
            "signature",
            sa.Text(),
            nullable=True,
            comment="Ed25519 signature (base64) of (cache_key, sha256) by the worker; null: "
            "unsigned.",
        ),
    )
    op.add_column(
        "blobs",
        sa.Column(
            "signing_key_id",
            sa.String(16),
            nullable=True,
            comment="Which key signed it: sha256 of the raw public key, 16 hex characters.",
        ),
    )


def downgrade() -> None:
    op.drop_column("blobs", "signing_key_id")
    op.drop_column("blobs", "signature")
