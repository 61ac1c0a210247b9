"""Commands about jobs and blobs: submit, status, jobs, logs, cancel, blobs, pull, run."""

from __future__ import annotations

import functools
import sys
import time
from pathlib import Path
from typing import Any

import click

from farm.cli import main
from farm.cli.common import (
    EXIT_BAD_INPUT,
    EXIT_JOB_FAILED,
    FarmCliError,
    blob_dict,
    check_key,
    emit,
    err,
    handle_errors,
    job_dict,
    json_option,
    local_farm,
    out,
    print_blob,
    print_job,
    size_text,
    spec_from_options,
    spec_options,
)
from farm.spec import Target

FINAL_STATES = ("succeeded", "failed", "cancelled")
WAIT_POLL_SECONDS = 0.5


@main.command()
@click.argument("model", type=click.Path(dir_okay=False, path_type=Path))
@spec_options(device_required=True)
@click.option("--wait/--no-wait", default=False, help="Served mode: follow the job to its end.")
@json_option
@handle_errors
def submit(model: Path, wait: bool, as_json: bool, **options: Any) -> None:
    """Compile MODEL for a target, or report the blob that already exists (a hit).

    Embedded (no FARM_BROKER_URL): compiles here, now. Served: queues the job for a worker.
    """
    from farm import compiler, routing, service

    spec = spec_from_options(options)
    ref = service.ModelRef.from_path(model)
    compiler.check_model(ref.files, spec)
    toolchain = compiler.host_toolchain(spec.target)
    farm = local_farm()
    settings = farm.settings
    key = service.key_for(ref.identity, spec, toolchain)
    with farm.session() as session:
        if not settings.served and service.resolve(session, key) is None:
            # Embedded mode compiles here: refuse a target this host cannot compile before
            # anything is stored.
            reason = compiler.unavailable_reason(spec.target)
            if reason:
                raise compiler.CompilerUnavailable(reason)
        queue = "embedded"
        if settings.served:
            queue = routing.queue_name(spec.target, ref.size_bytes > settings.large_model_bytes)
        submission = service.submit(session, farm.store, ref, spec, toolchain, queue=queue)
        job = None
        if submission.outcome == "queued" and settings.served:
            farm.dispatcher().send(session, submission.job_id, queue)
        elif submission.outcome == "queued":
            with err.status(f"compiling {ref.name} for {spec.summary()}"):
                job = farm.run(submission.job_id)
        if submission.job_id is not None:
            job = job or service.get_job(session, submission.job_id)
            if wait and job.state not in FINAL_STATES:
                job = _wait_for(farm, job.id)
        data = {"outcome": submission.outcome, "cache_key": submission.cache_key}
        note = _unserved_note(farm, session, job)
        if job is not None:
            data["job"] = job_dict(job)
        if note:
            data["note"] = note

    def human() -> None:
        out.print(f"cache key  {submission.cache_key}")
        if job is None:
            out.print("outcome    hit (the blob exists; nothing compiled)")
        else:
            print_job(job)
        if note:
            out.print(f"note       {note}", markup=False)

    emit(data, as_json, human)
    if job is not None and job.state in ("failed", "cancelled"):
        sys.exit(EXIT_JOB_FAILED)


def _wait_for(farm, job_id: int):
    from farm import service

    with err.status(f"waiting for job {job_id}") as status:
        while True:
            with farm.session() as session:
                job = service.get_job(session, job_id)
            if job.state in FINAL_STATES:
                return job
            status.update(f"job {job_id}: {job.state}")
            time.sleep(WAIT_POLL_SECONDS)


def _unserved_note(farm, session, job) -> str | None:
    """A queued job nobody can take says so, instead of waiting silently."""
    from farm import routing

    if job is None or job.state != "queued" or job.queue == "embedded":
        return None
    if routing.is_served(session, job.queue, farm.settings.worker_heartbeat_seconds):
        return None
    return f"no live worker serves {job.queue}; the job waits until one starts (farm workers)"


@main.command()
@click.argument("job_or_key")
@json_option
@handle_errors
def status(job_or_key: str, as_json: bool) -> None:
    """Show a job (by number) or a cache key (its blob, or its latest job)."""
    from farm import service

    farm = local_farm()
    with farm.session() as session:
        if job_or_key.isdigit():
            job = service.get_job(session, int(job_or_key))
            data = job_dict(job)
            note = _unserved_note(farm, session, job)
            if note:
                data["note"] = note

            def human() -> None:
                print_job(job)
                if note:
                    out.print(f"note       {note}", markup=False)

        else:
            key = check_key(job_or_key)
            blob = service.resolve(session, key)
            job = service.latest_job_for_key(session, key)
            if blob is None and job is None:
                raise service.NotFound(f"no blob and no job for cache key {key}")
            data = {
                "cache_key": key,
                "blob": blob_dict(blob) if blob else None,
                "job": job_dict(job) if job else None,
            }

            def human() -> None:
                out.print(f"cache key  {key}")
                if blob is not None:
                    print_blob(blob)
                if job is not None:
                    print_job(job)

        emit(data, as_json, human)


