"""The `farm` command. Exit codes (README "Exit codes") are part of the interface."""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from rich.console import Console

from farm import hashing
from farm.config import get_settings
from farm.spec import CompileSpec, SpecError, Target

EXIT_OK = 0
EXIT_JOB_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_NOT_FOUND = 3
EXIT_COMPILER_UNAVAILABLE = 4
EXIT_INFRASTRUCTURE = 5

out = Console(highlight=False)
err = Console(stderr=True, highlight=False)


class FarmCliError(click.ClickException):
    """One line on stderr and an exit code from the table above."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code

    def show(self, file: Any = None) -> None:
        click.echo(f"farm: error: {self.message}", err=True)


def handle_errors(command: Callable) -> Callable:
    """Map the errors a user can meet to one clear line and a documented exit code."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from farm.compiler import CompileError, CompilerUnavailable
        from farm.service import NotFound
        from farm.storage import StorageError

        try:
            return command(*args, **kwargs)
        except (SpecError, hashing.ModelFileError, CompileError) as error:
            raise FarmCliError(str(error), EXIT_BAD_INPUT) from error
        except NotFound as error:
            raise FarmCliError(str(error), EXIT_NOT_FOUND) from error
        except CompilerUnavailable as error:
            raise FarmCliError(str(error), EXIT_COMPILER_UNAVAILABLE) from error
        except StorageError as error:
            raise FarmCliError(f"storage: {error}", EXIT_INFRASTRUCTURE) from error

    return wrapper


def spec_options(device_required: bool) -> Callable[[Callable], Callable]:
    """The compile-spec flags, shared by `submit` and `pull MODEL`."""
    options = [
        click.option(
            "--device", "-d", required=device_required, help="NPU platform (4000, NPU.4000) or CPU."
        ),
        click.option("--tiles", type=int, help="NPU tiles (1 to the platform's maximum)."),
        click.option("--hint", help="Performance hint: LATENCY or THROUGHPUT."),
        click.option(
            "--compiler-params",
            help="NPU compiler parameters ('optimization-level=2 ...').",
        ),
        click.option(
            "--shape", "shapes", multiple=True, help="Input shape NAME[d1,d2,...]; repeatable."
        ),
        click.option("--batch", type=int, help="Batch size, set on the layout's N axis."),
        click.option(
            "--layout", "layouts", multiple=True, help="Input layout NAME:NCHW; repeatable."
        ),
        click.option(
            "--weightless", is_flag=True, help="Blob without weights; edges supply the .bin."
        ),
        click.option(
            "--config", "configs", multiple=True, help="Extra OpenVINO property KEY=VALUE."
        ),
    ]

    def decorate(command: Callable) -> Callable:
        for option in reversed(options):
            command = option(command)
        return command

    return decorate


def spec_from_options(options: dict[str, Any]) -> CompileSpec:
    return CompileSpec.create(
        options.pop("device"),
        tiles=options.pop("tiles"),
        performance_hint=options.pop("hint"),
        compiler_params=options.pop("compiler_params"),
        shapes=options.pop("shapes"),
        batch=options.pop("batch"),
        layout=options.pop("layouts"),
        weightless=options.pop("weightless"),
        config=options.pop("configs"),
    )


json_option = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")


def emit(data: dict[str, Any] | list, as_json: bool, human: Callable[[], None]) -> None:
    if as_json:
        click.echo(json.dumps(data, indent=2, default=str))
    else:
        human()


def local_farm():
    from farm.local import LocalFarm

    return LocalFarm.open(get_settings())


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="farm")
def main() -> None:
    """farm: compile OpenVINO models once, import the blobs everywhere."""


