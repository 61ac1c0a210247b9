"""Edge commands: `farm pull`, `farm run`, `farm agent sync`. Edge-safe: with FARM_API_URL set
they need only openvino and httpx; without it they read the embedded farm directly."""

from __future__ import annotations

import functools
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import click

from farm.cli import main
from farm.cli.backends import Backend
from farm.cli.common import (
    EXIT_NOT_FOUND,
    backend,
    emit,
    err,
    handle_errors,
    json_option,
    out,
    progress_bar,
    resolve_key,
    say,
    size_text,
    spec_options,
)
from farm.cli.jobs import source_options, source_ref, specs_from_options
from farm.cli.pipelines import pipeline_options, pull_folder
from farm.core import keyprefix
from farm.core.config import get_settings
from farm.core.identity import key_for
from farm.core.pipelines import looks_like_pipeline
from farm.core.spec import SpecError, Target


def edge_agent(source: Backend | None = None):
    """The agent over the API (FARM_API_URL) or, without it, over the embedded farm."""
    from farm.edge import agent_from_settings  # OpenVINO loads with the edge: only when used

    return agent_from_settings(get_settings(), source or backend())


def key_of(key_or_model: str, options: dict[str, Any], farm: Backend) -> tuple[str, Path | None]:
    """A cache key (or a unique prefix of one) given as such, or the key this machine computes
    for MODEL (any source format, with --example-input/--task as submitted) + spec flags; with
    the model's `.bin` (the weights a weightless blob imports with)."""
    if options["device"] is None:
        return resolve_key(farm, key_or_model), None
    from farm.toolchain import host_toolchain  # OpenVINO: only when a model is given

    specs = specs_from_options(options)
    if len(specs) != 1:
        raise SpecError("pull takes one spec, not a matrix: one --device, --tiles, --batch")
    ref, _ = source_ref(
        Path(key_or_model), options.pop("example_inputs", ()), options.pop("task", None)
    )
    key = key_for(ref.identity, specs[0], host_toolchain(specs[0].target), ref.recipe)
    return key, None if ref.recipe else ref.files.get("bin")


