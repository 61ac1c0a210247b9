"""Keyset pagination: a list endpoint answers one page and a cursor to the next, so no request
builds an unbounded answer, and a page costs the same however deep it is (no OFFSET scan).

A cursor is opaque to clients: URL-safe base64 of the sort key of a page's last row. Jobs are
ordered by id and blobs by (created_at, id), newest first; workers by name.
Each order is one index (docs/schema.md, Indexes), so a page reads only its own rows.
"""

from __future__ import annotations

import base64
import binascii
import re
from datetime import UTC, datetime

from farm.core.errors import SpecError

MAX_PAGE = 1000
"""The largest page any list endpoint answers."""


class InvalidCursor(SpecError):
    """A cursor this server did not hand out (or from another list)."""

    code = "invalid_cursor"


_ID = re.compile(r"[0-9]{1,18}")
"""A row id in a cursor: ASCII digits only (`str.isdigit` takes '²', which `int` refuses), and
at most 18 of them, so the id fits every integer column the database compares it with."""
_PRINTABLE = re.compile(r"[^\x00-\x1f\x7f]*")
"""The parts of a cursor hold no control characters (PostgreSQL text cannot hold a NUL)."""


def encode(*parts: str) -> str:
    return base64.urlsafe_b64encode("|".join(parts).encode()).decode().rstrip("=")


def _parts(cursor: str) -> list[str]:
    """The '|'-separated parts of a cursor; [] for one that is not base64 of printable UTF-8."""
    try:
        padded = cursor + "=" * (-len(cursor) % 4)
        text = base64.b64decode(padded.encode("ascii"), altchars=b"-_", validate=True).decode()
    except (ValueError, UnicodeError, binascii.Error):
        return []
    if _PRINTABLE.fullmatch(text) is None:
        return []
    return text.split("|")


def decode(cursor: str, count: int) -> list[str]:
    parts = _parts(cursor)
    if len(parts) != count:
        raise InvalidCursor(f"cursor {cursor[:80]!r} is not one this server handed out")
    return parts


def _row_id(text: str) -> int | None:
    return int(text) if _ID.fullmatch(text) else None


def job_cursor(job_id: int) -> str:
    return encode("job", str(job_id))


def after_job(cursor: str) -> int:
    kind, job_id = decode(cursor, 2)
    after = _row_id(job_id)
    if kind != "job" or after is None:
        raise InvalidCursor(f"cursor {cursor[:80]!r} is not a cursor of the job list")
    return after


def blob_cursor(created_at: datetime, blob_id: int) -> str:
    return encode("blob", created_at.isoformat(), str(blob_id))


def after_blob(cursor: str) -> tuple[datetime, int]:
    """The (created_at, id) of the cursor's blob; its time in UTC. A time with a zone far from
    UTC at the edge of the calendar (0001-01-01T00:00:00+14:00) has no UTC equivalent: refused
    like any other cursor this server did not hand out."""
    kind, created_at, blob_id = decode(cursor, 3)
    after = _row_id(blob_id)
    try:
        if kind != "blob" or after is None:
            raise ValueError
        at = datetime.fromisoformat(created_at)
        if at.tzinfo is None:
            raise ValueError
        return at.astimezone(UTC), after
    except (ValueError, OverflowError):
        raise InvalidCursor(f"cursor {cursor[:80]!r} is not a cursor of the blob list") from None


def worker_cursor(name: str) -> str:
    return encode("worker", name)


def after_worker(cursor: str) -> str:
    _, *name = decode_prefix(cursor, "worker")
    return "|".join(name)


def decode_prefix(cursor: str, kind: str) -> list[str]:
    """The parts of a cursor of the `kind` list whose last part may itself hold '|'."""
    parts = _parts(cursor)
    if len(parts) < 2 or parts[0] != kind:
        raise InvalidCursor(f"cursor {cursor[:80]!r} is not a cursor of the {kind} list")
    return parts
