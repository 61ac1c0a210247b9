"""Commands that read jobs and blobs (status, jobs, blobs, workers) or act on one job (logs,
cancel); `farm submit` is `farm.cli.submit`.

Each works against the farm API when FARM_API_URL is set, else against the database and store
directly (`farm.cli.backend`); the output is the same either way. The `farm` group loads this
module only for its own commands (`farm.cli.COMMANDS`): listing starts without what a
submission needs.
"""

from __future__ import annotations

import functools
from datetime import UTC, datetime
from typing import Any

import click
from rich.table import Table

from farm.cli import main
from farm.cli.common import (
    backend,
    cell,
    emit,
    handle_errors,
    json_option,
    out,
    print_blob,
    print_job,
    resolve_key,
    size_text,
)
from farm.core import keyprefix
from farm.core.errors import NotFound, SpecError
from farm.core.text import converters_text, printable, toolchains_text
from farm.core.vocabulary import JOB_STATES


def _compressed_cell(compressed: dict[str, Any] | None) -> str:
    """`int4_sym 0.144x` for a blob of a compressed model (`farm blobs`); empty otherwise."""
    if not compressed:
        return ""
    what = compressed["args"].get("mode") or compressed["args"].get("precision")
    ratio = (compressed.get("metrics") or {}).get("ratio")
    return f"{what} {ratio:.3g}x" if ratio else str(what)


@main.command()
@click.argument("job_or_key")
@json_option
@handle_errors
def status(job_or_key: str, as_json: bool) -> None:
    """Show a job (by number) or a cache key (its blob, or its latest job); a unique prefix of
    the key (8 hex characters or more) will do."""
    if not job_or_key.isdigit():
        keyprefix.normalize(job_or_key)  # a bad key fails before any farm is opened
    farm = backend()
    if job_or_key.isdigit():
        try:
            job = farm.job(int(job_or_key))
        except NotFound:
            # Eight digits or more may also be a key prefix (git's rule): try that too.
            if len(job_or_key) < keyprefix.MIN_PREFIX:
                raise
        else:
            emit(job, as_json, functools.partial(print_job, job))
            return
    key = resolve_key(farm, job_or_key)
    blob, latest = farm.resolve(key), farm.latest_job(key)
    if blob is None and latest is None:
        build = farm.bundle_build(key)  # a pipeline bundle's key (§17)
        if build is not None:
            from farm.cli.pipelines import emit_build

            emit_build(build, as_json)
            return
        raise NotFound(f"no blob, job or bundle for key {key}")

    def human() -> None:
        out.print(f"cache key  {key}")
        if blob is not None:
            print_blob(blob)
        if latest is not None:
            print_job(latest)

    emit({"cache_key": key, "blob": blob, "job": latest}, as_json, human)


@main.command()
@click.option("--state", type=click.Choice(JOB_STATES))
@click.option("--target", help="Only jobs for this target.")
@click.option("--model", help="Only jobs of this model (digest or file name).")
@click.option("--submitter", help="Only jobs of this submitter (token name).")
@click.option("--since", type=click.DateTime(), help="Only jobs created since (UTC).")
@click.option("--limit", type=click.IntRange(1), default=50, show_default=True)
@json_option
@handle_errors
def jobs(
    state, target, model, submitter, since: datetime | None, limit: int, as_json: bool
) -> None:
    """List jobs, newest first."""
    for flag, value in (("--model", model), ("--submitter", submitter)):
        if value is not None and not value.isprintable():
            raise SpecError(f"{flag} {value!r} has control characters or is not UTF-8")
    rows = backend().jobs(
        state=state,
        target=target,
        model=model,
        submitter=submitter,
        since=since.replace(tzinfo=UTC) if since else None,
        limit=limit,
    )

    def human() -> None:
        table = Table("job", "model", "target", "state", "queue", "created", "error")
        for row in rows:
            table.add_row(
                cell(row["id"]),
                cell(row.get("model_name")),
                cell(row["target"]),
                cell(row["state"]),
                cell(row["queue"]),
                cell(str(row["created_at"])[:19]),
                cell((row["error"] or "")[:60]),
            )
        out.print(table)

    emit(rows, as_json, human)


@main.command()
@click.argument("job_id", type=int)
@json_option
@handle_errors
def logs(job_id: int, as_json: bool) -> None:
    """Print a job's log: the properties used, timings, and the compiler's output."""
    entry = backend().log(job_id)
    emit(
        entry,
        as_json,
        lambda: click.echo(printable(entry["log"]) or f"job {job_id} has no log yet"),
    )


@main.command()
@click.argument("job_id", type=int)
@json_option
@handle_errors
def cancel(job_id: int, as_json: bool) -> None:
    """Cancel a job: a queued job never starts; a running compile is stopped by its worker."""
    job = backend().cancel(job_id)
    emit(job, as_json, functools.partial(print_job, job))


@main.group(invoke_without_command=True)
@click.option("--target", help="Only blobs for this target.")
@click.option("--limit", type=click.IntRange(1), default=100, show_default=True)
@click.option("--all", "show_all", is_flag=True, help="Every blob (read a page at a time).")
@json_option
@click.pass_context
@handle_errors
def blobs(
    context: click.Context, target: str | None, limit: int, show_all: bool, as_json: bool
) -> None:
    """List the stored blobs, newest first (or quarantine and release one: the subcommands)."""
    if context.invoked_subcommand is not None:
        return
    rows = backend().blobs(target, None if show_all else limit)

    def human() -> None:
        headers = (
            *("cache key", "model", "target", "OpenVINO", "size", "compile s", "created"),
            *("state", "compressed"),
        )
        cells = [
            [
                row["cache_key"],
                row.get("model_name") or "",
                row["target"],
                row["openvino"],
                size_text(row["size_bytes"]),
                f"{row['compile_seconds'] or 0:.2f}",
                str(row["created_at"])[:19],
                "QUARANTINED" if row.get("quarantined_at") else "",
                _compressed_cell(row.get("compression")),
            ]
            for row in rows
        ]
        width = _key_width(headers, cells, out.width)
        table = Table(*headers)
        for line in cells:
            key = line[0] if width >= len(line[0]) else line[0][: width - 1] + "…"
            table.add_row(cell(key), *(cell(value) for value in line[1:]))
        out.print(table)

    emit(rows, as_json, human)


@main.command()
@click.option("--all", "show_all", is_flag=True, help="Include stopped and silent workers.")
@json_option
@handle_errors
def workers(show_all: bool, as_json: bool) -> None:
    """List the workers: what each serves and when it was last seen."""
    rows = [w for w in backend().workers() if show_all or w["live"]]

    def human() -> None:
        table = Table(
            "worker", "live", "toolchains", "converters", "memory", "OpenVINO", "last seen"
        )
        for row in rows:
            table.add_row(
                cell(row["name"]),
                "yes" if row["live"] else "no",
                cell(toolchains_text(row.get("toolchains"))),
                cell(converters_text(row.get("converters"))),
                size_text(row["memory_bytes"]),
                cell(row["openvino"].split("-")[0]),
                cell(str(row["heartbeat_at"])[:19]),
            )
        out.print(table)

    emit(rows, as_json, human)


def _key_width(headers: tuple[str, ...], cells: list[list[str]], terminal: int) -> int:
    """Room for the cache key (the first column) once the other columns have theirs: the whole
    key (what `farm status` and edges take) where the terminal allows, at least 16 characters."""
    others = sum(
        max([len(header), *(len(line[n]) for line in cells)]) + 3
        for n, header in enumerate(headers)
        if n
    )
    return max(16, terminal - others - 4)
