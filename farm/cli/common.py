"""Shared pieces of the `farm` command: exit codes, error mapping, spec flags, output.

What the CLI prints for people passes through `farm.core.text.printable`: a model's op type, a
compiler's message or a worker's name reaches the terminal with its control characters shown
(``\x1b``), never obeyed (no title change, no OSC 52 clipboard write, no screen clear), and
is printed without Rich markup. ``--json`` prints the raw text as JSON, which escapes control
characters itself, and makes an error one JSON object on stderr (`FarmCliError.show`).

Output that does not go to a terminal is never wrapped (`UnwrappedWhenPiped`): a script or a
`grep` gets each cache key, path and message on one line, whatever the terminal's width.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Callable, Iterator
from typing import Any

import click
from rich.console import Console, ConsoleDimensions
from rich.markup import escape
from rich.text import Text

from farm.cli.backends import Backend, open_backend
from farm.core import keyprefix
from farm.core.config import Settings, get_settings
from farm.core.errors import FarmError, Kind, NeedsDatabase, NotInstalled
from farm.core.text import printable, redact, size_text

EXIT_OK = 0
EXIT_JOB_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_NOT_FOUND = 3
EXIT_COMPILER_UNAVAILABLE = 4
EXIT_INFRASTRUCTURE = 5
EXIT_UNAUTHORIZED = 6
EXIT_GAVE_UP = 7
EXIT_UNTRUSTED = 8
EXIT_REJECTED = 9
"""The blob does not compute its reference numbers (farm verify), or is quarantined."""

UNWRAPPED_WIDTH = 1 << 16
"""The width Rich lays out for when the output is not a terminal: wide enough that nothing
(a 64-hex key, a long path, a compiler's message) is ever folded."""


class UnwrappedWhenPiped(Console):
    """A Rich console that wraps at the terminal's width on a terminal, and never when its
    output is a pipe or a file (Rich would otherwise wrap at 80 columns)."""

    @property
    def size(self) -> ConsoleDimensions:
        if self.is_terminal:
            return super().size
        return ConsoleDimensions(UNWRAPPED_WIDTH, 25)

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        self._width, self._height = new_size


out = UnwrappedWhenPiped(highlight=False)
err = UnwrappedWhenPiped(stderr=True, highlight=False)

json_errors = False
"""Set by the `farm` group when its command line has `--json`: errors are then JSON too."""

notes: list[str] = []
"""What the command told the user along the way (`note`); with `--json`, held for the error."""


def note(text: str) -> None:
    """Tell the user something on stderr along the way (a queued job's note). With `--json`,
    stderr holds only the error object, if any: the note is held and goes inside it."""
    if json_errors:
        notes.append(text)
    else:
        say(text, err)


class FarmCliError(click.ClickException):
    """One line on stderr and an exit code from the table above; with `--json`, one JSON object
    instead: ``{"code", "message", "exit"}`` (`code` is the farm error's stable code)."""

    def __init__(self, message: str, exit_code: int, code: str = "error") -> None:
        super().__init__(message)
        self.exit_code = exit_code  # type: ignore[misc]  # click declares it on the class
        self.code = code

    def show(self, file: Any = None) -> None:
        message = redact(self.message, _secrets())
        if json_errors:
            error: dict[str, Any] = {"code": self.code, "message": message, "exit": self.exit_code}
            if notes:
                error["notes"] = [redact(text, _secrets()) for text in notes]
            click.echo(json.dumps(error), err=True)
        else:
            click.echo(f"farm: error: {printable(message)}", err=True)


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
    Kind.UNTRUSTED: EXIT_UNTRUSTED,
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
            raise cli_error(error) from error

    return wrapper


def cli_error(error: FarmError) -> FarmCliError:
    return FarmCliError(str(error), EXIT_CODES[error.kind], error.code)


def usage_error(error: click.UsageError) -> click.ClickException:
    """A usage error as one line like any other error (click's usage text is for --help);
    bare `farm` (click's "no arguments: show the help") stays the help."""
    if isinstance(error, click.exceptions.NoArgsIsHelpError):
        return error
    command = error.ctx.command_path if error.ctx else "farm"
    message = f"{error.format_message().rstrip('.')} (`{command} --help` shows the usage)"
    return FarmCliError(message, error.exit_code, "usage")


EXTRA_OF_MODULE = {
    "sqlalchemy": "embedded",
    "alembic": "embedded",
    "openvino": "edge",
    "numpy": "edge",
    "celery": "server",
    "kombu": "server",
    "redis": "server",
    "boto3": "server",
    "botocore": "server",
    "fastapi": "server",
    "starlette": "server",
    "uvicorn": "server",
    "psycopg": "server",
    "prometheus_client": "server",
}
"""The install extra that brings each optional library (pyproject.toml)."""


def not_installed(
    error: ModuleNotFoundError, what: str, *, over_http: bool = False
) -> NotInstalled | None:
    """The `NotInstalled` error for a library of an install extra this install lacks (None for
    any other missing module: a bug, which keeps its traceback). `over_http`: the command also
    works through the farm's API, which needs none of it."""
    top = (error.name or "").split(".")[0]
    extra = EXTRA_OF_MODULE.get(top)
    if extra is None:
        return None
    if extra == "embedded":
        wanted = "pip install 'farm[server]' (or 'farm[embedded]' for a one-machine farm)"
    else:
        wanted = f"pip install 'farm[{extra}]'"
    message = f"{what} needs {top}, which this install lacks: {wanted}"
    if over_http:
        message += ", or set FARM_API_URL (and FARM_TOKEN) to work through the farm's API"
    return NotInstalled(message)


@contextlib.contextmanager
def installed(command: str) -> Iterator[None]:
    """Imports in this block that fail for want of an install extra are `NotInstalled`."""
    try:
        yield
    except ModuleNotFoundError as error:
        missing = not_installed(error, f"`farm {command}`")
        if missing is None:
            raise
        raise missing from error


def backend() -> Backend:
    """The HTTP API when FARM_API_URL is set, else the database and store directly."""
    try:
        return open_backend(get_settings())
    except ModuleNotFoundError as error:
        what = f"`farm {_command_name()}` without FARM_API_URL"
        missing = not_installed(error, what, over_http=True)
        if missing is None:
            raise
        raise missing from error


def direct(command: str):
    """The farm's database and store themselves, for a command that has no API equivalent
    (tokens, gc, reconcile, schema, re-signing). Refused where only the API is configured:
    FARM_API_URL without FARM_DATABASE_URL would otherwise open (and create) an embedded farm
    under ./.farm and report on that instead of the farm the user meant."""
    settings = direct_settings(command)
    with installed(command):
        from farm.cli.backends.direct import Direct  # farm[embedded]: operator commands only
    return Direct.open(settings)


def direct_settings(command: str) -> Settings:
    """The settings, unless they name only the API (see `direct`): then `NeedsDatabase`."""
    settings = get_settings()
    if settings.api_url and not settings.database_url:
        raise NeedsDatabase(
            f"`farm {command}` works on the farm's database directly, which the API does not "
            "expose: run it where FARM_DATABASE_URL (and FARM_STORAGE_URL) reach the farm's "
            "database and store, or unset FARM_API_URL to act on the embedded farm"
        )
    return settings


def _command_name() -> str:
    context = click.get_current_context(silent=True)
    return context.command_path.partition(" ")[2] if context else "this command"


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


def resolve_key(farm: Backend, text: str) -> str:
    """The cache key `text` names: a whole key, or a unique prefix of at least 8 hex characters
    (`farm.core.keyprefix`), looked up through `farm`."""
    return keyprefix.resolve(text, farm.cache_keys)


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
    if job.get("phases"):
        say("phases     " + ", ".join(f"{p['phase']} {p['seconds']:.2f} s" for p in job["phases"]))
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
    elif blob.get("reference_state") == "pending":
        say("reference  outputs pending: computed after the blob (farm verify waits for them)")
    elif blob.get("reference_note"):
        say(f"reference  {blob['reference_note']}")
    if blob.get("quarantined_at"):
        say(f"QUARANTINED since {str(blob['quarantined_at'])[:19]}: {blob['quarantine_reason']}")
    compressed = blob.get("compression")
    if compressed:
        from farm.core import compression  # a compressed model's blob only

        metrics = compressed.get("metrics") or {}
        what = compressed["args"].get("mode") or compressed["args"].get("precision")
        say(
            f"{compressed['kind']:<10} {what}: {compression.size_summary(metrics)}; drift "
            f"{compression.drift_summary(metrics) or 'not measured'}"
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
        task = progress.add_task(escape(printable(description)), total=total)
        yield lambda count: progress.advance(task, count)
