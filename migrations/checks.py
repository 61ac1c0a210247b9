"""Constraint helpers shared by migrations. Changing one changes what old migrations create:
add a new helper instead."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op


def sha256_check(column: str, name: str) -> sa.CheckConstraint:
    """`column` holds 64 lower-case hex characters: a regex on PostgreSQL, GLOB on SQLite."""
    if op.get_bind().dialect.name == "postgresql":
        sql = f"{column} ~ '^[0-9a-f]{{64}}$'"
    else:
        sql = f"length({column}) = 64 AND {column} NOT GLOB '*[^0-9a-f]*'"
    return sa.CheckConstraint(sql, name=op.f(name))
