"""Channels: what a fleet runs, staged rollouts and rollbacks (docs/architecture.md §16).

- channels: one per name, with its rollout (stable and candidate revision, percent), the
  earlier stable revisions a rollback returns to, and the signed document edges act on;
- channel_revisions: each revision's models and specs, who made it and when;
- channel_moves: the audit of every move (set, promote, rollback), forced gates included;
- channel_edges: what each edge following a channel runs, as it last reported;
- views channel_overview, channel_revision_log and channel_fleet for the admin queries;
- api_tokens.role admits 'release': moves channels, besides what 'submit' may do. SQLite
  cannot alter a CHECK constraint, so there the table is rebuilt (no view reads it).

Revision ID: 0018
Revises: 0016
Create Date: 2026-11-24 21:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0018"
down_revision = "0016"
branch_labels = None
depends_on = None

VIEWS = {
    "channel_overview": (
        "Per channel: its rollout (stable and candidate revision, percent), revisions made, "
        "edges reporting, edges whose last switch failed, and the last move.",
        """
        SELECT c.name AS channel, c.sequence, c.stable_revision, c.candidate_revision,
               c.percent,
               (SELECT count(*) FROM channel_revisions r WHERE r.channel_id = c.id) AS revisions,
               (SELECT count(*) FROM channel_edges e WHERE e.channel_id = c.id) AS edges,
               (SELECT count(*) FROM channel_edges e
                WHERE e.channel_id = c.id AND NOT e.ok) AS failing_edges,
               c.updated_at
        FROM channels c
        """,
    ),
    "channel_revision_log": (
        "Per channel and revision: who made it, when, and how many models it runs.",
        """
        SELECT c.name AS channel, r.number AS revision, json_array_length(r.entries) AS models,
               r.created_by, r.created_at
        FROM channel_revisions r JOIN channels c ON c.id = r.channel_id
        """,
    ),
    "channel_fleet": (
        "Per channel and edge: the revision it runs, the one the document chose for it, its "
        "OpenVINO release, and why its last switch failed.",
        """
        SELECT c.name AS channel, e.agent_id, e.revision, e.wanted_revision, e.openvino,
               e.ok, e.error, e.reported_at
        FROM channel_edges e JOIN channels c ON c.id = e.channel_id
        """,
    ),
}


OLD_ROLES = "role IN ('pull', 'submit', 'admin')"
NEW_ROLES = "role IN ('pull', 'submit', 'release', 'admin')"
OLD_ROLE_COMMENT = "'pull' (resolve, download, report), 'submit' (+ jobs), 'admin' (all)."
NEW_ROLE_COMMENT = (
    "'pull' (resolve, download, report), 'submit' (+ jobs), 'release' (+ move channels), "
    "'admin' (all)."
)


def _roles(condition: str, comment: str, previous: str) -> None:
    with op.batch_alter_table("api_tokens") as table:
        table.drop_constraint(op.f("ck_api_tokens_role"), type_="check")
        table.create_check_constraint("role", condition)
        table.alter_column(
            "role", existing_type=sa.String(16), comment=comment, existing_comment=previous
        )


def upgrade() -> None:
    dialect = op.get_bind().dialect.name
    _roles(NEW_ROLES, NEW_ROLE_COMMENT, OLD_ROLE_COMMENT)
    op.create_table(
        "channels",
        sa.Column("id", sa.Integer(), nullable=False, comment="Row id."),
        sa.Column("name", sa.String(63), nullable=False, comment="The channel's name."),
        sa.Column(
            "created_by", sa.Text(), nullable=False, comment="Who created it (token or operator)."
        ),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), nullable=False, comment="Created, UTC."
        ),
        sa.Column(
            "sequence",
            sa.Integer(),
            nullable=False,
            comment="Sequence of the current signed document; grows by one with every move. "
            "Edges refuse a document older than one they accepted.",
        ),
        sa.Column(
            "stable_revision",
            sa.Integer(),
            nullable=True,
            comment="The revision every edge runs (outside a stage); null: none yet.",
        ),
        sa.Column(
            "candidate_revision",
            sa.Integer(),
            nullable=True,
            comment="The revision being rolled out to `percent` % of edges; null: none.",
        ),
        sa.Column(
            "percent",
            sa.Integer(),
            nullable=False,
            comment="Share of edges (by a hash of their agent id) that run the candidate.",
        ),
        sa.Column(
            "previous_revisions",
            sa.JSON(),
            nullable=False,
            comment="Earlier stable revisions, oldest first: where `farm channel rollback` "
            "returns to; kept from gc.",
        ),
        sa.Column(
            "document",
            sa.JSON(),
            nullable=False,
            comment="The signed channel document edges act on (farm/core/channels.py).",
        ),
        sa.Column(
            "signature",
            sa.Text(),
            nullable=True,
            comment="Ed25519 signature (base64) of the document; null: unsigned farm.",
        ),
        sa.Column("signing_key_id", sa.String(16), nullable=True, comment="Which key signed it."),
        sa.Column(
            "updated_at", sa.DateTime(timezone=True), nullable=False, comment="Last move, UTC."
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_channels")),
        sa.UniqueConstraint("name", name=op.f("uq_channels_name")),
        sa.CheckConstraint("percent BETWEEN 0 AND 100", name=op.f("ck_channels_percent")),
        comment="A release channel: what a fleet runs (docs/architecture.md §16). Inserted by "
        "`farm channel create`; its rollout columns and signed document change with each move "
        "(set, promote, rollback, recorded in channel_moves); never deleted.",
    )
    op.create_table(
        "channel_revisions",
        sa.Column("id", sa.Integer(), nullable=False, comment="Row id."),
        sa.Column(
            "channel_id",
            sa.Integer(),
            sa.ForeignKey("channels.id", name=op.f("fk_channel_revisions_channel_id_channels")),
            nullable=False,
            comment="Its channel.",
        ),
        sa.Column(
            "number",
            sa.Integer(),
            nullable=False,
            comment="Revision number, from 1, per channel.",
        ),
        sa.Column(
            "entries",
            sa.JSON(),
            nullable=False,
            comment="The models it runs: per entry a name, the model's file digests, the "
            "target and the canonical compile spec.",
        ),
        sa.Column("created_by", sa.Text(), nullable=False, comment="Who made it."),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, comment="Made, UTC."),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_channel_revisions")),
        comment="One revision of a channel: the models and specs it runs. Inserted by "
        "`farm channel set`; never updated or deleted.",
    )
    op.create_index(
        "uq_channel_revisions_channel_number",
        "channel_revisions",
        ["channel_id", "number"],
        unique=True,
    )
    op.create_table(
        "channel_moves",
        sa.Column("id", sa.Integer(), nullable=False, comment="Row id."),
        sa.Column(
            "channel_id",
            sa.Integer(),
            sa.ForeignKey("channels.id", name=op.f("fk_channel_moves_channel_id_channels")),
            nullable=False,
            comment="Its channel.",
        ),
        sa.Column(
            "sequence", sa.Integer(), nullable=False, comment="Document sequence after the move."
        ),
        sa.Column(
            "action",
            sa.String(16),
            nullable=False,
            comment="'create', 'set', 'promote' or 'rollback'.",
        ),
        sa.Column(
            "revision",
            sa.Integer(),
            nullable=True,
            comment="The revision made, promoted or returned to.",
        ),
        sa.Column("percent", sa.Integer(), nullable=True, comment="Promote: the share, percent."),
        sa.Column("stable_revision", sa.Integer(), nullable=True, comment="Stable after the move."),
        sa.Column(
            "candidate_revision", sa.Integer(), nullable=True, comment="Candidate after the move."
        ),
        sa.Column(
            "forced",
            sa.Boolean(),
            nullable=False,
            comment="An admin forced it past the verification gates.",
        ),
        sa.Column(
            "gate_report",
            sa.Text(),
            nullable=True,
            comment="What the gates refused (the reasons a forced move overrode).",
        ),
        sa.Column("actor", sa.Text(), nullable=False, comment="Who moved it (token or operator)."),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, comment="When, UTC."),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_channel_moves")),
        sa.CheckConstraint(
            "action IN ('create', 'set', 'promote', 'rollback')",
            name=op.f("ck_channel_moves_action"),
        ),
        comment="The audit of every move of a channel: who, when, what, and whether a gate was "
        "forced. Inserted with each move; never updated or deleted.",
    )
    op.create_index("ix_channel_moves_channel_id_id", "channel_moves", ["channel_id", "id"])
    op.create_table(
        "channel_edges",
        sa.Column(
            "channel_id",
            sa.Integer(),
            sa.ForeignKey("channels.id", name=op.f("fk_channel_edges_channel_id_channels")),
            nullable=False,
            comment="The channel it follows.",
        ),
        sa.Column("agent_id", sa.String(255), nullable=False, comment="The edge agent."),
        sa.Column(
            "revision", sa.Integer(), nullable=True, comment="The revision it runs; null: none yet."
        ),
        sa.Column(
            "sequence",
            sa.Integer(),
            nullable=True,
            comment="The highest document sequence it accepted.",
        ),
        sa.Column("openvino", sa.String(64), nullable=True, comment="Its OpenVINO release."),
        sa.Column(
            "runtime_requirements",
            sa.Text(),
            nullable=True,
            comment="Its CPU runtime requirements string (null: no CPU entry).",
        ),
        sa.Column("targets", sa.JSON(), nullable=False, comment="The targets of its entries."),
        sa.Column(
            "ok", sa.Boolean(), nullable=False, comment="Its last switch (or check) succeeded."
        ),
        sa.Column(
            "error",
            sa.Text(),
            nullable=True,
            comment="Why its last switch failed (it stays on `revision`); null when ok.",
        ),
        sa.Column(
            "wanted_revision",
            sa.Integer(),
            nullable=True,
            comment="The revision the document chose for it at its last sync.",
        ),
        sa.Column(
            "reported_at", sa.DateTime(timezone=True), nullable=False, comment="Last report, UTC."
        ),
        sa.PrimaryKeyConstraint("channel_id", "agent_id", name=op.f("pk_channel_edges")),
        comment="What each edge following a channel runs, as it last reported. Upserted per "
        "report (one row per channel and agent); never deleted.",
    )
    for name, (comment, sql) in VIEWS.items():
        op.execute(f"CREATE VIEW {name} AS {sql}")
        if dialect == "postgresql":
            op.execute(f"COMMENT ON VIEW {name} IS '{comment}'")


def downgrade() -> None:
    for name in reversed(VIEWS):
        op.execute(f"DROP VIEW {name}")
    op.drop_table("channel_edges")
    op.drop_index("ix_channel_moves_channel_id_id", table_name="channel_moves")
    op.drop_table("channel_moves")
    op.drop_index("uq_channel_revisions_channel_number", table_name="channel_revisions")
    op.drop_table("channel_revisions")
    op.drop_table("channels")
    # A release token becomes a submit token: it keeps everything but moving channels.
    op.execute("UPDATE api_tokens SET role = 'submit' WHERE role = 'release'")
    _roles(OLD_ROLES, OLD_ROLE_COMMENT, NEW_ROLE_COMMENT)
