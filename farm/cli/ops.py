"""Commands for operators: worker, doctor, reconcile, gc, db upgrade, api, token."""

from __future__ import annotations

import json
from dataclasses import asdict
from datetime import UTC, datetime, timedelta
from typing import Any

import click

from farm.cli import main
from farm.cli.common import (
    EXIT_COMPILER_UNAVAILABLE,
    EXIT_INFRASTRUCTURE,
    EXIT_UNAUTHORIZED,
    direct,
    direct_settings,
    emit,
    err,
    handle_errors,
    installed,
    json_option,
    not_installed,
    out,
    say,
    size_text,
)
from farm.core.checks import Check
from farm.core.config import Settings, get_settings
from farm.core.errors import ApiError, FarmError, Kind
from farm.core.text import mask_url


@main.command()
@click.option(
    "--concurrency",
    "-c",
    type=click.IntRange(1, 64),
    default=1,
    show_default=True,
    help="Compiles at once on this host (each may need many GB).",
)
@click.option("--name", "-n", help="Worker name; default farm-<pid>@<host>.")
@click.option("--beat", is_flag=True, help="Also run the periodic reconciler (one per farm).")
@click.option("--loglevel", default="INFO", show_default=True)
@handle_errors
def worker(concurrency: int, name: str | None, beat: bool, loglevel: str) -> None:
    """Run a compile worker: probe the targets this host compiles and serve their queues."""
    settings = direct_settings("worker")
    with installed("worker"):
        from farm.cli.backends.direct import run_worker  # farm[embedded]

    if not settings.served:
        raise click.UsageError(
            "farm worker needs FARM_BROKER_URL (and a shared database "
            "and store); the embedded farm compiles in `farm submit`"
        )
    run_worker(settings, concurrency=concurrency, name=name, beat=beat, loglevel=loglevel)


@main.command()
@json_option
@handle_errors
def doctor(as_json: bool) -> None:
    """What this host has (OpenVINO, devices, NPU libraries, targets) and which services answer:
    the API FARM_API_URL names (its /readyz, the token, the keys this machine trusts), or the
    database, broker and store themselves."""
    settings = get_settings()
    checks = _openvino_checks()
    if settings.api_url:
        checks += api_checks(settings)
    if not settings.api_url or settings.database_url:
        checks += _farm_checks(settings)
    rows = [{"check": c.name, "ok": c.ok, "detail": c.detail} for c in checks]

    def human() -> None:
        for c in checks:
            mark = "[green]ok[/]     " if c.ok else "[red]missing[/]"
            out.print(f"{mark} {c.name}: ", end="")
            say(c.detail)

    emit(rows, as_json, human)
    failed = {c.name for c in checks if not c.ok}
    if failed & {"api", "database", "broker", "storage"}:
        raise SystemExit(EXIT_INFRASTRUCTURE)
    if "token" in failed:
        raise SystemExit(EXIT_UNAUTHORIZED)
    if "farm" in failed:
        raise SystemExit(EXIT_COMPILER_UNAVAILABLE)


def _openvino_checks() -> list[Check]:
    try:
        from farm.toolchain import openvino_checks  # OpenVINO: only when checked
    except ModuleNotFoundError as error:
        missing = not_installed(error, "compiling or importing blobs")
        if missing is None:
            raise
        return [Check("openvino", False, str(missing))]
    return openvino_checks()


def _farm_checks(settings: Settings) -> list[Check]:
    """The signing key and the services of the farm this host reaches directly."""
    try:
        from farm.cli.backends.direct import farm_checks  # farm[embedded]
    except ModuleNotFoundError as error:
        missing = not_installed(error, "the farm's database and store")
        if missing is None:
            raise
        return [Check("farm", False, str(missing))]
    return farm_checks(settings)


def api_checks(settings: Settings) -> list[Check]:
    """The farm API of FARM_API_URL: ready (its database, broker and store answer), the token
    valid and its role, and the keys this machine verifies blobs with."""
    assert settings.api_url
    from farm.client import FarmClient

    shown = mask_url(settings.api_url)
    checks: list[Check] = []
    with FarmClient(settings.api_url, settings.token, timeout=10.0) as client:
        try:
            status, body = client.readiness()
        except ApiError as error:
            return [Check("api", False, str(error))]
        services = ", ".join(f"{name} {detail}" for name, detail in body["checks"].items())
        ready = status == 200
        checks.append(
            Check("api", ready, f"{shown} {'ready' if ready else 'NOT ready'}: {services}")
        )
        checks.append(_token_check(client, settings))
    checks.append(_trust_check(settings))
    return checks


