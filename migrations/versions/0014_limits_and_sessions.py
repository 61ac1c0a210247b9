"""Per-submitter storage quota and server-side dashboard sessions.

- model_uploads: who stored which model file through the API, so a submitter's stored bytes
  (FARM_MAX_STORED_BYTES_PER_SUBMITTER) count the files it uploaded and has not submitted yet;
- dashboard_sessions: the dashboard's cookie holds a random session id whose sha256 is here,
  never the raw API token.

Two new tables: nothing existing is rewritten.

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-24 21:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from farm.migrations.checks import sha256_check

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "model_uploads",
        sa.Column("id", sa.Integer(), nullable=False, comment="Row id."),
        sa.Column(
            "sha256", sa.String(length=64), nullable=False, comment="The file's sha256 (its name)."
        ),
        sa.Column("submitter", sa.Text(), nullable=False, comment="The token that uploaded it."),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False, comment="Its size, bytes."),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, comment="Stored, UTC."),
        sha256_check("sha256", "ck_model_uploads_sha256_sha256"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_model_uploads")),
        comment="Who stored which model file through the API, for the per-submitter storage "
        "quota (FARM_MAX_STORED_BYTES_PER_SUBMITTER). Inserted per stored upload; never "
        "updated; counted for FARM_MODEL_GRACE_SECONDS (after that a file no job names is "
        "collected, and one a job names counts through its model).",
    )
    op.create_index(
        "ix_model_uploads_submitter_created_at",
        "model_uploads",
        ["submitter", "created_at"],
    )
    op.create_table(
        "dashboard_sessions",
        sa.Column("id", sa.Integer(), nullable=False, comment="Row id."),
        sa.Column(
            "session_sha256",
            sa.String(length=64),
            nullable=False,
            comment="sha256 of the session id; the id itself is not stored.",
        ),
        sa.Column(
            "token_id",
            sa.Integer(),
            nullable=False,
            comment="The token that logged in; checked (revoked, expired) on every request.",
        ),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), nullable=False, comment="Logged in, UTC."
        ),
        sa.Column(
            "expires_at",
            sa.DateTime(timezone=True),
            nullable=False,
            comment="Refused from then on, UTC (FARM_DASHBOARD_SESSION_SECONDS, or the "
            "token's expiry if sooner).",
        ),
        sha256_check("session_sha256", "ck_dashboard_sessions_session_sha256_sha256"),
        sa.ForeignKeyConstraint(
            ["token_id"],
            ["api_tokens.id"],
            name=op.f("fk_dashboard_sessions_token_id_api_tokens"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_dashboard_sessions")),
        sa.UniqueConstraint("session_sha256", name=op.f("uq_dashboard_sessions_session_sha256")),
        comment="Dashboard logins: the browser's cookie holds a random session id, never the "
        "API token. Inserted at login; deleted at logout and once expired.",
    )


def downgrade() -> None:
    op.drop_table("dashboard_sessions")
    op.drop_index("ix_model_uploads_submitter_created_at", table_name="model_uploads")
    op.drop_table("model_uploads")
