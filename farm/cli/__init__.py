"""The `farm` command. Exit codes (README "Exit codes") are part of the interface."""

from __future__ import annotations

import click


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="farm")
def main() -> None:
    """farm: compile OpenVINO models once, import the blobs everywhere."""


from farm.cli import edge, jobs, keys, ops, quarantine, toolchain, verify  # noqa: E402,F401
