"""Shared pieces of the `farm` command: exit codes, error mapping, spec flags, output.

What the CLI prints for people passes through `farm.core.text.printable`: a model's op type, a
compiler's message or a worker's name reaches the terminal with its control characters shown
(``\x1b``), never obeyed (no title change, no OSC 52 clipboard write, no screen clear), and
is printed without Rich markup. ``--json`` prints the raw text as JSON, which escapes control
characters itself.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Callable
from typing import Any

import click
from rich.console import Console
from rich.markup import escape
from rich.text import Text

from farm.cli.backends import Backend, open_backend
from farm.core.config import get_settings
from farm.core.errors import FarmError, Kind
from farm.core.text import printable, redact, size_text

EXIT_OK = 0
EXIT_JOB_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_NOT_FOUND = 3
EXIT_COMPILER_UNAVAILABLE = 4
EXIT_INFRASTRUCTURE = 5
EXIT_UNAUTHORIZED = 6
EXIT_GAVE_UP = 7
EXIT_REJECTED = 9
"""The blob does not compute its reference numbers (farm verify), or is quarantined."""

out = Console(highlight=False)
err = Console(stderr=True, highlight=False)


class FarmCliError(click.ClickException):
    """One line on stderr and an exit code from the table above."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code  # type: ignore[misc]  # click declares it on the class

    def show(self, file: Any = None) -> None:
        message = printable(redact(self.message, _secrets()))
        click.echo(f"farm: error: {message}", err=True)


def _secrets() -> list[str]:
    """The secrets of the settings, to redact from an error message; none when the settings
    themselves are what failed."""
    try:
        return get_settings().secrets
    except Exception:
        return []


EXIT_CODES: dict[Kind, int] = {
    Kind.BAD_INPUT: EXIT_BAD_INPUT,
    Kind.CONFLICT: EXIT_BAD_INPUT,
    Kind.NOT_FOUND: EXIT_NOT_FOUND,
    Kind.CANNOT_RUN_HERE: EXIT_COMPILER_UNAVAILABLE,
    Kind.INTEGRITY: EXIT_INFRASTRUCTURE,
    Kind.INFRASTRUCTURE: EXIT_INFRASTRUCTURE,
    Kind.UNAUTHORIZED: EXIT_UNAUTHORIZED,
    Kind.FORBIDDEN: EXIT_UNAUTHORIZED,
    Kind.RATE_LIMITED: EXIT_INFRASTRUCTURE,
    Kind.JOB_FAILED: EXIT_JOB_FAILED,
    Kind.GAVE_UP: EXIT_GAVE_UP,
    Kind.REJECTED: EXIT_REJECTED,
}
"""The exit code of each kind of error (README "Exit codes"): the CLI's one table."""


def handle_errors(command: Callable) -> Callable:
    """Map the errors a user can meet to one clear line and a documented exit code."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except FarmError as error:
            raise FarmCliError(str(error), EXIT_CODES[error.kind]) from error

    return wrapper


def backend() -> Backend:
    """The HTTP API when FARM_API_URL is set, else the database and store directly."""
    return open_backend(get_settings())


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


def check_key(text: str) -> str:
    key = text.strip().lower()
    if len(key) != 64 or any(ch not in "0123456789abcdef" for ch in key):
        raise FarmCliError(
            f"{text!r} is neither a job number nor a 64-hex cache key", EXIT_BAD_INPUT
        )
    return key


def say(text: str, console: Console = out, **options: Any) -> None:
    """Print `text` for people: control characters shown, not obeyed; no markup, no emoji."""
    console.print(printable(text), markup=False, emoji=False, **options)


def cell(value: object) -> Text:
    """A table cell of text that may come from a model or another host: one line, shown
    literally (a Rich table would read ``[link=...]`` as markup)."""
    return Text(printable("" if value is None else str(value), multiline=False))


def print_job(job: dict) -> None:
    say(f"job        {job['id']} ({job['target']}): {job['state']}")
    if job.get("compile_seconds") is not None:
        say(
            f"timings    compile {job['compile_seconds']:.2f} s, export "
            f"{job['export_seconds']:.2f} s, peak RSS {size_text(job['peak_rss_bytes'] or 0)}"
        )
    if job.get("error"):
        say(f"error      {job['error']}")
    if job.get("note"):
        say(f"note       {job['note']}")


def print_blob(blob: dict) -> None:
    say(
        f"blob       {blob['target']}, OpenVINO {blob['openvino']}, "
        f"{size_text(blob['size_bytes'])}, sha256 {blob['sha256']}"
    )
    npu_compiler = (blob.get("toolchain") or {}).get("npu_compiler")
    if npu_compiler:
        say(f"compiler   NPU compiler {npu_compiler}")
    if blob.get("reference_sha256"):
        say(f"reference  outputs {size_text(blob.get('reference_size_bytes') or 0)} (farm verify)")
    elif blob.get("reference_note"):
        say(f"reference  {blob['reference_note']}")
    if blob.get("quarantined_at"):
        say(f"QUARANTINED since {str(blob['quarantined_at'])[:19]}: {blob['quarantine_reason']}")


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
        task = progress.add_task(escape(printable(description)), total=total)
        yield lambda count: progress.advance(task, count)
