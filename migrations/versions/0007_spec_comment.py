"""jobs.spec's comment points at docs/architecture.md, which the repository now holds.

Comments are part of what admins read (`\\d+ jobs`); the design document moved into the
repository, so the comment follows it. SQLite keeps no column comments: nothing to do there.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-24 03:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

OLD = "Canonical compile spec (DESIGN.md §5)."
NEW = "Canonical compile spec (docs/architecture.md §5)."


def _comment(text: str, previous: str) -> None:
    if op.get_bind().dialect.name == "sqlite":
        return
    op.alter_column(
        "jobs", "spec", existing_type=sa.JSON(), comment=text, existing_comment=previous
    )


def upgrade() -> None:
    _comment(NEW, OLD)


def downgrade() -> None:
    _comment(OLD, NEW)
