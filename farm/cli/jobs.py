"""Commands about jobs and blobs: submit, status, jobs, logs, cancel, blobs, pull, run, workers.

Each works against the farm API when FARM_API_URL is set, else against the database and store
directly (`farm.cli.backend`); the output is the same either way.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

import click

from farm.cli import main
from farm.cli.common import (
    EXIT_BAD_INPUT,
    EXIT_JOB_FAILED,
    FarmCliError,
    backend,
    check_key,
    emit,
    err,
    handle_errors,
    json_option,
    out,
    print_blob,
    print_job,
    progress_bar,
    size_text,
    spec_options,
)
from farm.spec import CompileSpec, SpecError, Target


def specs_from_options(options: dict[str, Any]) -> list[CompileSpec]:
    """The spec flags as a matrix: `--device 3720,4000 --batch 1,4` gives four specs."""
    devices = _split(options["device"])
    tiles = (
        [int(t) if t else None for t in _split(options["tiles"])] if options["tiles"] else [None]
    )
    batches = [int(b) for b in _split(options["batch"])] if options["batch"] else [None]
    try:
        return [
            CompileSpec.create(
                device,
                tiles=tile,
                performance_hint=options["hint"],
                compiler_params=options["compiler_params"],
                shapes=options["shapes"],
                batch=batch,
                layout=options["layouts"],
                weightless=options["weightless"],
                config=options["configs"],
            )
            for device, tile, batch in itertools.product(devices, tiles, batches)
        ]
    except ValueError as error:
        if isinstance(error, SpecError):
            raise
        raise SpecError(f"--tiles and --batch take integers: {error}") from None


def _split(value: str | None) -> list[str]:
    return [part.strip() for part in str(value).split(",") if part.strip()] if value else []


def _digests():
    """sha256 of a file through the digest cache (path, size, mtime)."""
    from farm.config import get_settings
    from farm.digests import DigestCache

    cache = DigestCache(get_settings().cache_dir / "digests.json")
    return cache.sha256


@main.command()
@click.argument("model", type=click.Path(dir_okay=False, path_type=Path))
@spec_options(device_required=True)
@click.option("--wait/--no-wait", default=False, help="Follow queued jobs to their end.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bars.")
@json_option
@handle_errors
def submit(model: Path, wait: bool, quiet: bool, as_json: bool, **options: Any) -> None:
    """Compile MODEL for a target (or a matrix: --device 3720,4000 --batch 1,4).

    Embedded (nothing configured): compiles here, now. Served: queues jobs for workers, through
    the API when FARM_API_URL is set. A blob that already exists is a hit: nothing is uploaded.
    """
    from farm import compiler, hashing, service

    specs = specs_from_options(options)
    files = hashing.model_files(model)
    total = sum(f.stat().st_size for f in files.values())
    with progress_bar(f"hashing {model.name}", total, quiet or as_json) as advance:
        ref = service.ModelRef.from_path(model, advance, digests=_digests())
    for spec in specs:
        compiler.check_model(ref.files, spec)
    toolchain = _toolchain_for(specs)
    farm = backend()
    if hasattr(farm, "client"):
        upload = functools.partial(progress_bar, f"uploading {model.name}", quiet=quiet or as_json)
        answer = farm.submit(ref, specs, toolchain, upload)
    else:

        def compiling(spec):
            return (
                contextlib.nullcontext()
                if as_json
                else err.status(f"compiling {ref.name} for {spec.summary()}")
            )

        answer = farm.submit(ref, specs, toolchain, compiling)
    if wait:
        for result in answer["results"]:
            if result["job"] and result["job"]["state"] not in ("succeeded", "failed", "cancelled"):
                result["job"] = _wait(farm, result["job"]["id"], quiet or as_json)
    _print_submission(answer, as_json)
    states = [r["job"]["state"] for r in answer["results"] if r["job"]]
    if any(state in ("failed", "cancelled") for state in states):
        sys.exit(EXIT_JOB_FAILED)


def _toolchain_for(specs: list[CompileSpec]):
    """This host's toolchain, with the CPU runtime requirements when a spec targets CPU."""
    from farm import compiler

    cpu = next((s.target for s in specs if not s.target.is_npu), None)
    return compiler.host_toolchain(cpu or specs[0].target)


def _wait(farm, job_id: int, quiet: bool) -> dict:
    from farm.cli.backend import wait_for

    status = contextlib.nullcontext() if quiet else err.status(f"waiting for job {job_id}")
    with status as shown:
        return wait_for(
            farm, job_id, lambda state: shown and shown.update(f"job {job_id}: {state}")
        )


def _print_submission(answer: dict, as_json: bool) -> None:
    results = answer["results"]
    if len(results) == 1:
        data = {k: v for k, v in results[0].items() if k != "target"}
        if data["job"] is None:
            del data["job"]
        elif data["job"].get("note"):
            data["note"] = data["job"]["note"]
    else:
        data = answer

    def human() -> None:
        for result in results:
            out.print(f"cache key  {result['cache_key']}  ({result['target']})")
            if result["job"] is None:
                out.print("outcome    hit (the blob exists; nothing compiled)")
            else:
                print_job(result["job"])

    emit(data, as_json, human)


