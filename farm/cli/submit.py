"""`farm submit`, and what `farm pull MODEL`, `farm channel` and `farm verify` share with it:
the spec flags as a matrix, the source flags, a source's key and recipe.

It works against the farm API when FARM_API_URL is set, else against the database and store
directly (`farm.cli.backend`); the output is the same either way.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import click
from rich.text import Text

import farm.cli as cli_package
from farm.cli import main
from farm.cli.backends import Advance, Backend
from farm.cli.backends.ahead import (
    compile_ahead,
    discard_prestaged,
    prestage_model,
    prestage_unhashed,
    prestart_compile,
)
from farm.cli.common import (
    EXIT_CODES,
    EXIT_JOB_FAILED,
    backend,
    emit,
    err,
    handle_errors,
    json_option,
    note,
    print_job,
    progress_bar,
    say,
    spec_options,
)
from farm.cli.compression import CompressionRequest, compression_options, compression_request
from farm.cli.hash_ahead import HashAhead
from farm.cli.pipelines import pipeline_options, submit_folder
from farm.core import sourceref, sources, stages
from farm.core.config import get_settings
from farm.core.digests import digest_cache
from farm.core.errors import CompilerUnavailable, WaitTimeout
from farm.core.identity import Digest, ModelRef
from farm.core.pipelines import looks_like_pipeline
from farm.core.spec import CompileSpec, SpecError, Toolchain
from farm.core.text import printable
from farm.core.vocabulary import EMBEDDED_QUEUE, FINAL_STATES, JobState

WAIT_POLL_SECONDS = 0.5


def specs_from_options(options: dict[str, Any]) -> list[CompileSpec]:
    """The spec flags as a matrix: `--device 3720,4000 --batch 1,4` gives four specs."""
    devices = _split(options["device"])
    try:
        tiles: list[int | None] = [int(t) for t in _split(options["tiles"])] or [None]
        batches: list[int | None] = [int(b) for b in _split(options["batch"])] or [None]
    except ValueError as error:
        raise SpecError(f"--tiles and --batch take integers: {error}") from None
    # Each spec is a compile; the API has the same limit (HTTP 422 matrix_too_large).
    count, limit = len(devices) * len(tiles) * len(batches), get_settings().max_matrix
    if count > limit:
        raise SpecError(f"{count} specs is over the limit of {limit} (FARM_MAX_MATRIX)")
    try:
        return [
            CompileSpec.create(
                device,
                tiles=tile,
                performance_hint=options["hint"],
                compiler_params=options["compiler_params"],
                shapes=options["shapes"],
                batch=batch,
                layout=options["layouts"],
                weightless=options["weightless"],
                config=options["configs"],
            )
            for device, tile, batch in itertools.product(devices, tiles, batches)
        ]
    except ValueError as error:
        if isinstance(error, SpecError):
            raise
        raise SpecError(f"--tiles and --batch take integers: {error}") from None


def source_options(command: Any) -> Any:
    """--example-input and --task: what converting a source needs; the compression flags
    (`farm.cli.compression`): the stages a recipe may add (docs §15)."""
    command = compression_options(command)
    command = click.option(
        "--task",
        metavar="TASK",
        help="Hugging Face folders: the optimum export task (text-generation-with-past, "
        "text-classification, ...); default: from config.json's architectures.",
    )(command)
    return click.option(
        "--example-input",
        "example_inputs",
        multiple=True,
        metavar="NAME[d1,...]:TYPE",
        help="PyTorch sources: an input's shape and type, in the order the model takes them "
        "(repeat, or separate with ;), e.g. 'x[1,3,224,224]:f32'.",
    )(command)


def source_ref(
    model: Path,
    example_inputs: tuple[str, ...],
    task: str | None,
    progress: Any = None,
    compressed: CompressionRequest | None = None,
    digests: Digest | None = None,
) -> tuple[ModelRef, sources.Source]:
    """The model as submitted or pulled: any source format (`sources.detect`), its digests
    (`digests`; default: the digest cache's), and the recipe it needs (`stages.recipe_for`,
    then the compression asked for): the same key on a submitter and an edge."""
    extra: tuple[stages.Stage, ...] = ()
    if compressed is not None and compressed.kind:
        extra = (stages.Stage.create(compressed.kind, compressed.args),)
    digests = digests or digest_cache(get_settings().cache_dir).sha256
    return sourceref.source_ref(
        model, example_inputs, task, extra, progress=progress, digests=digests
    )


def _split(value: str | None) -> list[str]:
    return [part.strip() for part in str(value).split(",") if part.strip()] if value else []


@main.command()
@click.argument("model", type=click.Path(path_type=Path))
@spec_options(device_required=True)
@source_options
@pipeline_options
@click.option("--wait/--no-wait", default=False, help="Follow queued jobs to their end.")
@click.option(
    "--wait-timeout",
    type=click.FloatRange(min=0),
    default=600,
    show_default=True,
    metavar="SECONDS",
    help="With --wait: give up (exit 7) on a job no worker took in this time; 0: never.",
)
@click.option(
    "--toolchain",
    "toolchain_file",
    type=click.File("r"),
    help="Compile for this toolchain (a file `farm toolchain --json` wrote; - for stdin).",
)
@click.option(
    "--inputs",
    "reference_inputs",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Reference inputs (.npz, arrays named after the model's inputs) the worker computes "
    "the blob's reference outputs from, for farm verify; default: inputs seeded from the key.",
)
@click.option(
    "--rebuild",
    is_flag=True,
    help="Compile again where the blob is quarantined (a failed farm verify): a new job and a "
    "new blob replace it; its verifications stay on record.",
)
@click.option("--quiet", "-q", is_flag=True, help="No progress bars.")
@json_option
@handle_errors
def submit(
    model: Path,
    wait: bool,
    wait_timeout: float,
    toolchain_file: Any,
    reference_inputs: Path | None,
    rebuild: bool,
    quiet: bool,
    as_json: bool,
    example_inputs: tuple[str, ...],
    task: str | None,
    **options: Any,
) -> None:
    """Compile MODEL for a target (or a matrix: --device 3720,4000 --batch 1,4).

    MODEL: OpenVINO IR or ONNX, compiled as it is; or a source the farm converts first (once,
    cached): TFLite, PaddlePaddle, a TensorFlow SavedModel folder or frozen .pb, a torch.export
    .pt2 or TorchScript .pt (with --example-input), a Hugging Face folder (--task).

    Embedded (nothing configured): compiles here, now. Served: queues jobs for workers, through
    the API when FARM_API_URL is set. A blob that already exists is a hit: nothing is uploaded.
    MODEL may be a GenAI pipeline folder (LLM, VLM, Whisper, text-to-image): it compiles into
    one signed bundle (`farm pull FOLDER --device ... -o DIR` fetches it).
    """
    if options.get("pipeline") or looks_like_pipeline(model):
        submit_folder(model, {**options, "wait": wait, "wait_timeout": wait_timeout}, as_json)
        return
    compressed = compression_request(options)
    specs = specs_from_options(options)
    compressed.check_targets([spec.target.name for spec in specs])
    source = sources.detect(model)
    digests = digest_cache(get_settings().cache_dir)
    ahead = None
    if cli_package.whole_process and threading.active_count() == 1:  # a fork is safe
        ahead = HashAhead.start(source.files, model.name, quiet or as_json, digests)
    staged = False
    compiled_as_is = not source.needs_conversion and compressed.kind is None  # no stage first
    try:
        try:
            if ahead is not None:  # files new here: their compile child and their copy to the
                # store start beside the hash
                if compiled_as_is:
                    staged = prestart_compile(get_settings(), specs[0].target)
                copying = prestage_unhashed(get_settings(), ahead.files, compiled_as_is)
                if staged and copying:  # and the compile itself, beside the hash
                    compile_ahead(get_settings(), specs[0], source.files)
                staged = copying or staged
            # OpenVINO loads only here (the listing commands start without it), beside the hash.
            from farm import prepare, toolchain

            _load_what_submit_needs()
            total = sum(f.stat().st_size for f in source.files.values())
            hashing = progress_bar(f"hashing {model.name}", total, quiet or as_json)
            with contextlib.nullcontext(None) if ahead else hashing as advance:
                ref, source = source_ref(
                    model,
                    example_inputs,
                    task,
                    advance,
                    compressed,
                    ahead.digest if ahead else digests.sha256,
                )
        finally:
            if ahead:
                ahead.close()
        staged = prestage_model(get_settings(), ref, compiled_as_is) or staged
        if not source.needs_conversion:  # a source is checked on the worker, once converted
            for spec in specs:
                prepare.check_model(ref.files, spec)
            compressed.check_calibration(ref.files)
        if toolchain_file is not None:
            wanted = Toolchain.from_json(_json_of(toolchain_file), (s.target for s in specs))
        else:
            cpu = next((s.target for s in specs if not s.target.is_npu), None)
            wanted = toolchain.host_toolchain(cpu or specs[0].target)
        farm = backend()
        progress = _SubmitProgress(model.name, quiet or as_json)
        if reference_inputs is not None:
            from farm.core.reference import load_inputs  # numpy: only for --inputs

            load_inputs(reference_inputs)  # a bad file is exit 2 here, not a note on the blob later
        answer = farm.submit(
            ref,
            specs,
            wanted,
            progress,
            rebuild=rebuild,
            reference_inputs=reference_inputs,
            extra_files=compressed.files_to_upload(),
            max_drift=str(compressed.max_drift) if compressed.max_drift else None,
        )
        results = answer["results"]
        for result in results:
            if result.get("reason") is None:
                result.pop("reason", None)
        if len(results) == 1 and results[0]["outcome"] == "unavailable":
            raise CompilerUnavailable(results[0]["reason"])
        if wait:
            for result in results:
                if result["job"] and result["job"]["state"] not in FINAL_STATES:
                    result["job"] = _wait(farm, result["job"]["id"], quiet or as_json, wait_timeout)
        _print_submission(answer, as_json)
        worst = max(map(_exit_code_of, results))
    finally:
        if staged:
            discard_prestaged()
    if worst:
        sys.exit(worst)
    if cli_package.whole_process and getattr(farm, "embedded", False):
        _end_now(farm)


def _load_what_submit_needs() -> None:
    """Import what the submit goes on with (the embedded farm's job service and runner, or the
    HTTP client), while the model is hashed (`HashAhead`)."""
    if get_settings().api_url:
        import farm.cli.backends.http  # noqa: F401

        return
    with contextlib.suppress(ModuleNotFoundError):  # no farm[embedded]: `backend()` says so
        from farm.cli.backends.direct import preload_submit

        preload_submit()


def _end_now(farm_backend: Any) -> None:
    """End the embedded `farm submit` once its answer is written: the database closed, the
    output flushed, then `os._exit(0)`, without the interpreter's teardown (about 0.3-1 s with
    OpenVINO's CPU plugin loaded; bench/README.md "submit_overhead")."""
    farm_backend.finish()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _exit_code_of(result: dict[str, Any]) -> int:
    """A spec's share of `farm submit`'s exit code; the command exits with the worst."""
    if result["outcome"] == "unavailable":
        return EXIT_CODES[CompilerUnavailable.kind]
    job = result["job"]
    if job and job["state"] in (JobState.FAILED, JobState.CANCELLED):
        return EXIT_JOB_FAILED
    return 0


