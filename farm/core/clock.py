"""The farm's clock: timezone-aware UTC, the only kind of time the database stores."""

from __future__ import annotations

from datetime import UTC, datetime


def now() -> datetime:
    return datetime.now(UTC)