def _token_check(client: Any, settings: Settings) -> Check:
    if not settings.token:
        return Check("token", False, "FARM_TOKEN is not set: the API answers nothing without one")
    try:
        client.resolve("0" * 64)  # any role may resolve: the token is valid
    except ApiError as error:
        return Check("token", False, f"the API refused FARM_TOKEN: {error}")
    try:
        client.jobs(limit=1)
    except ApiError as error:
        if error.kind is not Kind.FORBIDDEN:
            return Check("token", False, str(error))
        return Check("token", True, "valid, role pull (resolve, download and report pulls)")
    return Check("token", True, "valid, role submit or admin")


def _trust_check(settings: Settings) -> Check:
    from farm.core.signing import TrustedKeys

    if settings.allow_unsigned:
        return Check("trusted keys", True, "FARM_ALLOW_UNSIGNED is set: imports unsigned blobs")
    try:
        trusted = TrustedKeys.from_files(settings.trusted_key_paths)
    except FarmError as error:
        return Check("trusted keys", False, str(error))
    if not trusted.keys:
        return Check(
            "trusted keys",
            False,
            "none: every blob pulled from the farm is refused; set FARM_TRUSTED_KEYS to the "
            "farm's public key (the .pub beside its FARM_SIGNING_KEY)",
        )
    return Check("trusted keys", True, ", ".join(sorted(trusted.keys)))


@main.command()
@json_option
@handle_errors
def reconcile(as_json: bool) -> None:
    """One reconciler pass: re-send lost messages, take back expired leases, fail stuck jobs."""
    report = direct("reconcile").reconcile()
    emit(
        report,
        as_json,
        lambda: out.print(
            f"failed {report['failed']}, taken back {report['taken_back']}, "
            f"cancelled {report['cancelled']}, re-sent {report['resent']}, "
            f"aborted uploads {len(report['aborted_uploads'])}"
        ),
    )


@main.command()
@click.option(
    "--unpulled-days",
    type=click.IntRange(0),
    required=True,
    help="Delete blobs whose last pull (or creation, if never pulled) is this many days ago.",
)
@click.option("--dry-run", is_flag=True, help="List what would be deleted; change nothing.")
@json_option
@handle_errors
def gc(unpulled_days: int, dry_run: bool, as_json: bool) -> None:
    """Delete blobs no edge has pulled for N days, from the database and from storage, and
    model files no job names, older than FARM_MODEL_GRACE_SECONDS."""
    verb = "would delete" if dry_run else "deleted"
    # Each blob is written as gc reaches it, never all held at once (a catalog of millions).
    if as_json:
        click.echo('{"blobs": [', nl=False)
        first = [True]

        def listed(blob: Any) -> None:
            click.echo(
                ("\n  " if first[0] else ",\n  ") + json.dumps(asdict(blob), default=str), nl=False
            )
            first[0] = False
    else:

        def listed(blob: Any) -> None:
            last = str(blob.last_pulled_at or "never")[:19]
            click.echo(
                f"{verb} {blob.cache_key} {blob.target:9} {size_text(blob.size_bytes):>10} "
                f"pulls {blob.pulls}, last pulled {last}"
            )

    report = direct("gc").collect_garbage(unpulled_days, dry_run, on_blob=listed)
    if as_json:
        rest = json.dumps(
            {k: v for k, v in report.as_dict().items() if k != "blobs"}, indent=2, default=str
        )
        click.echo("\n], " + rest[1:].lstrip())
    else:
        out.print(f"{verb} {report.blob_count} blobs, {size_text(report.bytes)}")
        for model in report.models:
            size, stored = size_text(model.size_bytes), str(model.stored_at)[:19]
            out.print(f"{verb} model file {model.sha256} {size:>10} stored {stored}")
        if report.models:
            size = size_text(report.model_bytes)
            out.print(f"{verb} {len(report.models)} model files no job names, {size}")
        for bundle in report.bundles:
            last = str(bundle.last_used_at)[:19]
            out.print(
                f"{verb} bundle {bundle.bundle_key} {bundle.pipeline} {bundle.target}, last "
                f"submitted or pulled {last}"
            )
        if report.bundle_files:
            size = size_text(report.bundle_file_bytes)
            out.print(f"{verb} {len(report.bundle_files)} bundle files no bundle lists, {size}")
        if report.pending:
            state = "waiting for deletion" if dry_run else "still in storage (gc retries them)"
            out.print(f"{len(report.pending)} objects {state}")
        for error in report.errors:
            say(f"farm: error: {error}", err)
    if report.errors:
        raise SystemExit(EXIT_INFRASTRUCTURE)