class _SubmitProgress:
    """Progress of a submission on stderr: a bar while uploading, a spinner while compiling."""

    def __init__(self, model_name: str, quiet: bool) -> None:
        self.model_name, self.quiet = model_name, quiet

    def uploading(self, total_bytes: int) -> contextlib.AbstractContextManager[Advance]:
        return progress_bar(f"uploading {self.model_name}", total_bytes, self.quiet)

    def compiling(self, what: str) -> contextlib.AbstractContextManager[object]:
        if self.quiet:
            return contextlib.nullcontext()
        return err.status(Text(printable(f"compiling {what}", multiline=False)))


def _wait(farm: Backend, job_id: int, quiet: bool, timeout: float = 0) -> dict[str, Any]:
    """Poll a job until it reaches a final state. A job no live worker can take is given up on
    at once (WaitTimeout, with the job's note): waiting would last until the timeout for
    nothing. One still queued after `timeout` seconds (0: never) is given up on too; either
    way the job itself goes on. A note of the job (a broker that did not take it) is said
    once."""
    status = contextlib.nullcontext() if quiet else err.status(f"waiting for job {job_id}")
    started, noted, checked = time.monotonic(), False, False
    with status as shown:
        while True:
            job = farm.job(job_id)
            if job["state"] in FINAL_STATES:
                return job
            queued = job["state"] == JobState.QUEUED
            if queued and not checked and not _has_taker(farm, job):
                why = job.get("note") or f"no live worker takes its queue {job['queue']}"
                raise WaitTimeout(f"not waiting for job {job_id}: {why}; {_stays_queued(job_id)}")
            checked = checked or queued
            if job.get("note") and not noted:
                note(f"job {job_id}: {job['note']}")
                noted = True
            if timeout and queued and time.monotonic() - started > timeout:
                raise WaitTimeout(
                    f"gave up waiting for job {job_id}: still queued after {timeout:.0f} s "
                    f"(--wait-timeout){'; ' + job['note'] if job.get('note') else ''}; "
                    f"{_stays_queued(job_id)}"
                )
            if shown:
                shown.update(Text(printable(f"job {job_id}: {job['state']}")))
            time.sleep(WAIT_POLL_SECONDS)


