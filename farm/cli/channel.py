"""`farm channel create|set|show|status|promote|rollback` and `farm prebuild`: what a fleet
runs, moved in stages and back (docs/architecture.md §16). Moves need an admin token through
the API; `show` and `status` a submit token."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import click

from farm.cli import main
from farm.cli.common import backend, emit, err, handle_errors, json_option, out, say, spec_options
from farm.cli.submit import specs_from_options
from farm.core.channels import Entry, check_name
from farm.core.config import get_settings
from farm.core.digests import digest_cache
from farm.core.errors import SpecError
from farm.core.identity import ModelRef
from farm.core.spec import Toolchain


@main.group()
def channel() -> None:
    """Release channels: what a fleet runs, rolled out in stages and rolled back."""


@channel.command("create")
@click.argument("name")
@json_option
@handle_errors
def create(name: str, as_json: bool) -> None:
    """Create channel NAME (empty until its first revision)."""
    data = backend().create_channel(check_name(name))
    emit(data, as_json, lambda: say(f"created channel {name}"))


@channel.command("set")
@click.argument("name")
@click.argument("model", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@spec_options(device_required=True)
@json_option
@handle_errors
def set_(name: str, model: tuple[str, ...], as_json: bool, **options: Any) -> None:
    """Make a new revision of NAME running each MODEL with the spec flags (several models, and
    a matrix of specs, per revision). The first revision runs at once; later ones wait for
    `farm channel promote`. Each model must have been submitted."""
    check_name(name)
    specs = specs_from_options(options)
    digests = digest_cache(get_settings().cache_dir).sha256
    entries = []
    for path in model:
        ref = ModelRef.from_path(path, digests=digests)
        entries += [Entry(ref.name, dict(ref.identity), spec).as_dict() for spec in specs]
    data = backend().set_channel(name, entries)
    newest = data["revisions"][-1]
    emit(
        data,
        as_json,
        lambda: say(
            f"channel {name}: revision {newest['revision']} ({len(newest['entries'])} "
            f"model(s)); stable {data['stable_revision']}"
        ),
    )


@channel.command("show")
@click.argument("name")
@click.option("--revision", type=int, help="Only this revision.")
@json_option
@handle_errors
def show(name: str, revision: int | None, as_json: bool) -> None:
    """The channel's rollout, its revisions (who made each, when, what) and its last moves."""
    data = backend().channel(check_name(name), revision)
    emit(data, as_json, functools.partial(_print_show, data))


@channel.command("status")
@click.argument("name")
@click.option(
    "--toolchain",
    "toolchain_file",
    type=click.File("r"),
    help="Also list what the farm lacks for this toolchain (`farm toolchain --json` of the "
    "release the fleet moves to).",
)
@json_option
@handle_errors
def status(name: str, toolchain_file: Any, as_json: bool) -> None:
    """The rollout as the edges report it: edges per revision, toolchain and targets, the
    failures, and the gates the next promotion must pass."""
    toolchain = _toolchain(toolchain_file) if toolchain_file else None
    data = backend().channel_status(check_name(name), toolchain)
    emit(data, as_json, functools.partial(_print_status, data))


@channel.command("promote")
@click.argument("name")
@click.option("--revision", type=int, required=True, help="The revision to roll out.")
@click.option(
    "--percent",
    type=click.IntRange(1, 100),
    default=100,
    show_default=True,
    help="Share of the edges (the same ones every time: a hash of their agent id).",
)
@click.option("--force", is_flag=True, help="Past the verification gates (admins; recorded).")
@json_option
@handle_errors
def promote(name: str, revision: int, percent: int, force: bool, as_json: bool) -> None:
    """Roll revision N out to a share of the edges; 100 makes it the stable revision. Past the
    first stage, refused while its blobs failed verifications or have too few passed ones."""
    data = backend().promote_channel(check_name(name), revision, percent, force)
    emit(data, as_json, functools.partial(_print_rollout, data))


