"""The `farm` command. Exit codes (README "Exit codes") are part of the interface.

Every error a user can meet ends here as one line on stderr (one JSON object with `--json`) and
a documented exit code: the farm's own errors (`handle_errors`), click's usage errors, and a
library of an install extra this install lacks (an edge install running an operator command).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import click

from farm.core.errors import FarmError


class FarmGroup(click.Group):
    """The `farm` group: notes `--json` before parsing, so every error can answer in JSON."""

    def main(self, args: Sequence[str] | None = None, *rest: Any, **options: Any) -> Any:
        from farm.cli import common

        argv = list(sys.argv[1:] if args is None else args)
        own = argv[: argv.index("--")] if "--" in argv else argv
        common.json_errors = "--json" in own
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


from farm.cli import channel, edge, jobs, keys, ops, quarantine, toolchain, verify  # noqa: E402,F401
