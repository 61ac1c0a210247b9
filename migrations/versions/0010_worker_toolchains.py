"""The toolchain of each target a worker compiles: workers.toolchains.

Jobs are routed by target and toolchain (one queue per toolchain class, `farm.server.routing`);
`farm workers` and the dashboard show which toolchains each worker has. Null for a worker that
registered before this column existed. A plain ALTER TABLE on both dialects, as in 0005.

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-24 04:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "workers",
        sa.Column(
            "toolchains",
            sa.JSON(),
            nullable=True,
            comment="Target → the toolchain key part it compiles with (OpenVINO release; CPU: "
            "also the runtime requirements); its queues follow from it.",
        ),
    )


def downgrade() -> None:
    op.drop_column("workers", "toolchains")
