"""Commands for operators: worker, workers, doctor, reconcile, db upgrade."""

from __future__ import annotations

import click

from farm.cli import main
from farm.cli.common import (
    EXIT_INFRASTRUCTURE,
    emit,
    handle_errors,
    hide_password,
    json_option,
    local_farm,
    out,
    size_text,
)
from farm.config import get_settings


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
    from workers.main import run_worker

    settings = get_settings()
    if not settings.served:
        raise click.UsageError(
            "farm worker needs FARM_BROKER_URL (and a shared database "
            "and store); the embedded farm compiles in `farm submit`"
        )
    run_worker(settings, concurrency=concurrency, name=name, beat=beat, loglevel=loglevel)


@main.command()
@click.option("--all", "show_all", is_flag=True, help="Include stopped and silent workers.")
@json_option
@handle_errors
def workers(show_all: bool, as_json: bool) -> None:
    """List the workers: what each serves and when it was last seen."""
    from rich.table import Table

    from farm import routing

    farm = local_farm()
    with farm.session() as session:
        live = {
            w.name for w in routing.live_workers(session, farm.settings.worker_heartbeat_seconds)
        }
        rows = [
            {
                "name": w.name,
                "host": w.host,
                "live": w.name in live,
                "queues": w.queues,
                "targets": w.targets,
                "openvino": w.openvino_version,
                "memory_bytes": w.memory_bytes,
                "heartbeat_at": w.heartbeat_at,
                "stopped_at": w.stopped_at,
            }
            for w in routing.all_workers(session)
            if show_all or w.name in live
        ]

    def human() -> None:
        table = Table("worker", "live", "queues", "memory", "OpenVINO", "last seen")
        for row in rows:
            table.add_row(
                row["name"],
                "yes" if row["live"] else "no",
                ", ".join(row["queues"]),
                size_text(row["memory_bytes"]),
                row["openvino"].split("-")[0],
                str(row["heartbeat_at"])[:19],
            )
        out.print(table)

    emit(rows, as_json, human)


@main.command()
@json_option
def doctor(as_json: bool) -> None:
    """What this host has (OpenVINO, devices, NPU libraries, targets) and which services answer."""
    from farm.doctor import openvino_checks, service_checks

    checks = openvino_checks() + service_checks(get_settings())
    rows = [{"check": c.name, "ok": c.ok, "detail": c.detail} for c in checks]

    def human() -> None:
        for c in checks:
            mark = "[green]ok[/]     " if c.ok else "[red]missing[/]"
            out.print(f"{mark} {c.name}: ", end="")
            out.print(c.detail, markup=False)

    emit(rows, as_json, human)
    if any(not c.ok for c in checks if c.name in ("database", "broker", "storage")):
        raise SystemExit(EXIT_INFRASTRUCTURE)


@main.command()
@json_option
@handle_errors
def reconcile(as_json: bool) -> None:
    """One reconciler pass: re-send lost messages, take back expired leases, fail stuck jobs."""
    from dataclasses import asdict

    from farm.reconcile import reconcile as reconcile_once

    farm = local_farm()
    with farm.session() as session:
        dispatcher = farm.dispatcher() if farm.settings.served else None

        def send(job_id: int, queue: str) -> None:
            if dispatcher is not None:
                dispatcher.send(session, job_id, queue)

        report = reconcile_once(session, farm.store, farm.settings, send)
    emit(
        asdict(report),
        as_json,
        lambda: out.print(
            f"failed {report.failed}, taken back {report.taken_back}, re-sent {report.resent}, "
            f"aborted uploads {len(report.aborted_uploads)}"
        ),
    )


@main.group()
def db() -> None:
    """Database schema."""


@db.command("upgrade")
@handle_errors
def db_upgrade() -> None:
    """Bring the database schema to the latest migration."""
    from farm.db.session import upgrade_database

    url = get_settings().resolved_database_url
    upgrade_database(url)
    out.print(f"database at head: {hide_password(url)}")
