"""Whether the configured services answer and this host signs what it compiles: `farm doctor`,
`/readyz` (`farm.server.readiness`) and `farm worker` start-up. (What OpenVINO can do here:
`farm.toolchain`.)

Every detail is safe to show anyone: URLs have their passwords masked, and the drivers' error
texts (which may quote a URL) are redacted of every secret in the settings.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from sqlalchemy import text

from farm.core.checks import Check
from farm.core.config import Settings
from farm.core.errors import KeyFileError, ServiceUnavailable, StorageError
from farm.core.signing import Signer
from farm.core.text import mask_url, redact
from farm.server.db.session import make_engine
from farm.server.storage import BlobStore, open_store

BROKER_TIMEOUT_SECONDS = 3


def signing_check(settings: Settings) -> Check:
    """Whether this host signs the blobs it compiles (edges refuse unsigned ones)."""
    path = settings.resolved_signing_key
    if path is None:
        return Check(
            "signing",
            False,
            "no FARM_SIGNING_KEY: blobs are recorded unsigned and edges refuse "
            "them (farm keys create)",
        )
    if not path.exists() and not settings.served:
        return Check("signing", True, f"{path} (created on the first compile)")
    try:
        return Check("signing", True, f"key {Signer.from_file(path).key_id} ({path})")
    except KeyFileError as error:
        return Check("signing", False, str(error))


def service_checks(settings: Settings) -> list[Check]:
    """Each configured service, reached afresh (`farm doctor`, `farm worker` start-up)."""
    url = settings.resolved_database_url

    def database_ping() -> None:
        engine = make_engine(url)
        try:
            with engine.connect() as connection:
                connection.execute(text("SELECT 1"))
        finally:
            engine.dispose()

    checks = [database_check(url, database_ping)]
    if settings.broker_url:
        probe = BrokerProbe(settings.broker_url)
        try:
            checks.append(broker_check(settings.broker_url, probe.ping))
        finally:
            probe.close()
    checks.append(
        storage_check(
            settings.resolved_storage_url,
            lambda: open_store(settings.resolved_storage_url, settings),
        )
    )
    return redacted(checks, settings)


def require_services(settings: Settings) -> None:
    failures = [c.detail for c in service_checks(settings) if not c.ok]
    if failures:
        raise ServiceUnavailable("; ".join(failures))


def redacted(checks: list[Check], settings: Settings) -> list[Check]:
    """The checks with every secret of `settings` redacted from their details."""
    return [Check(c.name, c.ok, redact(c.detail, settings.secrets)) for c in checks]


def database_check(url: str, ping: Callable[[], object]) -> Check:
    shown = mask_url(url)
    try:
        ping()
    except Exception as error:
        return Check(
            "database",
            False,
            f"cannot reach the database {shown} (FARM_DATABASE_URL): {_first_line(error)}",
        )
    return Check("database", True, shown)


def broker_check(url: str, ping: Callable[[], object]) -> Check:
    shown = mask_url(url)
    try:
        ping()
    except Exception as error:
        return Check("broker", False, f"cannot reach the broker {shown} (FARM_BROKER_URL): {error}")
    return Check("broker", True, shown)


def storage_check(url: str, store: Callable[[], BlobStore]) -> Check:
    try:
        store().check()
    except StorageError as error:
        return Check("storage", False, str(error))
    return Check("storage", True, mask_url(url))


class BrokerProbe:
    """A broker connection checked with a round trip (Redis: PING). Kept open between checks
    by `/readyz`; dropped after a failure and made anew by the next check. Not thread-safe:
    one check at a time."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._connection: Any = None

    def ping(self) -> None:
        from kombu import Connection  # comes with Celery: farm[server] only

        if self._connection is None:
            self._connection = Connection(
                self.url,
                connect_timeout=BROKER_TIMEOUT_SECONDS,
                transport_options={
                    "socket_timeout": BROKER_TIMEOUT_SECONDS,
                    "socket_connect_timeout": BROKER_TIMEOUT_SECONDS,
                },
            )
        try:
            self._connection.ensure_connection(max_retries=1, timeout=BROKER_TIMEOUT_SECONDS)
            # A kept connection counts as connected until it is used: ask the server.
            client = getattr(self._connection.default_channel, "client", None)
            ping = getattr(client, "ping", None)
            if callable(ping):
                ping()
        except Exception:
            self.close()
            raise

    def close(self) -> None:
        if self._connection is not None:
            connection, self._connection = self._connection, None
            # A connection that failed may fail to close: it is gone anyway.
            with contextlib.suppress(Exception):
                connection.release()


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__
