"""Keyset pagination: a list endpoint answers one page and a cursor to the next, so no request
builds an unbounded answer, and a page costs the same however deep it is (no OFFSET scan).

A cursor is opaque to clients: URL-safe base64 of the sort key of a page's last row. Jobs are
ordered by id and blobs by (created_at, id), newest first; workers by name.
Each order is one index (docs/schema.md, Indexes), so a page reads only its own rows.
"""

from __future__ import annotations

import base64
import binascii
from datetime import datetime

from farm.core.errors import SpecError

MAX_PAGE = 1000
"""The largest page any list endpoint answers."""


class InvalidCursor(SpecError):
    """A cursor this server did not hand out (or from another list)."""

    code = "invalid_cursor"


def encode(*parts: str) -> str:
    return base64.urlsafe_b64encode("|".join(parts).encode()).decode().rstrip("=")


def decode(cursor: str, count: int) -> list[str]:
    try:
        padded = cursor + "=" * (-len(cursor) % 4)
        parts = base64.urlsafe_b64decode(padded.encode("ascii")).decode().split("|")
    except (ValueError, UnicodeError, binascii.Error):
        raise InvalidCursor(f"cursor {cursor[:80]!r} is not one this server handed out") from None
    if len(parts) != count:
        raise InvalidCursor(f"cursor {cursor[:80]!r} is not one this server handed out")
    return parts


def job_cursor(job_id: int) -> str:
    return encode("job", str(job_id))


def after_job(cursor: str) -> int:
    kind, job_id = decode(cursor, 2)
    if kind != "job" or not job_id.isdigit():
        raise InvalidCursor(f"cursor {cursor[:80]!r} is not a cursor of the job list")
    return int(job_id)


def blob_cursor(created_at: datetime, blob_id: int) -> str:
    return encode("blob", created_at.isoformat(), str(blob_id))


def after_blob(cursor: str) -> tuple[datetime, int]:
    kind, created_at, blob_id = decode(cursor, 3)
    try:
        if kind != "blob" or not blob_id.isdigit():
            raise ValueError
        return datetime.fromisoformat(created_at), int(blob_id)
    except ValueError:
        raise InvalidCursor(f"cursor {cursor[:80]!r} is not a cursor of the blob list") from None


def worker_cursor(name: str) -> str:
    return encode("worker", name)


def after_worker(cursor: str) -> str:
    _, *name = decode_prefix(cursor, "worker")
    return "|".join(name)


def decode_prefix(cursor: str, kind: str) -> list[str]:
    """The parts of a cursor of the `kind` list whose last part may itself hold '|'."""
    try:
        padded = cursor + "=" * (-len(cursor) % 4)
        parts = base64.urlsafe_b64decode(padded.encode("ascii")).decode().split("|")
    except (ValueError, UnicodeError, binascii.Error):
        parts = []
    if len(parts) < 2 or parts[0] != kind:
        raise InvalidCursor(f"cursor {cursor[:80]!r} is not a cursor of the {kind} list")
    return parts
