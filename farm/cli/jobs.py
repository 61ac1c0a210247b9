"""Commands about jobs and blobs: submit, status, jobs, logs, cancel, blobs, pull, run, workers.

Each works against the farm API when FARM_API_URL is set, else against the database and store
directly (`farm.cli.backend`); the output is the same either way.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import click
from rich.table import Table
from rich.text import Text

from farm.cli import main
from farm.cli.backends import Advance, Backend
from farm.cli.common import (
    EXIT_CODES,
    EXIT_JOB_FAILED,
    backend,
    cell,
    emit,
    err,
    handle_errors,
    json_option,
    note,
    out,
    print_blob,
    print_job,
    progress_bar,
    resolve_key,
    say,
    size_text,
    spec_options,
)
from farm.cli.compression import CompressionRequest, compression_options, compression_request
from farm.cli.pipelines import pipeline_options, submit_folder
from farm.core import keyprefix, sources, stages
from farm.core.config import get_settings
from farm.core.digests import digest_cache
from farm.core.errors import CompilerUnavailable, NotFound, WaitTimeout
from farm.core.identity import ModelRef
from farm.core.pipelines import looks_like_pipeline
from farm.core.spec import CompileSpec, SpecError, Toolchain
from farm.core.text import converters_text, printable, toolchains_text
from farm.core.vocabulary import EMBEDDED_QUEUE, FINAL_STATES, JOB_STATES, JobState

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
) -> tuple[ModelRef, sources.Source]:
    """The model as submitted or pulled: any source format (`sources.detect`), its digests,
    and the recipe it needs (`stages.recipe_for`, then the compression asked for): the same
    key on a submitter and an edge."""
    source = sources.detect(model)
    recipe = stages.recipe_for(source, example_inputs, task)
    if compressed is not None and compressed.kind:
        recipe = (*recipe, stages.Stage.create(compressed.kind, compressed.args))
    digests = digest_cache(get_settings().cache_dir).sha256
    ref = ModelRef.from_source(model, progress, digests=digests).with_recipe(recipe)
    return ref, source


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
        submit_folder(model, options, as_json)
        return
    # OpenVINO loads only here: the listing commands start without it.
    from farm import prepare, toolchain

    compressed = compression_request(options)
    specs = specs_from_options(options)
    compressed.check_targets([spec.target.name for spec in specs])
    source = sources.detect(model)
    total = sum(f.stat().st_size for f in source.files.values())
    with progress_bar(f"hashing {model.name}", total, quiet or as_json) as advance:
        ref, source = source_ref(model, example_inputs, task, advance, compressed)
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
    if worst:
        sys.exit(worst)


def _compressed_cell(compressed: dict[str, Any] | None) -> str:
    """`int4_sym 0.144x` for a blob of a compressed model (`farm blobs`); empty otherwise."""
    if not compressed:
        return ""
    what = compressed["args"].get("mode") or compressed["args"].get("precision")
    ratio = (compressed.get("metrics") or {}).get("ratio")
    return f"{what} {ratio:.3g}x" if ratio else str(what)


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


@main.command()
@click.argument("job_or_key")
@json_option
@handle_errors
def status(job_or_key: str, as_json: bool) -> None:
    """Show a job (by number) or a cache key (its blob, or its latest job); a unique prefix of
    the key (8 hex characters or more) will do."""
    if not job_or_key.isdigit():
        keyprefix.normalize(job_or_key)  # a bad key fails before any farm is opened
    farm = backend()
    if job_or_key.isdigit():
        try:
            job = farm.job(int(job_or_key))
        except NotFound:
            # Eight digits or more may also be a key prefix (git's rule): try that too.
            if len(job_or_key) < keyprefix.MIN_PREFIX:
                raise
        else:
            emit(job, as_json, functools.partial(print_job, job))
            return
    key = resolve_key(farm, job_or_key)
    blob, latest = farm.resolve(key), farm.latest_job(key)
    if blob is None and latest is None:
        raise NotFound(f"no blob and no job for cache key {key}")

    def human() -> None:
        out.print(f"cache key  {key}")
        if blob is not None:
            print_blob(blob)
        if latest is not None:
            print_job(latest)

    emit({"cache_key": key, "blob": blob, "job": latest}, as_json, human)


@main.command()
@click.option("--state", type=click.Choice(JOB_STATES))
@click.option("--target", help="Only jobs for this target.")
@click.option("--model", help="Only jobs of this model (digest or file name).")
@click.option("--submitter", help="Only jobs of this submitter (token name).")
@click.option("--since", type=click.DateTime(), help="Only jobs created since (UTC).")
@click.option("--limit", type=click.IntRange(1), default=50, show_default=True)
@json_option
@handle_errors
def jobs(
    state, target, model, submitter, since: datetime | None, limit: int, as_json: bool
) -> None:
    """List jobs, newest first."""
    for flag, value in (("--model", model), ("--submitter", submitter)):
        if value is not None and not value.isprintable():
            raise SpecError(f"{flag} {value!r} has control characters or is not UTF-8")
    rows = backend().jobs(
        state=state,
        target=target,
        model=model,
        submitter=submitter,
        since=since.replace(tzinfo=UTC) if since else None,
        limit=limit,
    )

    def human() -> None:
        table = Table("job", "model", "target", "state", "queue", "created", "error")
        for row in rows:
            table.add_row(
                cell(row["id"]),
                cell(row.get("model_name")),
                cell(row["target"]),
                cell(row["state"]),
                cell(row["queue"]),
                cell(str(row["created_at"])[:19]),
                cell((row["error"] or "")[:60]),
            )
        out.print(table)

    emit(rows, as_json, human)


@main.command()
@click.argument("job_id", type=int)
@json_option
@handle_errors
def logs(job_id: int, as_json: bool) -> None:
    """Print a job's log: the properties used, timings, and the compiler's output."""
    entry = backend().log(job_id)
    emit(
        entry,
        as_json,
        lambda: click.echo(printable(entry["log"]) or f"job {job_id} has no log yet"),
    )


@main.command()
@click.argument("job_id", type=int)
@json_option
@handle_errors
def cancel(job_id: int, as_json: bool) -> None:
    """Cancel a job: a queued job never starts; a running compile is stopped by its worker."""
    job = backend().cancel(job_id)
    emit(job, as_json, functools.partial(print_job, job))


@main.group(invoke_without_command=True)
@click.option("--target", help="Only blobs for this target.")
@click.option("--limit", type=click.IntRange(1), default=100, show_default=True)
@click.option("--all", "show_all", is_flag=True, help="Every blob (read a page at a time).")
@json_option
@click.pass_context
@handle_errors
def blobs(
    context: click.Context, target: str | None, limit: int, show_all: bool, as_json: bool
) -> None:
    """List the stored blobs, newest first (or quarantine and release one: the subcommands)."""
    if context.invoked_subcommand is not None:
        return
    rows = backend().blobs(target, None if show_all else limit)

    def human() -> None:
        headers = (
            *("cache key", "model", "target", "OpenVINO", "size", "compile s", "created"),
            *("state", "compressed"),
        )
        cells = [
            [
                row["cache_key"],
                row.get("model_name") or "",
                row["target"],
                row["openvino"],
                size_text(row["size_bytes"]),
                f"{row['compile_seconds'] or 0:.2f}",
                str(row["created_at"])[:19],
                "QUARANTINED" if row.get("quarantined_at") else "",
                _compressed_cell(row.get("compression")),
            ]
            for row in rows
        ]
        width = _key_width(headers, cells, out.width)
        table = Table(*headers)
        for line in cells:
            key = line[0] if width >= len(line[0]) else line[0][: width - 1] + "…"
            table.add_row(cell(key), *(cell(value) for value in line[1:]))
        out.print(table)

    emit(rows, as_json, human)


@main.command()
@click.option("--all", "show_all", is_flag=True, help="Include stopped and silent workers.")
@json_option
@handle_errors
def workers(show_all: bool, as_json: bool) -> None:
    """List the workers: what each serves and when it was last seen."""
    rows = [w for w in backend().workers() if show_all or w["live"]]

    def human() -> None:
        table = Table(
            "worker", "live", "toolchains", "converters", "memory", "OpenVINO", "last seen"
        )
        for row in rows:
            table.add_row(
                cell(row["name"]),
                "yes" if row["live"] else "no",
                cell(toolchains_text(row.get("toolchains"))),
                cell(converters_text(row.get("converters"))),
                size_text(row["memory_bytes"]),
                cell(row["openvino"].split("-")[0]),
                cell(str(row["heartbeat_at"])[:19]),
            )
        out.print(table)

    emit(rows, as_json, human)


def _key_width(headers: tuple[str, ...], cells: list[list[str]], terminal: int) -> int:
    """Room for the cache key (the first column) once the other columns have theirs: the whole
    key (what `farm status` and edges take) where the terminal allows, at least 16 characters."""
    others = sum(
        max([len(header), *(len(line[n]) for line in cells)]) + 3
        for n, header in enumerate(headers)
        if n
    )
    return max(16, terminal - others - 4)
