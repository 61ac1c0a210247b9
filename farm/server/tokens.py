"""API tokens: created once and shown once, stored as sha256, checked on every request."""

from __future__ import annotations

import hashlib
import secrets
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy import or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from farm.core.clock import now
from farm.core.errors import NotFound, TokenError, TokenExpired
from farm.server.db.models import ApiToken

ROLES = ("pull", "submit", "release", "admin")
"""Each role may do what the roles before it may do; `release` adds moving channels (create,
set, promote, rollback) to `submit`, and only `admin` forces a promotion past its gates."""
TOKEN_PREFIX = "farm_"
LAST_USED_EVERY = timedelta(minutes=1)
RECENT_MAX = 10_000
"""Tokens `recently_authenticated` remembers per process; past that it starts afresh."""

_recent: dict[str, tuple[Caller, float]] = {}
"""Token digest -> (its caller, when `authenticate` found it, `time.monotonic()`)."""
_recent_lock = threading.Lock()


@dataclass(frozen=True)
class Caller:
    name: str
    role: str
    expires_at: datetime | None = None
    """When the token expires (UTC); None: never. What it is given expires no later."""

    def may(self, role: str) -> bool:
        return ROLES.index(self.role) >= ROLES.index(role)


def token_digest(token: str) -> str:
    # Tokens are 256 random bits: a plain sha256 cannot be brute-forced, and it lets the
    # lookup be one indexed equality instead of a slow KDF per request.
    return hashlib.sha256(token.encode("utf-8", errors="surrogateescape")).hexdigest()


def create_token(session: Session, name: str, role: str, expires_at: datetime | None = None) -> str:
    """Create a token and return it: the only time it is ever visible.

    `expires_at` (UTC if it has no time zone): from then on the API refuses the token;
    None: valid until revoked.
    """
    if role not in ROLES:
        raise TokenError(f"unknown role {role!r}; roles: {', '.join(ROLES)}")
    if not name or len(name) > 128:
        raise TokenError("a token needs a name of 1 to 128 characters")
    if not name.isprintable():
        raise TokenError(f"token name {name!r} has control characters or is not UTF-8")
    created_at = now()
    if expires_at is not None:
        if expires_at.tzinfo is None:
            expires_at = expires_at.replace(tzinfo=UTC)
        if expires_at <= created_at:
            raise TokenError(f"the expiry {expires_at:%Y-%m-%d %H:%M:%S} UTC is in the past")
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    session.add(
        ApiToken(
            name=name,
            role=role,
            token_sha256=token_digest(token),
            created_at=created_at,
            expires_at=expires_at,
        )
    )
    try:
        session.commit()
    except IntegrityError:
        session.rollback()
        raise TokenError(f"a token named {name!r} exists; revoke it or pick another name") from None
    return token


def revoke_token(session: Session, name: str) -> datetime:
    """Revoke the token `name` (again: no change); returns when it was revoked."""
    # No token has a name that is not printable (create_token); such a name cannot even be
    # sent to the database when it is not UTF-8.
    row = name.isprintable() and session.scalar(select(ApiToken).where(ApiToken.name == name))
    if not row:
        raise NotFound(f"no token named {name!r}")
    row.revoked_at = row.revoked_at or now()
    session.commit()
    with _recent_lock:  # this process forgets it now; the others within their cache period
        _recent.clear()
    return row.revoked_at


def authenticate(session: Session, token: str) -> Caller | None:
    """The caller a token belongs to, or None for an unknown or revoked token.

    Raises TokenExpired for a token past its expiry (revoked first: a revoked token is None).
    """
    if not token.startswith(TOKEN_PREFIX) or len(token) > 200:
        return None
    row = session.scalar(
        select(ApiToken).where(
            ApiToken.token_sha256 == token_digest(token), ApiToken.revoked_at.is_(None)
        )
    )
    if row is None:
        return None
    at = now()
    if row.expires_at is not None and row.expires_at <= at:
        raise TokenExpired(
            f"token {row.name!r} expired at {row.expires_at:%Y-%m-%d %H:%M:%S} UTC; "
            "ask an admin for a new one (farm token create)"
        )
    # At most one write per token per minute, not one per request; a token used within the
    # minute (what this read shows) costs no statement and no commit at all.
    caller = Caller(row.name, row.role, row.expires_at)
    with _recent_lock:
        if len(_recent) >= RECENT_MAX:
            _recent.clear()
        _recent[row.token_sha256] = (caller, time.monotonic())
    if row.last_used_at is not None and row.last_used_at >= at - LAST_USED_EVERY:
        return caller
    session.execute(
        update(ApiToken)
        .where(
            ApiToken.id == row.id,
            or_(ApiToken.last_used_at.is_(None), ApiToken.last_used_at < at - LAST_USED_EVERY),
        )
        .values(last_used_at=at)
    )
    session.commit()
    return caller


def recently_authenticated(token: str, within_seconds: float) -> Caller | None:
    """The caller `authenticate` found for `token` in this process less than `within_seconds`
    ago, if the token has not expired since; None otherwise (then ask `authenticate`).

    What the API checks first on each request: a token used again and again (an edge fleet's
    pull token) costs one database lookup per period per process, not one per request. The
    price is that a token revoked by another process (`farm token revoke`) keeps working here
    for up to `within_seconds` (FARM_TOKEN_CACHE_SECONDS; SECURITY.md); a revoke in this
    process, and an expiry, take effect at once.
    """
    if within_seconds <= 0:
        return None
    with _recent_lock:
        found = _recent.get(token_digest(token))
    if found is None or time.monotonic() - found[1] >= within_seconds:
        return None
    caller = found[0]
    if caller.expires_at is not None and caller.expires_at <= now():
        return None  # `authenticate` says it expired
    return caller


def list_tokens(session: Session, limit: int, after_id: int = 0) -> list[ApiToken]:
    """At most `limit` tokens by id, after the token `after_id` (keyset: each page one range
    of the primary key)."""
    query = select(ApiToken).where(ApiToken.id > after_id).order_by(ApiToken.id).limit(limit)
    return list(session.scalars(query))