@main.command()
@click.option(
    "--state", type=click.Choice(["queued", "running", "succeeded", "failed", "cancelled"])
)
@click.option("--target", help="Only jobs for this target.")
@click.option("--limit", type=click.IntRange(1, 10_000), default=50, show_default=True)
@json_option
@handle_errors
def jobs(state: str | None, target: str | None, limit: int, as_json: bool) -> None:
    """List jobs, newest first."""
    from rich.table import Table

    from farm import service

    with local_farm().session() as session:
        rows = [job_dict(j) for j in service.list_jobs(session, state, target, limit)]

    def human() -> None:
        table = Table("job", "target", "state", "queue", "created", "error")
        for row in rows:
            table.add_row(
                str(row["id"]),
                row["target"],
                row["state"],
                row["queue"],
                str(row["created_at"])[:19],
                (row["error"] or "")[:60],
            )
        out.print(table)

    emit(rows, as_json, human)


@main.command()
@click.argument("job_id", type=int)
@handle_errors
def logs(job_id: int) -> None:
    """Print a job's log: the properties used, timings, and the compiler's output."""
    from farm import service

    with local_farm().session() as session:
        job = service.get_job(session, job_id)
        click.echo(job.log or job.error or f"job {job_id} has no log yet ({job.state})")


@main.command()
@click.argument("job_id", type=int)
@json_option
@handle_errors
def cancel(job_id: int, as_json: bool) -> None:
    """Cancel a job: a queued job never starts; a running compile is stopped by its worker."""
    from farm import service

    with local_farm().session() as session:
        job = service.cancel(session, job_id)
    emit(job_dict(job), as_json, functools.partial(print_job, job))


@main.command()
@click.option("--target", help="Only blobs for this target.")
@json_option
@handle_errors
def blobs(target: str | None, as_json: bool) -> None:
    """List the stored blobs, newest first."""
    from rich.table import Table

    from farm import service

    with local_farm().session() as session:
        rows = [blob_dict(blob) for blob in service.list_blobs(session, target)]

    def human() -> None:
        table = Table("cache key", "target", "OpenVINO", "size", "compile s", "created")
        for row in rows:
            table.add_row(
                row["cache_key"][:16],
                row["target"],
                row["openvino"],
                size_text(row["size_bytes"]),
                f"{row['compile_seconds']:.2f}",
                str(row["created_at"])[:19],
            )
        out.print(table)

    emit(rows, as_json, human)


@main.command()
@click.argument("key_or_model")
@click.option(
    "--output",
    "-o",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="Where to write the blob.",
)
@spec_options(device_required=False)
@json_option
@handle_errors
def pull(key_or_model: str, output: Path, as_json: bool, **options: Any) -> None:
    """Fetch a blob by CACHE_KEY, or by MODEL + spec flags (the key an edge would compute)."""
    from farm import service

    if options["device"] is None:
        key = check_key(key_or_model)
    else:
        from farm import compiler

        spec = spec_from_options(options)
        ref = service.ModelRef.from_path(key_or_model)
        key = service.key_for(ref.identity, spec, compiler.host_toolchain(spec.target))
    farm = local_farm()
    with farm.session() as session:
        blob = service.resolve(session, key)
        if blob is None:
            raise service.NotFound(f"the farm has no blob for cache key {key}; submit it first")
        data = {"cache_key": key, "output": str(output), **blob_dict(blob)}
        service.fetch_blob(farm.store, blob, output)
    emit(
        data,
        as_json,
        lambda: out.print(
            f"wrote {output} ({size_text(blob.size_bytes)}, sha256 {blob.sha256[:16]}…, "
            f"{blob.target})"
        ),
    )


@main.command()
@click.argument("blob", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--device", "-d", required=True, help="Device to import on: CPU or NPU.")
@click.option(
    "--weights",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="The model's .bin, for a weightless blob.",
)
@json_option
@handle_errors
def run(blob: Path, device: str, weights: Path | None, as_json: bool) -> None:
    """Import BLOB with OpenVINO and run one inference on random input."""
    from farm.blobformat import BlobFormatError
    from farm.edge import import_blob, infer_once

    target = Target.parse(device)
    try:
        imported = import_blob(blob, target.device, weights)
    except BlobFormatError as error:
        raise FarmCliError(str(error), EXIT_BAD_INPUT) from error
    except RuntimeError as error:
        raise FarmCliError(f"OpenVINO cannot import {blob}: {error}", EXIT_BAD_INPUT) from error
    result = infer_once(imported)
    data = {
        "blob": str(blob),
        "device": target.device,
        "import_seconds": imported.import_seconds,
        **result,
    }
    emit(
        data,
        as_json,
        lambda: out.print(
            f"imported {blob.name} on {target.device} in {imported.import_seconds * 1000:.1f} ms; "
            f"one inference {result['latency_seconds'] * 1000:.2f} ms; outputs {result['outputs']}"
        ),
    )
