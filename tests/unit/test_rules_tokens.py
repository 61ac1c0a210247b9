"""API tokens (docs/architecture.md §9): shown once, stored as sha256, each role may do what the
roles before it may; revoked tokens are unknown, expired ones say so."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import select, update

from farm.core.clock import now
from farm.core.errors import NotFound, TokenError, TokenExpired
from farm.server.db.models import ApiToken
from farm.server.tokens import (
    Caller,
    authenticate,
    create_token,
    recently_authenticated,
    revoke_token,
    token_digest,
)


@pytest.fixture
def session(embedded_farm):
    with embedded_farm.session() as session:
        yield session


def rows(session) -> list[tuple[str, str]]:
    return [(t.name, t.role) for t in session.scalars(select(ApiToken).order_by(ApiToken.id))]


@pytest.mark.parametrize("role", ["pull", "submit", "admin"])
def test_a_created_token_authenticates_with_its_name_and_role(session, role):
    token = create_token(session, "ci", role)
    assert token.startswith("farm_") and len(token) == len("farm_") + 43
    assert authenticate(session, token) == Caller("ci", role)
    stored, last_used_at = session.execute(
        select(ApiToken.token_sha256, ApiToken.last_used_at)
    ).one()
    assert stored == token_digest(token)  # the token itself is never stored
    assert last_used_at is not None


@pytest.mark.parametrize(
    ("role", "allowed"),
    [
        ("pull", {"pull"}),
        ("submit", {"pull", "submit"}),
        ("admin", {"pull", "submit", "admin"}),
    ],
)
def test_roles_are_ordered_pull_submit_admin(role, allowed):
    caller = Caller("someone", role)
    assert {wanted for wanted in ("pull", "submit", "admin") if caller.may(wanted)} == allowed


def test_a_revoked_token_authenticates_as_nobody(session):
    token = create_token(session, "ci", "admin")
    other = create_token(session, "edge", "pull")
    revoked_at = revoke_token(session, "ci")
    assert authenticate(session, token) is None
    assert authenticate(session, other) == Caller("edge", "pull")
    assert revoke_token(session, "ci") == revoked_at  # again: no change


def test_revoking_an_unknown_token_is_not_found(session):
    with pytest.raises(NotFound, match=r"^no token named 'ghost'$"):
        revoke_token(session, "ghost")


def test_an_expired_token_raises_token_expired(session):
    token = create_token(session, "ci", "submit", expires_at=now() + timedelta(days=1))
    expired = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    session.execute(update(ApiToken).where(ApiToken.name == "ci").values(expires_at=expired))
    session.commit()
    with pytest.raises(TokenExpired) as raised:
        authenticate(session, token)
    assert str(raised.value) == (
        "token 'ci' expired at 2026-01-02 03:04:05 UTC; ask an admin for a new one "
        "(farm token create)"
    )


def test_a_revoked_and_expired_token_is_nobody_rather_than_expired(session):
    token = create_token(session, "ci", "submit", expires_at=now() + timedelta(days=1))
    session.execute(update(ApiToken).values(expires_at=now() - timedelta(days=1)))
    session.commit()
    revoke_token(session, "ci")
    assert authenticate(session, token) is None


def test_a_naive_expiry_is_utc(session):
    naive = (now() + timedelta(days=1)).replace(tzinfo=None, microsecond=0)
    create_token(session, "ci", "pull", expires_at=naive)
    assert session.scalar(select(ApiToken.expires_at)) == naive.replace(tzinfo=UTC)


def test_an_expiry_in_the_past_is_refused(session):
    with pytest.raises(TokenError, match=r"^the expiry 2020-01-01 00:00:00 UTC is in the past$"):
        create_token(session, "ci", "pull", expires_at=datetime(2020, 1, 1, tzinfo=UTC))
    assert rows(session) == []


def test_a_duplicate_name_is_refused_and_the_first_token_still_works(session):
    token = create_token(session, "ci", "submit")
    with pytest.raises(TokenError) as raised:
        create_token(session, "ci", "admin")
    assert str(raised.value) == "a token named 'ci' exists; revoke it or pick another name"
    assert rows(session) == [("ci", "submit")]
    assert authenticate(session, token) == Caller("ci", "submit")


def test_an_unknown_role_is_refused(session):
    with pytest.raises(TokenError) as raised:
        create_token(session, "ci", "root")
    assert str(raised.value) == "unknown role 'root'; roles: pull, submit, release, admin"
    assert rows(session) == []


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("", "a token needs a name of 1 to 128 characters"),
        ("n" * 129, "a token needs a name of 1 to 128 characters"),
        ("ci\n", "token name 'ci\\n' has control characters or is not UTF-8"),
    ],
)
def test_a_bad_name_is_refused(session, name, message):
    with pytest.raises(TokenError) as raised:
        create_token(session, name, "pull")
    assert str(raised.value) == message
    assert rows(session) == []


@pytest.mark.parametrize(
    "token",
    ["", "farm_unknown", "not-a-farm-token", "farm_" + "x" * 196],
)
def test_an_unknown_or_malformed_token_is_nobody(session, token):
    create_token(session, "ci", "admin")
    assert authenticate(session, token) is None


def test_last_use_is_written_at_most_once_a_minute(session):
    token = create_token(session, "ci", "pull")
    authenticate(session, token)
    first = session.scalar(select(ApiToken.last_used_at))
    authenticate(session, token)
    assert session.scalar(select(ApiToken.last_used_at)) == first
    two_minutes_ago = now() - timedelta(minutes=2)
    session.execute(update(ApiToken).values(last_used_at=two_minutes_ago))
    session.commit()
    authenticate(session, token)
    assert session.scalar(select(ApiToken.last_used_at)) > two_minutes_ago + timedelta(minutes=1)


def test_a_token_found_valid_is_trusted_for_the_cache_period_only(session, monkeypatch):
    from farm.server import tokens

    token = create_token(session, "edge", "pull")
    assert recently_authenticated(token, 5) is None  # never looked up in this process
    assert authenticate(session, token) == Caller("edge", "pull")
    assert recently_authenticated(token, 5) == Caller("edge", "pull")
    assert recently_authenticated(token, 0) is None  # 0: no cache
    assert recently_authenticated("farm_other", 5) is None
    later = tokens.time.monotonic() + 5
    monkeypatch.setattr(tokens.time, "monotonic", lambda: later)
    assert recently_authenticated(token, 5) is None  # the period is over: ask the database


def test_a_revoke_in_this_process_ends_the_cached_trust_at_once(session):
    token = create_token(session, "edge", "pull")
    authenticate(session, token)
    revoke_token(session, "edge")
    assert recently_authenticated(token, 60) is None
    assert authenticate(session, token) is None


def test_a_cached_token_that_expires_is_not_trusted(session, monkeypatch):
    from farm.server import tokens

    expires_at = now() + timedelta(days=1)
    token = create_token(session, "ci", "submit", expires_at=expires_at)
    assert authenticate(session, token) == Caller("ci", "submit", expires_at)
    monkeypatch.setattr(tokens, "now", lambda: expires_at)
    assert recently_authenticated(token, float("inf")) is None
