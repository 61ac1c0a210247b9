"""Shared pieces of the `farm` command: exit codes, error mapping, spec flags, output."""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Callable
from typing import Any

import click
from rich.console import Console

from farm.config import get_settings

EXIT_OK = 0
EXIT_JOB_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_NOT_FOUND = 3
EXIT_COMPILER_UNAVAILABLE = 4
EXIT_INFRASTRUCTURE = 5
EXIT_UNAUTHORIZED = 6

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
        try:
            return command(*args, **kwargs)
        except click.ClickException:
            raise
        except Exception as error:
            exit_code = exit_code_for(error)
            if exit_code is None:
                raise
            raise FarmCliError(_one_line(error), exit_code) from error

    return wrapper


# Error classes by name and module, so that an edge install (no SQLAlchemy, no boto3) can
# still map what it meets without importing what it does not have.
_EXIT_CODES = {
    "farm.spec.SpecError": EXIT_BAD_INPUT,
    "farm.hashing.ModelFileError": EXIT_BAD_INPUT,
    "farm.compiler.CompileError": EXIT_BAD_INPUT,
    "farm.compiler.ModelError": EXIT_BAD_INPUT,
    "farm.tokens.TokenError": EXIT_BAD_INPUT,
    "farm.blobformat.BlobFormatError": EXIT_BAD_INPUT,
    "farm.edge.cache.CacheError": EXIT_BAD_INPUT,
    "farm.errors.NotFound": EXIT_NOT_FOUND,
    "farm.edge.BlobNotAvailable": EXIT_NOT_FOUND,
    "farm.compiler.CompilerUnavailable": EXIT_COMPILER_UNAVAILABLE,
    "farm.edge.agent.Incompatible": EXIT_COMPILER_UNAVAILABLE,
    "farm.edge.agent.DiskFull": EXIT_INFRASTRUCTURE,
    "farm.signing.SignatureError": EXIT_INFRASTRUCTURE,
    "farm.signing.KeyFileError": EXIT_BAD_INPUT,
    "farm.errors.IntegrityMismatch": EXIT_INFRASTRUCTURE,
    "farm.errors.WorkDiskFull": EXIT_INFRASTRUCTURE,
    "farm.storage.StorageError": EXIT_INFRASTRUCTURE,
    "farm.doctor.ServiceUnavailable": EXIT_INFRASTRUCTURE,
    "sqlalchemy.exc.OperationalError": EXIT_INFRASTRUCTURE,
}


def exit_code_for(error: Exception) -> int | None:
    from farm.client import ApiError

    if isinstance(error, ApiError):
        if error.status in (401, 403):
            return EXIT_UNAUTHORIZED
        if error.status == 404:
            return EXIT_NOT_FOUND
        return EXIT_BAD_INPUT if 400 <= error.status < 500 else EXIT_INFRASTRUCTURE
    for cls in type(error).__mro__:
        code = _EXIT_CODES.get(f"{cls.__module__}.{cls.__qualname__}")
        if code is not None:
            return code
    return None


def _one_line(error: Exception) -> str:
    orig = getattr(error, "orig", None)  # SQLAlchemy wraps the driver's error
    if orig is not None:
        first = str(orig).strip().splitlines()[0] if str(orig).strip() else type(orig).__name__
        return f"database error (FARM_DATABASE_URL): {first}"
    return str(error)


def backend():
    """The HTTP API when FARM_API_URL is set, else the database and store directly."""
    from farm.cli.backend import Direct, Http

    settings = get_settings()
    if settings.api_url:
        from farm.client import FarmClient

        return Http(FarmClient(settings.api_url, settings.token))
    return Direct(local_farm())


def spec_options(device_required: bool) -> Callable[[Callable], Callable]:
    """The compile-spec flags, shared by `submit` and `pull MODEL`."""
    options = [
        click.option(
            "--device",
            "-d",
            required=device_required,
            help="NPU platform (4000, NPU.4000) or CPU; a list: 3720,4000.",
        ),
        click.option("--tiles", help="NPU tiles, 1 to the platform's maximum; a list: 2,4."),
        click.option("--hint", help="Performance hint: LATENCY or THROUGHPUT."),
        click.option(
            "--compiler-params",
            help="NPU compiler parameters ('optimization-level=2 ...').",
        ),
        click.option(
            "--shape", "shapes", multiple=True, help="Input shape NAME[d1,d2,...]; repeatable."
        ),
        click.option("--batch", help="Batch size on the layout's N axis; a list: 1,4."),
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


def print_job(job: dict) -> None:
    out.print(f"job        {job['id']} ({job['target']}): {job['state']}")
    if job.get("compile_seconds") is not None:
        out.print(
            f"timings    compile {job['compile_seconds']:.2f} s, export "
            f"{job['export_seconds']:.2f} s, peak RSS {size_text(job['peak_rss_bytes'] or 0)}"
        )
    if job.get("error"):
        out.print(f"error      {job['error']}", markup=False)
    if job.get("note"):
        out.print(f"note       {job['note']}", markup=False)


def print_blob(blob: dict) -> None:
    out.print(
        f"blob       {blob['target']}, OpenVINO {blob['openvino']}, "
        f"{size_text(blob['size_bytes'])}, sha256 {blob['sha256']}"
    )


@contextlib.contextmanager
def progress_bar(description: str, total: int, quiet: bool = False):
    """A rich progress bar on stderr for `total` bytes; yields the `advance(n)` callback."""
    if quiet or total <= 0 or not err.is_terminal:
        yield lambda _count: None
        return
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=err,
        transient=True,
    ) as progress:
        task = progress.add_task(description, total=total)
        yield lambda count: progress.advance(task, count)


def size_text(count: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return str(count)


def hide_password(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)