@main.command()
@click.argument("key_or_model")
@spec_options(device_required=False)
@source_options
@pipeline_options
@click.option(
    "--output",
    "-o",
    type=click.Path(path_type=Path),
    help="Also copy the blob here (it always lands in the local cache, FARM_CACHE_DIR); for a "
    "pipeline folder: the ready folder to write (replaced whole).",
)
@click.option(
    "--into-cache-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Write it as <cache_key>.blob for an app using OpenVINO's CACHE_DIR + CACHE_BLOB_ID.",
)
@click.option(
    "--for-model",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="With --into-cache-dir: the model path the app passes to compile_model.",
)
@click.option(
    "--format",
    "output_format",
    type=click.Choice(["blob", "cache-entry"]),
    default="blob",
    show_default=True,
    help="-o writes the plain export_model() bytes (blob: what core.import_model opens), or "
    "OpenVINO's cache entry (header, then those bytes).",
)
@click.option("--import", "do_import", is_flag=True, help="Import it here and report the time.")
@click.option(
    "--weights",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="The model's .bin, to import a weightless blob pulled by cache key.",
)
@click.option("--allow-quarantined", is_flag=True, help="Pull a quarantined blob too.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@json_option
@handle_errors
def pull(
    key_or_model: str,
    output: Path | None,
    output_format: str,
    into_cache_dir: Path | None,
    for_model: Path | None,
    do_import: bool,
    weights: Path | None,
    allow_quarantined: bool,
    quiet: bool,
    as_json: bool,
    **options: Any,
) -> None:
    """Fetch a blob by CACHE_KEY, or by MODEL + spec flags (the key this machine computes):
    compatibility checked first, download resumed and sha256-verified, kept in the cache.
    KEY_OR_MODEL may be a GenAI pipeline folder: its bundle is written to -o DIR, ready to open."""
    if options.get("pipeline") or looks_like_pipeline(Path(key_or_model)):
        pull_folder(Path(key_or_model), options, output, quiet, as_json)
        return
    if output is not None and output.is_dir():
        raise click.BadParameter(
            f"{output} is a folder; give the blob's file name", param_hint="-o"
        )
    if options["device"] is None:
        keyprefix.normalize(key_or_model)  # a bad key fails before any farm is opened
    farm = backend()
    key, model_bin = key_of(key_or_model, options, farm)
    agent = edge_agent(farm)
    agent.allow_quarantined = allow_quarantined
    blob = agent.resolve(key)
    with progress_bar(f"downloading {key[:12]}", blob["size_bytes"], quiet or as_json) as advance:
        fetched = agent.fetch(key, advance, blob=blob)
    data: dict[str, Any] = {
        **blob,
        "path": str(fetched.path),
        "downloaded": fetched.downloaded,
    }
    if output is not None:
        if output_format == "blob":
            from farm.edge.importer import write_export  # the edge: only when used

            write_export(fetched.path, output)
        else:
            _copy_atomically(fetched.path, output)
        data["output"] = str(output)
        data["output_format"] = output_format
    if into_cache_dir is not None:
        from farm.edge.dropin import write_cache_entry  # the edge: only when used

        entry = write_cache_entry(fetched.path, into_cache_dir, key, for_model)
        data["cache_entry"] = str(entry)
    if do_import:
        imported = agent.load(key, weights=weights or model_bin, blob=blob)
        data["import_seconds"] = imported.import_seconds
    elif fetched.downloaded:
        agent.report_download(key)

    def human() -> None:
        how = "downloaded" if fetched.downloaded else "cached"
        say(
            f"{how} {key} ({blob['target']}, {size_text(blob['size_bytes'])}, "
            f"sha256 {blob['sha256'][:16]}…) → {data.get('output') or fetched.path}"
        )
        if "cache_entry" in data:
            say(f"OpenVINO cache entry: {data['cache_entry']} (CACHE_BLOB_ID={key})")
        if do_import:
            say(f"imported in {data['import_seconds'] * 1000:.1f} ms")

    emit(data, as_json, human)


def _copy_atomically(source: Path, output: Path) -> None:
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = output.with_name(f".{output.name}.partial")
    try:
        shutil.copyfile(source, partial)
        partial.replace(output)
    finally:
        partial.unlink(missing_ok=True)


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
    """Import BLOB (a plain exported blob or an OpenVINO cache entry) with OpenVINO and run one
    inference on random input."""
    from farm.edge import import_blob, infer_once  # OpenVINO: only when used
    from farm.edge.importer import import_failure

    target = Target.parse(device)
    try:
        imported = import_blob(blob, target.device, weights)
    except RuntimeError as error:
        raise import_failure(blob, target, weights, error) from error
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
        lambda: say(
            f"imported {blob.name} on {target.device} in {imported.import_seconds * 1000:.1f} ms; "
            f"one inference {result['latency_seconds'] * 1000:.2f} ms; outputs {result['outputs']}"
        ),
    )


@main.group()
def agent() -> None:
    """The edge agent: keep this machine's blob cache in step with a manifest."""


@agent.command("sync")
@click.argument("manifest", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--interval", type=float, help="Run again every this many seconds (a loop).")
@click.option("--import", "do_import", is_flag=True, help="Import each blob to check it loads.")
@click.option(
    "--verify",
    "do_verify",
    is_flag=True,
    help="Verify each new blob against its reference outputs, once per device (farm verify).",
)
@json_option
@handle_errors
def sync(
    manifest: Path, interval: float | None, do_import: bool, do_verify: bool, as_json: bool
) -> None:
    """Pull every model and spec listed in MANIFEST (TOML); report what the farm lacks.

    Exit code 3 when the farm lacks some of them (so a script can tell)."""
    from farm.edge.sync import load_manifest, sync_once  # the edge: only when used

    entries = load_manifest(manifest)
    while True:
        results = sync_once(edge_agent(), entries, do_import, do_verify)
        emit([r.as_dict() for r in results], as_json, functools.partial(_print_sync, results))
        if interval is None:
            break
        sys.stdout.flush()
        time.sleep(interval)
    if any(r.status != "ready" for r in results):
        sys.exit(EXIT_NOT_FOUND)


def _print_sync(results) -> None:
    for result in results:
        line = f"{result.status:<12} {result.model} {result.spec}"
        if result.cache_key:
            line += f"  {result.cache_key[:16]}…"
        if result.detail:
            line += f"  ({result.detail})"
        say(line, out if result.status == "ready" else err, soft_wrap=True)
