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
    EXIT_JOB_FAILED,
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
from farm.cli.compression import compression_request
from farm.cli.pipelines import pipeline_options, pull_folder
from farm.cli.submit import source_options, source_ref, specs_from_options
from farm.core import compression, keyprefix
from farm.core.config import get_settings
from farm.core.errors import IntegrityMismatch, NotFound
from farm.core.identity import key_for
from farm.core.pipelines import looks_like_pipeline
from farm.core.spec import SpecError, Target

EXIT_SWITCH_FAILED = EXIT_JOB_FAILED
"""`farm agent sync --channel`: the switch failed, the edge stays on its revision."""


def edge_agent(source: Backend | None = None):
    """The agent over the API (FARM_API_URL) or, without it, over the embedded farm."""
    from farm.edge import agent_from_settings  # OpenVINO loads with the edge: only when used

    return agent_from_settings(get_settings(), source or backend())


def key_of(key_or_model: str, options: dict[str, Any], farm: Backend) -> tuple[str, Path | None]:
    """A cache key (or a unique prefix of one) given as such, or the key this machine computes
    for MODEL (any source format, with --example-input/--task as submitted) + spec flags; with
    the model's `.bin` (the weights a weightless blob imports with)."""
    if options["device"] is None:
        compression_request(options)  # no compression flags without a model to apply them to
        return resolve_key(farm, key_or_model), None
    from farm.toolchain import host_toolchain  # OpenVINO: only when a model is given

    specs = specs_from_options(options)
    if len(specs) != 1:
        raise SpecError("pull takes one spec, not a matrix: one --device, --tiles, --batch")
    compressed = compression_request(options)
    ref, _ = source_ref(
        Path(key_or_model),
        options.pop("example_inputs", ()),
        options.pop("task", None),
        compressed=compressed,
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
@click.option(
    "--ir",
    "ir_dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="MODEL is a source the farm converts (or --compress/--quantize): download the IR its "
    "last stage made into this folder (model.xml, model.bin, each checked against the stage's "
    "sha256) instead of a blob.",
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
    ir_dir: Path | None = None,
    **options: Any,
) -> None:
    """Fetch a blob by CACHE_KEY, or by MODEL + spec flags (the key this machine computes):
    compatibility checked first, download resumed and sha256-verified, kept in the cache.
    With --ir DIR and a source MODEL (.pt2, .tflite, a Hugging Face folder, ...): the IR the
    farm converted it to, for compiling on the device yourself. KEY_OR_MODEL may be a GenAI
    pipeline folder: its bundle is written to -o DIR, ready to open."""
    if ir_dir is not None:
        _pull_ir(Path(key_or_model), ir_dir, options, as_json)
        return
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


def _pull_ir(model: Path, ir_dir: Path, options: dict[str, Any], as_json: bool) -> None:
    """Download the IR a source's last stage made (docs §15), verified by its sha256."""
    from farm.core.hashing import sha256_file
    from farm.core.stages import stage_keys

    compressed = compression_request(options)
    ref, source = source_ref(
        model, options.pop("example_inputs", ()), options.pop("task", None), compressed=compressed
    )
    if not ref.recipe:
        raise SpecError(
            f"--ir is for sources the farm converts or compresses (--compress); {model} is "
            f"{source.format}"
        )
    key = stage_keys(ref.identity, ref.recipe)[-1]
    farm = backend()
    record = farm.stage(key)
    if record is None or record["state"] != "done":
        state = record["state"] if record else "unknown to the farm"
        raise NotFound(
            f"the farm has no converted IR of {model.name} (stage {key} is {state}): "
            "submit it first (farm submit)"
        )
    ir_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    for role, digest in sorted(record["output_files"].items()):
        dest = ir_dir / f"model.{role}"
        partial = ir_dir / f".model.{role}.partial"
        farm.download_stage_file(key, role, partial)
        actual = sha256_file(partial)
        if actual != digest:
            partial.unlink()
            raise IntegrityMismatch(
                f"the farm sent model.{role} of stage {key} with sha256 {actual}, not the "
                f"recorded {digest}: nothing was written"
            )
        partial.replace(dest)
        written[role] = str(dest)
    data = {
        "stage_key": key,
        "kind": record["kind"],
        "files": written,
        "tool_versions": record["tool_versions"],
        "metrics": record.get("metrics") or {},
    }

    def human() -> None:
        say(f"{record['kind']} IR of {model.name} (stage {key[:12]}) → {ir_dir}")
        if record["kind"] in ("compress", "quantize"):
            metrics = data["metrics"]
            size, drift = compression.size_summary(metrics), compression.drift_summary(metrics)
            say(f"measured   {size}; drift {drift or 'not measured'}")

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
@click.argument(
    "manifest", type=click.Path(exists=True, dir_okay=False, path_type=Path), required=False
)
@click.option(
    "--channel",
    "channel_name",
    help="Follow this channel instead of a manifest: its signed document says what to run.",
)
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
    manifest: Path | None,
    channel_name: str | None,
    interval: float | None,
    do_import: bool,
    do_verify: bool,
    as_json: bool,
) -> None:
    """Pull every model and spec listed in MANIFEST (TOML); report what the farm lacks.
    With --channel NAME instead: follow the channel (switch to the revision its signed
    document gives this edge once every blob is fetched and verified).

    Exit code 3 when the farm lacks some of them (so a script can tell); with --channel, the
    exit code of the failed switch's error (the edge stays on its revision)."""
    if (manifest is None) == (channel_name is None):
        raise SpecError("give a MANIFEST or --channel NAME (one of them)")
    if manifest is None:
        _follow(str(channel_name), interval, do_import, do_verify, as_json)
        return
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


def _follow(
    name: str, interval: float | None, do_import: bool, do_verify: bool, as_json: bool
) -> None:
    from farm.edge.channel import sync_channel  # the edge: only when used

    farm = backend()
    agent = edge_agent(farm)
    while True:
        result = sync_channel(
            agent, farm, name, get_settings().cache_dir, do_import=do_import, do_verify=do_verify
        )
        emit(result.as_dict(), as_json, functools.partial(_print_follow, result))
        if interval is None:
            break
        sys.stdout.flush()
        time.sleep(interval)
    if result.status == "failed":
        sys.exit(EXIT_SWITCH_FAILED)


def _print_follow(result) -> None:
    if result.status == "failed":
        say(
            f"channel {result.channel}: staying on revision {result.revision}; revision "
            f"{result.wanted_revision} failed: {result.error}",
            err,
            soft_wrap=True,
        )
        return
    say(
        f"channel {result.channel}: {result.status}, revision {result.revision} "
        f"(sequence {result.sequence}, {result.downloaded} downloaded)"
    )
    for key in result.keys:
        say(f"  {key['name']} {key['spec']}  {key['cache_key'][:16]}…", soft_wrap=True)
