"""API tokens that expire: api_tokens.expires_at.

A plain ALTER TABLE on both dialects (SQLite >= 3.35 drops columns natively), as in 0002.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23 06:30:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "api_tokens",
        sa.Column(
            "expires_at",
            sa.DateTime(timezone=True),
            nullable=True,
            comment="Expires, UTC: from then on requests get 401 token_expired; null: never.",
        ),
    )


def downgrade() -> None:
    op.drop_column("api_tokens", "expires_at")