@main.command()
@click.argument("job_or_key")
@json_option
@handle_errors
def status(job_or_key: str, as_json: bool) -> None:
    """Show a job (by number) or a cache key (its blob, or its latest job)."""
    from farm.errors import NotFound

    farm = backend()
    if job_or_key.isdigit():
        job = farm.job(int(job_or_key))
        emit(job, as_json, functools.partial(print_job, job))
        return
    key = check_key(job_or_key)
    blob, job = farm.resolve(key), farm.latest_job(key)
    if blob is None and job is None:
        raise NotFound(f"no blob and no job for cache key {key}")

    def human() -> None:
        out.print(f"cache key  {key}")
        if blob is not None:
            print_blob(blob)
        if job is not None:
            print_job(job)

    emit({"cache_key": key, "blob": blob, "job": job}, as_json, human)


@main.command()
@click.option(
    "--state", type=click.Choice(["queued", "running", "succeeded", "failed", "cancelled"])
)
@click.option("--target", help="Only jobs for this target.")
@click.option("--model", help="Only jobs of this model (digest or file name).")
@click.option("--submitter", help="Only jobs of this submitter (token name).")
@click.option("--since", type=click.DateTime(), help="Only jobs created since (UTC).")
@click.option("--limit", type=click.IntRange(1, 1000), default=50, show_default=True)
@json_option
@handle_errors
def jobs(
    state, target, model, submitter, since: datetime | None, limit: int, as_json: bool
) -> None:
    """List jobs, newest first."""
    from rich.table import Table

    rows = backend().jobs(
        state=state,
        target=target,
        model=model,
        submitter=submitter,
        since=since.isoformat() if since else None,
        limit=limit,
    )

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
    click.echo(backend().log(job_id) or f"job {job_id} has no log yet")


@main.command()
@click.argument("job_id", type=int)
@json_option
@handle_errors
def cancel(job_id: int, as_json: bool) -> None:
    """Cancel a job: a queued job never starts; a running compile is stopped by its worker."""
    job = backend().cancel(job_id)
    emit(job, as_json, functools.partial(print_job, job))


@main.command()
@click.option("--target", help="Only blobs for this target.")
@json_option
@handle_errors
def blobs(target: str | None, as_json: bool) -> None:
    """List the stored blobs, newest first."""
    from rich.table import Table

    rows = backend().blobs(target)

    def human() -> None:
        table = Table("cache key", "target", "OpenVINO", "size", "compile s", "created")
        for row in rows:
            table.add_row(
                row["cache_key"][:16],
                row["target"],
                row["openvino"],
                size_text(row["size_bytes"]),
                f"{row['compile_seconds'] or 0:.2f}",
                str(row["created_at"])[:19],
            )
        out.print(table)

    emit(rows, as_json, human)


@main.command()
@click.option("--all", "show_all", is_flag=True, help="Include stopped and silent workers.")
@json_option
@handle_errors
def workers(show_all: bool, as_json: bool) -> None:
    """List the workers: what each serves and when it was last seen."""
    from rich.table import Table

    rows = [w for w in backend().workers() if show_all or w["live"]]

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
@click.argument("key_or_model")
@click.option(
    "--output",
    "-o",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="Where to write the blob.",
)
@spec_options(device_required=False)
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@json_option
@handle_errors
def pull(key_or_model: str, output: Path, quiet: bool, as_json: bool, **options: Any) -> None:
    """Fetch a blob by CACHE_KEY, or by MODEL + spec flags (the key an edge would compute)."""
    if options["device"] is None:
        key = check_key(key_or_model)
    else:
        from farm import service

        specs = specs_from_options(options)
        if len(specs) != 1:
            raise SpecError("pull takes one spec, not a matrix: one --device, --tiles, --batch")
        spec = specs[0]
        ref = service.ModelRef.from_path(key_or_model, digests=_digests())
        key = service.key_for(ref.identity, spec, _toolchain_for([spec]))
    farm = backend()
    blob = farm.resolve(key)
    if blob is None:
        from farm.errors import NotFound

        raise NotFound(f"the farm has no blob for cache key {key}; submit it first")
    with progress_bar(f"downloading {key[:12]}", blob["size_bytes"], quiet or as_json) as advance:
        farm.fetch(key, output, advance)
    data = {"cache_key": key, "output": str(output), **blob}
    emit(
        data,
        as_json,
        lambda: out.print(
            f"wrote {output} ({size_text(blob['size_bytes'])}, sha256 {blob['sha256'][:16]}…, "
            f"{blob['target']})"
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
    from farm.edge import import_blob, infer_once

    target = Target.parse(device)
    try:
        imported = import_blob(blob, target.device, weights)
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