def _has_taker(farm: Backend, job: dict[str, Any]) -> bool:
    """Whether a live worker consumes the queued job's queue (an embedded farm's job is run by
    the farm itself)."""
    if job["queue"] == EMBEDDED_QUEUE:
        return True
    return any(worker["live"] and job["queue"] in worker["queues"] for worker in farm.workers())


def _stays_queued(job_id: int) -> str:
    return f"the job stays queued: follow it with `farm status {job_id}`, or `farm cancel {job_id}`"


def _json_of(stream: Any) -> Any:
    try:
        return json.load(stream)
    except ValueError as error:
        raise SpecError(f"--toolchain {stream.name}: not JSON ({error})") from None


def _print_submission(answer: dict, as_json: bool) -> None:
    results = answer["results"]
    if len(results) == 1:
        data = {k: v for k, v in results[0].items() if k != "target"}
        if data["job"] is None:
            del data["job"]
        elif data["job"].get("note"):
            data["note"] = data["job"]["note"]
    else:
        data = answer

    def human() -> None:
        for result in results:
            say(f"cache key  {result['cache_key']}  ({result['target']})")
            if result["outcome"] == "unavailable":
                say(f"outcome    unavailable (no job): {result['reason']}")
            elif result["job"] is None:
                say("outcome    hit (the blob exists; nothing compiled)")
                if result.get("reason"):
                    say(f"note       {result['reason']}")
            else:
                print_job(result["job"])

    emit(data, as_json, human)
