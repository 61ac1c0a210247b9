"""Workers table; jobs.queue and jobs.sent_at for served mode.

Columns are added and dropped with plain ALTER TABLE (SQLite >= 3.35 drops columns natively):
batch mode would rebuild `jobs` on SQLite and lose its CHECK constraints.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22 14:22:11.103188
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "workers",
        sa.Column(
            "name", sa.String(length=255), nullable=False, comment="Celery node name (worker@host)."
        ),
        sa.Column("host", sa.Text(), nullable=False, comment="Host name."),
        sa.Column("pid", sa.Integer(), nullable=False, comment="Main process id on the host."),
        sa.Column(
            "targets",
            sa.JSON(),
            nullable=False,
            comment="Target → null if it compiles here, else why not (the start-up probe).",
        ),
        sa.Column("queues", sa.JSON(), nullable=False, comment="Queues it consumes."),
        sa.Column(
            "openvino_version", sa.String(length=64), nullable=False, comment="OpenVINO full build."
        ),
        sa.Column(
            "memory_bytes", sa.BigInteger(), nullable=False, comment="Memory it offers, bytes."
        ),
        sa.Column(
            "started_at", sa.DateTime(timezone=True), nullable=False, comment="Started, UTC."
        ),
        sa.Column(
            "heartbeat_at",
            sa.DateTime(timezone=True),
            nullable=False,
            comment="Last heartbeat, UTC. Updated every FARM_WORKER_HEARTBEAT_SECONDS while alive.",
        ),
        sa.Column(
            "stopped_at", sa.DateTime(timezone=True), nullable=True, comment="Clean shutdown, UTC."
        ),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_workers")),
        comment="Compile workers: what each serves, and when it was last seen.",
    )
    op.add_column(
        "jobs",
        sa.Column(
            "queue",
            sa.String(length=64),
            server_default="embedded",
            nullable=False,
            comment=(
                "Celery queue it is sent to ('compile.npu.4000', 'compile.cpu.large'), "
                "or 'embedded' when compiled in the submitting process."
            ),
        ),
    )
    op.add_column(
        "jobs",
        sa.Column(
            "sent_at",
            sa.DateTime(timezone=True),
            nullable=True,
            comment="Last time its message was sent to the queue (the reconciler re-sends), UTC.",
        ),
    )


def downgrade() -> None:
    op.drop_column("jobs", "sent_at")
    op.drop_column("jobs", "queue")

    op.drop_table("workers")
