"""API tokens: created once and shown once, stored as sha256, checked on every request."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from farm.db.models import ApiToken
from farm.service import NotFound, now

ROLES = ("pull", "submit", "admin")
"""Each role may do what the roles before it may do."""
TOKEN_PREFIX = "farm_"
LAST_USED_EVERY = timedelta(minutes=1)


class TokenError(ValueError):
    """A token that cannot be created as asked (duplicate name, unknown role)."""


@dataclass(frozen=True)
class Caller:
    name: str
    role: str

    def may(self, role: str) -> bool:
        return ROLES.index(self.role) >= ROLES.index(role)


def token_digest(token: str) -> str:
    # Tokens are 256 random bits: a plain sha256 cannot be brute-forced, and it lets the
    # lookup be one indexed equality instead of a slow KDF per request.
    return hashlib.sha256(token.encode("utf-8", errors="surrogateescape")).hexdigest()


def create_token(session: Session, name: str, role: str) -> str:
    """Create a token and return it: the only time it is ever visible."""
    if role not in ROLES:
        raise TokenError(f"unknown role {role!r}; roles: {', '.join(ROLES)}")
    if not name or len(name) > 128:
        raise TokenError("a token needs a name of 1 to 128 characters")
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    session.add(ApiToken(name=name, role=role, token_sha256=token_digest(token), created_at=now()))
    try:
        session.commit()
    except IntegrityError:
        session.rollback()
        raise TokenError(f"a token named {name!r} exists; revoke it or pick another name") from None
    return token


def revoke_token(session: Session, name: str) -> datetime:
    """Revoke the token `name` (again: no change); returns when it was revoked."""
    row = session.scalar(select(ApiToken).where(ApiToken.name == name))
    if row is None:
        raise NotFound(f"no token named {name!r}")
    row.revoked_at = row.revoked_at or now()
    session.commit()
    return row.revoked_at


def authenticate(session: Session, token: str) -> Caller | None:
    """The caller a token belongs to, or None for an unknown or revoked token."""
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
    # At most one write per token per minute, not one per request.
    session.execute(
        update(ApiToken)
        .where(
            ApiToken.id == row.id,
            or_(ApiToken.last_used_at.is_(None), ApiToken.last_used_at < at - LAST_USED_EVERY),
        )
        .values(last_used_at=at)
    )
    session.commit()
    return Caller(row.name, row.role)


def list_tokens(session: Session) -> list[ApiToken]:
    return list(session.scalars(select(ApiToken).order_by(ApiToken.id)))
