"""Dashboard sessions: what the dashboard's cookie holds instead of the API token.

A login exchanges a token for a random session id (256 bits), of which the database keeps
only the sha256 (`dashboard_sessions`), bound to the token's row. So the browser never holds
the token itself: a cookie that leaks (a shared machine, a browser profile copied) opens the
read-only dashboard until the session expires or is logged out, and never the API. Each
request checks the session and its token (revoked, expired), so `farm token revoke` ends the
token's sessions at once. A session lives FARM_DASHBOARD_SESSION_SECONDS, and never past
the token's own expiry.
"""

from __future__ import annotations

import math
import secrets
from datetime import timedelta

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from farm.core.clock import now
from farm.server.db.models import ApiToken, DashboardSession
from farm.server.tokens import Caller, token_digest


def open_session(session: Session, caller: Caller, seconds: int) -> tuple[str, int]:
    """A new session for the token `caller` authenticated with: its id (for the cookie) and
    how many seconds it lives. Expired sessions of every token are removed on the way."""
    at = now()
    session.execute(delete(DashboardSession).where(DashboardSession.expires_at <= at))
    token = session.scalars(select(ApiToken).where(ApiToken.name == caller.name)).one()
    expires_at = at + timedelta(seconds=seconds)
    if token.expires_at is not None:
        expires_at = min(expires_at, token.expires_at)
    session_id = secrets.token_urlsafe(32)
    session.add(
        DashboardSession(
            session_sha256=token_digest(session_id),
            token_id=token.id,
            created_at=at,
            expires_at=expires_at,
        )
    )
    session.commit()
    return session_id, max(1, math.ceil((expires_at - at).total_seconds()))


def session_caller(session: Session, session_id: str) -> Caller | None:
    """The caller of a live session whose token is still valid; None otherwise."""
    if not session_id or len(session_id) > 200:
        return None
    at = now()
    row = session.execute(
        select(ApiToken.name, ApiToken.role, ApiToken.expires_at)
        .join(DashboardSession, DashboardSession.token_id == ApiToken.id)
        .where(
            DashboardSession.session_sha256 == token_digest(session_id),
            DashboardSession.expires_at > at,
            ApiToken.revoked_at.is_(None),
        )
    ).one_or_none()
    if row is None or (row.expires_at is not None and row.expires_at <= at):
        return None
    return Caller(row.name, row.role, row.expires_at)


def close_session(session: Session, session_id: str) -> None:
    """Log out: the session is gone, whoever still holds its cookie."""
    if session_id and len(session_id) <= 200:
        session.execute(
            delete(DashboardSession).where(
                DashboardSession.session_sha256 == token_digest(session_id)
            )
        )
        session.commit()
