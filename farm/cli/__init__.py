"""The `farm` command. Exit codes (README "Exit codes") are part of the interface.

Every error a user can meet ends here as one line on stderr (one JSON object with `--json`) and
a documented exit code: the farm's own errors (`handle_errors`), click's usage errors, and a
library of an install extra this install lacks (an edge install running an operator command).

A command's module is imported when the command is run (`COMMANDS`), not with the group: `farm
jobs` loads the listing commands, never what `farm submit`, `farm pull` or the operator
commands need (issue 30, item 4; tests/unit/test_cli_startup.py).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from typing import Any

import click

from farm.core.errors import FarmError
from farm.runtime_import import skip_conversion_api

COMMANDS: dict[str, tuple[str, ...]] = {
    "agent": ("edge",),
    "api": ("ops",),
    "blobs": ("jobs", "quarantine"),
    "cancel": ("jobs",),
    "channel": ("channel",),
    "db": ("ops",),
    "doctor": ("ops",),
    "gc": ("ops",),
    "jobs": ("jobs",),
    "keys": ("keys",),
    "logs": ("jobs",),
    "prebuild": ("channel",),
    "pull": ("edge",),
    "reconcile": ("ops",),
    "run": ("edge",),
    "status": ("jobs",),
    "submit": ("submit",),
    "token": ("ops",),
    "toolchain": ("toolchain",),
    "verify": ("verify",),
    "worker": ("ops",),
    "workers": ("jobs",),
}
"""Each command and the modules of `farm.cli` that define it (and its subcommands)."""

SERVING = frozenset({"worker", "api"})
"""Commands that serve until stopped: they load OpenVINO whole (their start is not what a user
waits for, and they host other libraries)."""

whole_process = False
"""Whether this run of the group is the `farm` process (arguments from its command line), not
a call from a program (click's CliRunner): only then may a command end the process itself
(`os._exit`, `farm.cli.submit`)."""


class FarmGroup(click.Group):
    """The `farm` group: notes `--json` before parsing, so every error can answer in JSON, and
    imports a command's module only when the command is asked for (`COMMANDS`)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        for module in COMMANDS.get(cmd_name, ()):
            importlib.import_module(f"farm.cli.{module}")
        return super().get_command(ctx, cmd_name)

    def main(self, args: Sequence[str] | None = None, *rest: Any, **options: Any) -> Any:
        from farm.cli import common

        argv = list(sys.argv[1:] if args is None else args)
        own = argv[: argv.index("--")] if "--" in argv else argv
        common.json_errors = "--json" in own
        global whole_process
        whole_process = args is None  # the `farm` process itself, not a caller's CliRunner
        if whole_process and not set(own) & SERVING:
            skip_conversion_api()  # the command converts nothing in this process
        common.notes.clear()
        return super().main(argv, *rest, **options)

    def make_context(self, *args: Any, **options: Any) -> click.Context:
        from farm.cli import common

        try:
            return super().make_context(*args, **options)
        except click.UsageError as error:  # the group's own options: `farm --bogus`
            raise common.usage_error(error) from error

    def invoke(self, ctx: click.Context) -> Any:
        from farm.cli import common

        try:
            return super().invoke(ctx)
        except common.FarmCliError:
            raise
        except FarmError as error:
            raise common.cli_error(error) from error
        except click.UsageError as error:
            raise common.usage_error(error) from error
        except ModuleNotFoundError as error:
            name = ctx.invoked_subcommand or "this command"
            missing = common.not_installed(error, f"`farm {name}`")
            if missing is None:
                raise
            raise common.cli_error(missing) from error


@click.group(cls=FarmGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="farm")
def main() -> None:
    """farm: compile OpenVINO models once, import the blobs everywhere."""