@main.command()
@click.argument("model", type=click.Path(dir_okay=False, path_type=Path))
@spec_options(device_required=True)
@json_option
@handle_errors
def submit(model: Path, as_json: bool, **options: Any) -> None:
    """Compile MODEL for a target, or report the blob that already exists (a hit)."""
    from farm import compiler, service

    spec = spec_from_options(options)
    ref = service.ModelRef.from_path(model)
    compiler.check_model(ref.files, spec)
    toolchain = compiler.host_toolchain(spec.target)
    farm = local_farm()
    key = service.key_for(ref.identity, spec, toolchain)
    with farm.session() as session:
        if service.resolve(session, key) is None:
            # Embedded mode compiles here: refuse a target this host cannot compile before
            # anything is stored.
            reason = compiler.unavailable_reason(spec.target)
            if reason:
                raise compiler.CompilerUnavailable(reason)
        submission = service.submit(session, farm.store, ref, spec, toolchain)
        job = None
        if submission.outcome == "queued":
            with err.status(f"compiling {ref.name} for {spec.summary()}"):
                job = service.run_job(session, farm.store, submission.job_id)
        elif submission.job_id is not None:
            job = service.get_job(session, submission.job_id)
        data = {"outcome": submission.outcome, "cache_key": submission.cache_key}
        if job is not None:
            data["job"] = job_dict(job)

    def human() -> None:
        out.print(f"cache key  {submission.cache_key}")
        if job is None:
            out.print("outcome    hit (the blob exists; nothing compiled)")
        else:
            print_job(job)

    emit(data, as_json, human)
    if job is not None and job.state in ("failed", "cancelled"):
        sys.exit(EXIT_JOB_FAILED)


@main.command()
@click.argument("job_or_key")
@json_option
@handle_errors
def status(job_or_key: str, as_json: bool) -> None:
    """Show a job (by number) or a cache key (its blob, or its latest job)."""
    from farm import service

    with local_farm().session() as session:
        if job_or_key.isdigit():
            job = service.get_job(session, int(job_or_key))
            data, human = job_dict(job), functools.partial(print_job, job)
        else:
            key = _check_key(job_or_key)
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
                _size(row["size_bytes"]),
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
        key = _check_key(key_or_model)
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
            f"wrote {output} ({_size(blob.size_bytes)}, sha256 {blob.sha256[:16]}…, {blob.target})"
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
    out.print(f"database at head: {_hide_password(url)}")


def job_dict(job) -> dict[str, Any]:
    return {
        "id": job.id,
        "cache_key": job.cache_key,
        "target": job.target,
        "state": job.state,
        "spec": job.spec,
        "error": job.error,
        "attempts": job.attempts,
        "created_at": job.created_at,
        "started_at": job.started_at,
        "finished_at": job.finished_at,
        "compile_seconds": job.compile_seconds,
        "export_seconds": job.export_seconds,
        "peak_rss_bytes": job.peak_rss_bytes,
    }


def blob_dict(blob) -> dict[str, Any]:
    return {
        "cache_key": blob.cache_key,
        "target": blob.target,
        "openvino": blob.openvino_version,
        "toolchain": blob.toolchain,
        "size_bytes": blob.size_bytes,
        "sha256": blob.sha256,
        "weightless": blob.weightless,
        "compile_seconds": blob.compile_seconds,
        "export_seconds": blob.export_seconds,
        "created_at": blob.created_at,
    }


def print_job(job) -> None:
    out.print(f"job        {job.id} ({job.target}): {job.state}")
    if job.compile_seconds is not None:
        out.print(
            f"timings    compile {job.compile_seconds:.2f} s, export "
            f"{job.export_seconds:.2f} s, peak RSS {_size(job.peak_rss_bytes or 0)}"
        )
    if job.error:
        out.print(f"error      {job.error}", markup=False)


def print_blob(blob) -> None:
    out.print(
        f"blob       {blob.target}, OpenVINO {blob.openvino_version}, "
        f"{_size(blob.size_bytes)}, sha256 {blob.sha256}"
    )


def _check_key(text: str) -> str:
    key = text.strip().lower()
    if len(key) != 64 or any(ch not in "0123456789abcdef" for ch in key):
        raise FarmCliError(
            f"{text!r} is neither a job number nor a 64-hex cache key", EXIT_BAD_INPUT
        )
    return key


def _size(count: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return str(count)


def _hide_password(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)