@main.group()
def db() -> None:
    """Database schema."""


@db.command("upgrade")
@json_option
@handle_errors
def db_upgrade(as_json: bool) -> None:
    """Bring the database schema to the latest migration."""
    settings = direct_settings("db upgrade")
    with installed("db upgrade"):
        from farm.cli.backends.direct import upgrade_schema  # farm[embedded]

    revision = upgrade_schema(settings)
    shown = mask_url(settings.resolved_database_url)
    emit(
        {"database": shown, "revision": revision},
        as_json,
        lambda: out.print(f"database at head ({revision}): {shown}"),
    )


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8080, show_default=True)
@click.option("--workers", "processes", type=click.IntRange(1, 64), default=1, show_default=True)
@handle_errors
def api(host: str, port: int, processes: int) -> None:
    """Serve the HTTP API (uvicorn)."""
    settings = direct_settings("api")
    with installed("api"):
        from farm.cli.backends.direct import serve_api  # farm[embedded]

    serve_api(host, port, processes, settings)


@main.group()
def token() -> None:
    """API tokens (run where FARM_DATABASE_URL reaches the farm's database)."""


@token.command("create")
@click.option("--name", required=True, help="Who holds it: 'edge-042', 'ci'.")
@click.option("--role", type=click.Choice(["pull", "submit", "release", "admin"]), required=True)
@click.option(
    "--expires-in",
    "expires_in",
    type=click.FloatRange(min=0, min_open=True),
    metavar="DAYS",
    help="Expire after DAYS (fractions allowed: 0.5 is 12 hours). Default: never.",
)
@click.option("--expires", type=click.DateTime(), metavar="DATE", help="Expire at DATE (UTC).")
@json_option
@handle_errors
def token_create(
    name: str, role: str, expires_in: float | None, expires: datetime | None, as_json: bool
) -> None:
    """Create a token; it is printed once and never stored."""
    if expires_in is not None and expires is not None:
        raise click.UsageError("give --expires-in or --expires, not both")
    expires_at = expires.replace(tzinfo=UTC) if expires else None
    if expires_in is not None:
        expires_at = datetime.now(UTC) + timedelta(days=expires_in)
    secret = direct("token create").create_token(name, role, expires_at)
    emit(
        {"name": name, "role": role, "expires_at": expires_at, "token": secret},
        as_json,
        lambda: click.echo(secret),
    )


@token.command("revoke")
@click.argument("name")
@json_option
@handle_errors
def token_revoke(name: str, as_json: bool) -> None:
    """Revoke the token called NAME; requests with it get 401 from now on."""
    revoked_at = direct("token revoke").revoke_token(name)
    emit({"name": name, "revoked_at": revoked_at}, as_json, lambda: out.print(f"revoked {name}"))


@token.command("list")
@json_option
@handle_errors
def token_list(as_json: bool) -> None:
    """List tokens (names and roles; the tokens themselves are not stored)."""
    at = datetime.now(UTC)
    rows = [
        {
            "name": t.name,
            "role": t.role,
            "created_at": t.created_at,
            "revoked_at": t.revoked_at,
            "expires_at": t.expires_at,
            "state": _token_state(t, at),
        }
        for t in direct("token list").list_tokens()
    ]

    def human() -> None:
        for r in rows:
            until = f" until {r['expires_at']:%Y-%m-%d %H:%M} UTC" if r["expires_at"] else ""
            out.print(f"{r['name']:24} {r['role']:8} {r['state']}{until}")

    emit(rows, as_json, human)


def _token_state(token, at: datetime) -> str:
    if token.revoked_at:
        return "revoked"
    return "expired" if token.expires_at and token.expires_at <= at else "valid"