@channel.command("rollback")
@click.argument("name")
@json_option
@handle_errors
def rollback(name: str, as_json: bool) -> None:
    """Everyone back to the previous revision at their next sync."""
    data = backend().rollback_channel(check_name(name))
    emit(data, as_json, functools.partial(_print_rollout, data))


@main.command()
@click.option(
    "--toolchain",
    "toolchain_file",
    type=click.File("r"),
    required=True,
    help="The toolchain to build for (`farm toolchain --json` of the new release).",
)
@click.option("--channel", "channel_name", help="What this channel's fleet runs.")
@click.option("--pulled-since", type=float, metavar="DAYS", help="What edges pulled lately.")
@json_option
@handle_errors
def prebuild(
    toolchain_file: Any, channel_name: str | None, pulled_since: float | None, as_json: bool
) -> None:
    """Submit every model and spec the fleet runs for a toolchain it does not have yet (a new
    OpenVINO release, driver or NPU compiler): the edges that upgrade then find hits."""
    if (channel_name is None) == (pulled_since is None):
        raise SpecError("give one of --channel NAME or --pulled-since DAYS")
    toolchain = _toolchain(toolchain_file)
    results = backend().prebuild(
        toolchain, check_name(channel_name) if channel_name else None, pulled_since
    )

    def human() -> None:
        for row in results:
            line = f"{row['outcome']:<11} {row['name']} {row['spec']}  {row['cache_key'][:16]}…"
            if row.get("job"):
                line += f"  job {row['job']}"
            if row.get("reason"):
                line += f"  ({row['reason']})"
            say(line, soft_wrap=True)

    emit(results, as_json, human)


def _toolchain(stream: Any) -> dict[str, Any]:
    try:
        return Toolchain.from_json(json.load(stream)).as_dict()
    except ValueError as error:
        if isinstance(error, SpecError):
            raise SpecError(f"--toolchain {stream.name}: {error}") from None
        raise SpecError(f"--toolchain {stream.name}: not JSON ({error})") from None


def _print_rollout(data: dict[str, Any]) -> None:
    line = f"channel {data['channel']}: stable revision {data['stable_revision']}"
    if data.get("candidate_revision") is not None:
        line += f", revision {data['candidate_revision']} on {data['percent']} % of the edges"
    say(f"{line} (sequence {data['sequence']})")


def _print_show(data: dict[str, Any]) -> None:
    _print_rollout(data)
    for revision in data["revisions"]:
        say(f"revision {revision['revision']} by {revision['created_by']} {revision['created_at']}")
        for entry in revision["entries"]:
            model = Path(entry["name"]).name or next(iter(entry["model"].values()))[:16]
            say(f"  {model} {Entry.from_dict(entry).spec.summary()}", soft_wrap=True)
    for move in data["moves"][:10]:
        forced = "  FORCED: " + str(move["gate_report"]) if move["forced"] else ""
        say(
            f"{move['created_at']} {move['actor']}: {move['action']} {move['revision'] or ''} "
            f"{'' if move['percent'] is None else str(move['percent']) + ' %'}{forced}",
            soft_wrap=True,
        )


def _print_status(data: dict[str, Any]) -> None:
    _print_rollout(data)
    say(f"{data['edges']} edge(s) reporting")
    for group in data["by_revision"]:
        say(
            f"  revision {group['revision']}: {group['edges']} edge(s), OpenVINO "
            f"{group['openvino']}, {', '.join(group['targets']) or '-'}"
            + (f", {group['failing']} failing" if group["failing"] else ""),
            soft_wrap=True,
        )
    for failure in data["failures"]:
        say(
            f"  {failure['agent_id']} stays on {failure['revision']}: {failure['error']}",
            err,
            soft_wrap=True,
        )
    for problem in data["gates"]:
        say(f"gate: {problem}", err, soft_wrap=True)
    if "missing" in data:
        release = data["toolchain"]["openvino"]
        if not data["missing"]:
            say(f"OpenVINO {release}: every blob is built", out)
        for entry in data["missing"]:
            say(f"{entry['state']} for {release}: {entry['name']} {entry['spec']}", err)
