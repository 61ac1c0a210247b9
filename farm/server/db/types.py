"""Column types of the schema that need no ORM: the models (`farm.server.db.models`) and the
light read queries of the CLI (`farm.server.db.reads`) share them."""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import DateTime
from sqlalchemy.types import TypeDecorator


class UTCDateTime(TypeDecorator):
    """Timezone-aware UTC datetimes on every dialect.

    SQLite has no time zones and hands back naive datetimes; mixing those with the aware ones
    the code makes raises TypeError. Values are stored as UTC and read back aware.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect) -> datetime | None:
        if value is not None and value.tzinfo is not None:
            value = value.astimezone(UTC)
        return value

    def process_result_value(self, value: datetime | None, dialect) -> datetime | None:
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        return value
