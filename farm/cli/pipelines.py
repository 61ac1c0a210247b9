"""The pipeline parts of `farm submit` and `farm pull` (a folder instead of a model file, §17)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import click

from farm.cli.backends import Backend
from farm.cli.common import backend, emit, progress_bar, say, size_text
from farm.core.config import get_settings
from farm.core.errors import FarmError, Kind, NotFound, SpecError, WaitTimeout
from farm.core.pipelines import (
    KINDS,
    GenAIOptions,
    PipelineFolder,
    context_length,
    detect,
    hf_pipeline,
    is_huggingface_folder,
)
from farm.core.spec import Target

PIPELINE_FLAGS = (
    "pipeline",
    "max_prompt_len",
    "min_response_len",
    "generate_hint",
    "prefill_hint",
    "cache_mode",
)


class _FarmSource:
    """The farm (`Backend`) as the edge's `BundleSource`."""

    def __init__(self, farm: Backend) -> None:
        self.farm = farm

    def manifest(self, bundle_key: str) -> dict[str, Any]:
        return self.farm.bundle_manifest(bundle_key)

    def open_file(self, sha256: str, offset: int) -> BinaryIO:
        return self.farm.open_bundle_file(sha256, offset)


def pipeline_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """The GenAI options of a pipeline folder; ignored for a model file."""
    for option in reversed(
        [
            click.option(
                "--pipeline",
                type=click.Choice(KINDS),
                help="A folder's pipeline kind (default: recognised from its files).",
            ),
            click.option("--max-prompt-len", type=int, help="NPU LLM/VLM: longest prompt."),
            click.option(
                "--min-response-len", type=int, help="NPU LLM/VLM: tokens always left to answer."
            ),
            click.option("--generate-hint", help="NPU LLM/VLM: FAST_COMPILE or BEST_PERF."),
            click.option("--prefill-hint", help="NPU LLM/VLM: DYNAMIC or STATIC."),
            click.option("--cache-mode", help="OPTIMIZE_SPEED, or OPTIMIZE_SIZE (= --weightless)."),
        ]
    ):
        command = option(command)
    return command


def folder_and_options(
    folder: Path, options: dict[str, Any]
) -> tuple[PipelineFolder, GenAIOptions]:
    """The recognised folder and its canonical options, from the command's flags."""
    devices = [d for d in str(options.get("device") or "").split(",") if d.strip()]
    if len(devices) != 1:
        raise SpecError("a pipeline folder takes one --device (CPU or an NPU platform)")
    if is_huggingface_folder(folder):
        pipeline = hf_pipeline(folder, options.get("pipeline"))
    else:
        pipeline = detect(folder, options.get("pipeline"))
    genai = GenAIOptions.create(
        pipeline.kind,
        Target.parse(devices[0]),
        max_prompt_len=options.get("max_prompt_len"),
        min_response_len=options.get("min_response_len"),
        generate_hint=options.get("generate_hint"),
        prefill_hint=options.get("prefill_hint"),
        cache_mode=options.get("cache_mode"),
        weightless=bool(options.get("weightless")),
        context_length=context_length(pipeline),
    )
    return pipeline, genai


def submit_folder(folder: Path, options: dict[str, Any], as_json: bool) -> None:
    """`farm submit FOLDER`: the embedded farm compiles the bundle now and answers with it; the
    served farm (the API) queues its parts for workers and answers with the build (`--wait`
    follows it to its end)."""
    pipeline, genai = folder_and_options(folder, options)
    farm = backend()
    answer = farm.submit_pipeline(pipeline, genai)
    if "manifest" not in answer:  # a build queued on the served farm
        if options.get("wait") and answer["state"] not in BUILD_FINAL:
            answer = wait_for_build(
                farm, answer["bundle_key"], float(options.get("wait_timeout") or 0)
            )
        emit_build(answer, as_json)
        if answer["state"] == "failed":
            raise BundleFailed(f"bundle {answer['bundle_key']} failed: {answer['error']}")
        return
    manifest = answer["manifest"]
    data = {
        "bundle_key": manifest["bundle_key"],
        "state": "done",
        "pipeline": manifest["pipeline"],
        "target": manifest["target"],
        "files": len(manifest["files"]),
        "size_bytes": sum(f["size"] for f in manifest["files"]),
        "reference": manifest["reference"],
    }

    def human() -> None:
        say(
            f"bundle {data['bundle_key']} ({data['pipeline']} for {data['target']}, "
            f"{data['files']} files, {size_text(data['size_bytes'])})"
        )

    emit(data, as_json, human)


class BundleFailed(FarmError):
    """A bundle's build failed (a part did not compile): its reason."""

    kind, code = Kind.JOB_FAILED, "bundle_failed"


BUILD_FINAL = ("done", "failed")
BUILD_POLL_SECONDS = 1.0


def wait_for_build(farm: Backend, bundle_key: str, timeout: float) -> dict[str, Any]:
    """Poll a bundle's build until it is done or failed (`timeout` seconds, 0: no limit)."""
    started = time.monotonic()
    while True:
        build = farm.bundle_build(bundle_key)
        if build is None:
            raise NotFound(f"the farm was never asked for bundle {bundle_key}")
        if build["state"] in BUILD_FINAL:
            return build
        if timeout and time.monotonic() - started > timeout:
            raise WaitTimeout(
                f"gave up waiting for bundle {bundle_key}: still {build['state']} after "
                f"{timeout:.0f} s (--wait-timeout); its parts go on (farm status {bundle_key})"
            )
        time.sleep(BUILD_POLL_SECONDS)


def emit_build(build: dict[str, Any], as_json: bool) -> None:
    """A bundle's build: its state and each part's (`farm submit FOLDER`, `farm status KEY`)."""

    def human() -> None:
        say(
            f"bundle {build['bundle_key']} ({build['pipeline']} for {build['target']}): "
            f"{build['state']}"
        )
        if build.get("error"):
            say(f"  error: {build['error']}")
        for part in build["parts"]:
            where = f" on {part['worker']}" if part.get("worker") else ""
            say(
                f"  part {part['name']} {part['part_key'][:12]}: {part['state']}{where} "
                f"(queue {part['queue']})"
            )

    emit(build, as_json, human)


def pull_folder(
    folder: Path, options: dict[str, Any], output: Path | None, quiet: bool, as_json: bool
) -> None:
    """`farm pull ./folder --device ... -o DIR`: the key computed here, offline, from the
    folder and this host's releases; the bundle verified file by file into DIR."""
    from farm.core.pipelines import folder_key
    from farm.core.signing import TrustedKeys, public_key_path
    from farm.edge.bundle import pull
    from farm.genai import toolchain

    if output is None:
        raise SpecError("farm pull <folder> needs -o DIR: the ready folder to write")
    pipeline, genai = folder_and_options(folder, options)
    key = folder_key(pipeline, genai, toolchain(genai.target))
    farm = backend()
    settings = get_settings()
    own = public_key_path(settings.embedded_signing_key)
    trusted = TrustedKeys.from_files(
        [*settings.trusted_key_paths, *([own] if own.exists() else [])]
    )
    total = sum(f["size"] for f in farm.bundle_manifest(key)["manifest"]["files"])
    with progress_bar(f"pulling {key[:12]}", total, quiet or as_json) as advance:
        manifest = pull(_FarmSource(farm), key, output, trusted, local=folder, progress=advance)
    data = {
        "bundle_key": key,
        "output": str(output),
        "files": len(manifest.files),
        "size_bytes": manifest.size,
    }
    emit(data, as_json, lambda: say(f"bundle {key} → {output} ({len(manifest.files)} files)"))
