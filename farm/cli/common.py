"""Shared pieces of the `farm` command: exit codes, error mapping, spec flags, output."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

import click
from rich.console import Console

from farm import hashing
from farm.config import get_settings
from farm.spec import CompileSpec, SpecError

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
        from sqlalchemy.exc import OperationalError

        from farm.compiler import CompileError, CompilerUnavailable
        from farm.doctor import ServiceUnavailable
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
        except (StorageError, ServiceUnavailable) as error:
            raise FarmCliError(str(error), EXIT_INFRASTRUCTURE) from error
        except OperationalError as error:
            first = str(error.orig or error).strip().splitlines()[0]
            raise FarmCliError(
                f"database error (FARM_DATABASE_URL): {first}", EXIT_INFRASTRUCTURE
            ) from error

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


def check_key(text: str) -> str:
    key = text.strip().lower()
    if len(key) != 64 or any(ch not in "0123456789abcdef" for ch in key):
        raise FarmCliError(
            f"{text!r} is neither a job number nor a 64-hex cache key", EXIT_BAD_INPUT
        )
    return key


def job_dict(job) -> dict[str, Any]:
    return {
        "id": job.id,
        "cache_key": job.cache_key,
        "target": job.target,
        "state": job.state,
        "queue": job.queue,
        "worker": job.worker,
        "submitter": job.submitter,
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
            f"{job.export_seconds:.2f} s, peak RSS {size_text(job.peak_rss_bytes or 0)}"
        )
    if job.error:
        out.print(f"error      {job.error}", markup=False)


def print_blob(blob) -> None:
    out.print(
        f"blob       {blob.target}, OpenVINO {blob.openvino_version}, "
        f"{size_text(blob.size_bytes)}, sha256 {blob.sha256}"
    )


def size_text(count: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return str(count)


def hide_password(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)
