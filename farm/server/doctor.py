"""Whether the configured services answer and this host signs what it compiles: `farm doctor`,
`/readyz` and `farm worker` start-up. (What OpenVINO can do here: `farm.toolchain`.)"""

from __future__ import annotations

from sqlalchemy import text

from farm.core.checks import Check
from farm.core.config import Settings
from farm.core.errors import KeyFileError, ServiceUnavailable, StorageError
from farm.core.signing import Signer
from farm.core.text import mask_url
from farm.server.db.session import make_engine
from farm.server.storage import open_store


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
    checks = [_database(settings)]
    if settings.broker_url:
        checks.append(_broker(settings))
    checks.append(_storage(settings))
    return checks


def require_services(settings: Settings) -> None:
    failures = [c.detail for c in service_checks(settings) if not c.ok]
    if failures:
        raise ServiceUnavailable("; ".join(failures))


def _database(settings: Settings) -> Check:
    url = settings.resolved_database_url
    shown = mask_url(url)
    try:
        engine = make_engine(url)
        with engine.connect() as connection:
            connection.execute(text("SELECT 1"))
        engine.dispose()
    except Exception as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return Check(
            "database", False, f"cannot reach the database {shown} (FARM_DATABASE_URL): {first}"
        )
    return Check("database", True, shown)


def _broker(settings: Settings) -> Check:
    from kombu import Connection  # comes with Celery: farm[server] only

    shown = mask_url(settings.broker_url or "")
    try:
        with Connection(settings.broker_url, connect_timeout=3) as connection:
            connection.ensure_connection(max_retries=1, timeout=3)
    except Exception as error:
        return Check(
            "broker",
            False,
            f"cannot reach the broker {shown} (FARM_BROKER_URL): {error}",
        )
    return Check("broker", True, shown)


def _storage(settings: Settings) -> Check:
    url = settings.resolved_storage_url
    try:
        open_store(url, settings).check()
    except StorageError as error:
        return Check("storage", False, str(error))
    return Check("storage", True, url)
