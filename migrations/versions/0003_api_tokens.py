"""API tokens: bearer tokens of the HTTP API, stored as sha256.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22 14:41:43.694162
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from farm.migrations.checks import sha256_check

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "api_tokens",
        sa.Column("id", sa.Integer(), nullable=False, comment="Row id."),
        sa.Column(
            "name",
            sa.String(length=128),
            nullable=False,
            comment="Who holds it ('edge-042', 'ci'); recorded as submitter.",
        ),
        sa.Column(
            "role",
            sa.String(length=16),
            nullable=False,
            comment="'pull' (resolve, download, report), 'submit' (+ jobs), 'admin' (all).",
        ),
        sa.Column(
            "token_sha256",
            sa.String(length=64),
            nullable=False,
            comment="sha256 of the token; the token itself is never stored.",
        ),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), nullable=False, comment="Created, UTC."
        ),
        sa.Column(
            "revoked_at",
            sa.DateTime(timezone=True),
            nullable=True,
            comment="Revoked, UTC; null while valid.",
        ),
        sa.Column(
            "last_used_at",
            sa.DateTime(timezone=True),
            nullable=True,
            comment="Last authenticated request.",
        ),
        sa.CheckConstraint("role IN ('pull', 'submit', 'admin')", name=op.f("ck_api_tokens_role")),
        sha256_check("token_sha256", "ck_api_tokens_token_sha256_sha256"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_tokens")),
        sa.UniqueConstraint("name", name=op.f("uq_api_tokens_name")),
        sa.UniqueConstraint("token_sha256", name=op.f("uq_api_tokens_token_sha256")),
        comment="Bearer tokens of the HTTP API. Only their sha256 is stored.",
    )


def downgrade() -> None:
    op.drop_table("api_tokens")
