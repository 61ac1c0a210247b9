"""Run one compile in a child process that the caller can watch, stop and time out.

A compile can take hours, use tens of GB, or crash on a hostile model. In a child process it
fails its own job only; the parent stays free to renew the job's lease, notice a cancel, and
kill the compile (an OpenVINO compile cannot be interrupted inside a process). The child's
stderr is the compiler's own output and goes into the job log.

Limits: wall time (the parent kills the child past `timeout_seconds`), memory (the child's
address space, ``RLIMIT_AS``, so an allocation past the limit fails inside the child instead of
waking the kernel's OOM killer, which may pick the worker) and the size of what it writes
(``RLIMIT_FSIZE`` at the blob limit: a few KB of IR can broadcast a constant to GBs at compile
time, and the kernel stops the child at its first byte past the limit). No core dumps: a
crashing compile of a 20 GB model would otherwise write 20 GB to disk.

What the child holds: only what a compile needs. Its environment is an allowlist
(`child_environment`: no database, broker or S3 credentials, no signing key path), and it runs
as a user of its own (`compile_identity`, ``FARM_COMPILE_USER``, default ``nobody``), so it can
read neither the signing key (mode 0600, the worker's) nor ``/proc/<worker>/environ``:
- a worker running as root starts the child as root; the child caps itself, loads OpenVINO and
  the target's plugin (which may live where that user cannot read, such as a home folder), then
  switches user for good before it reads a byte of the model;
- a worker that is not root (the Docker image's ``farm``) starts it through a launcher
  (``FARM_COMPILE_LAUNCHER``: a copy of util-linux ``setpriv`` with the file capabilities
  ``cap_setuid,cap_setgid``, executable only by the worker's group), which drops to that user
  before Python starts. Such a worker cannot signal its child (another uid), so it stops it,
  and empties its folder, through the launcher too (`farm.server.jobs.compile_user`).
The child works in a folder of its own (the box) that holds its model files and the blob it
writes: hard links to the model files where that user may read them, else read-only copies.
The box belongs to that user (root worker) or to the worker with that user's group (launcher).
The parent takes the blob out of the box by its expected name, a regular file, never by a path
the child reports. When the child ends, whatever it left running in its process group is
killed before its exit is collected (its pid cannot have been reused meanwhile).

Note: ``RLIMIT_AS`` counts reserved address space, not only resident memory: thread stacks,
allocator arenas and the memory-mapped ``.bin`` all count. A compile needs about 0.7 GB of it
before touching the model (Python, OpenVINO, its CPU plugin); the default limit is a share of
the host's memory (`Settings.resolved_compile_memory_bytes`), far above that.

Protocol: ``python -m farm.server.jobs.sandbox REQUEST_FD RESULT_FD``: the request (JSON) is
read from, and the result written to, descriptors the parent opened and passed (the child's
user may open neither file). The result holds either the `CompileResult` fields or
``{"error": code, "message": ...}`` (the error's `FarmError.code`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import importlib
import io
import json
import logging
import os
import resource
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any, NoReturn, Protocol

from farm.core import errors
from farm.core.errors import CompileCancelled, CompileTimeout
from farm.core.identity import FileVersion, version_now
from farm.core.sources import layout
from farm.core.spec import CompileSpec, Target, Toolchain
from farm.runtime_import import skip_conversion_api
from farm.server.jobs.compile_user import (
    ChildUser,
    as_compile_user,
    compile_identity,
    kill_group,
    launched,
)
from farm.server.processes import die_with_parent as _die_with_parent

log = logging.getLogger(__name__)
POLL_SECONDS = 0.5
SOURCE_PREFIX = "source:"
"""Roles of a reference run's source files (beside the converted model's own roles)."""
CPU = Target.parse("CPU")
"""Where reference outputs are computed, whatever the blob's target."""
LOG_TAIL_BYTES = 64 * 1024
"""How much of the compiler's output is kept for the job log."""
_MEMORY_SIGNS = (
    "std::bad_alloc",  # C++ new
    "Failed to allocate",  # OpenVINO's CPU plugin
    "Cannot allocate memory",  # ENOMEM
    "Resource temporarily unavailable",  # EAGAIN: no room for a new thread's stack
    "can't start new thread",  # Python's words for the same
    "failed to map segment",  # the loader, opening a plugin library
)
"""How an allocation refused by ``RLIMIT_AS`` shows in the errors of a compile (measured)."""


ENV_NAMES = frozenset(
    {
        "PATH",
        "LANG",
        "LANGUAGE",
        "TZ",
        "LD_LIBRARY_PATH",
        "PYTHONPATH",
        "PYTHONHOME",
        "PYTHONHASHSEED",
        "PYTHONIOENCODING",
        "PYTHONUTF8",
        "VIRTUAL_ENV",
        "GLIBC_TUNABLES",
    }
)
"""Variables the compile child keeps from the worker's environment (with ENV_PREFIXES)."""
ENV_PREFIXES = ("LC_", "OV_", "OPENVINO", "NPU", "ZE_", "TBB_", "OMP_", "ONEDNN_", "DNNL_")
"""Locale, OpenVINO and its NPU driver (Level Zero), and the threading libraries it uses."""
_PR_SET_PDEATHSIG = 1
_PR_SET_NO_NEW_PRIVS = 38


def compile_in_child(
    files: Mapping[str, Path],
    spec: CompileSpec,
    out_dir: Path,
    blob_id: str,
    *,
    timeout_seconds: float,
    memory_bytes: int | None = None,
    max_blob_bytes: int | None = None,
    compile_user: str | None = None,
    compile_launcher: Path | None = None,
    should_stop: Callable[[], bool] = lambda: False,
    in_place: Mapping[str, tuple[Path, FileVersion]] | None = None,
):
    """Compile in a child process; returns (`CompileResult`, compiler output), the blob at
    ``out_dir/<blob_id>.blob``.

    `in_place`: by role, a file with the same bytes as `files`' (the user's file that an
    embedded submit copied into its store around the page cache) and the version it had then.
    The child reads it where it is when it may (`readable_in_place`) and it still has that
    version; when its version has changed by the end of the compile, the model is compiled
    again from `files`.

    `memory_bytes` caps the child's address space (None: no cap); a compile that needs more
    fails with CompileError "... exceeded its memory limit of N bytes". `max_blob_bytes` caps
    the files it writes (None: no cap); a bigger blob fails with BlobTooLarge.
    `compile_user`, `compile_launcher`: who compiles, and how a worker that is not root
    becomes that user (see `compile_identity`).
    `should_stop` is called every POLL_SECONDS; True kills the child (CompileCancelled).
    Raises the child's CompileError / ModelError / CompilerUnavailable as the same classes;
    those and CompileTimeout carry the compiler's output in `.output`, for the job log.
    """
    # OpenVINO stays out of the watching process: only the child loads it and compiles.
    from farm.server.jobs import compiler

    started = time.monotonic()
    with _child_in_box(
        files,
        out_dir,
        blob_id,
        compile_identity(compile_user, compile_launcher),
        _compile_fields(spec, blob_id, memory_bytes, max_blob_bytes),
        timeout_seconds,
        should_stop,
        in_place=in_place,
    ) as run:
        claimed = False
        try:
            output = (AHEAD_NOTE if run.ahead else "") + _tail(run.log_path)
            if run.timed_out:
                raise _with_output(
                    CompileTimeout(
                        f"compile ran longer than its time limit of {timeout_seconds:.0f} s "
                        f"(FARM_MAX_RUN_SECONDS)"
                    ),
                    output,
                )
            result = _read_result(run.result_path)
            again = _compile_again(run, result)
            if again is None:
                if result is None:
                    death = _death(run.returncode, output, memory_bytes, max_blob_bytes)
                    raise _with_output(death, output)
                if "error" in result:
                    error = _CHILD_ERRORS.get(result["error"], errors.CompileError)(
                        result["message"]
                    )
                    raise _with_output(error, output)
                written = run.box / f"{run.blob_id}.blob"
                # The copy made of it as its child ended, if it is still that file: the
                # store's adopt_file takes it for the blob, wherever the blob was moved or
                # copied to (the box on another file system than the job's folder).
                unchanged = run.copied is not None and run.copied.matches(written)
                blob = _take_blob(written, out_dir / f"{blob_id}.blob")
                claimed = unchanged and run.copied is not None and run.copied.claim(blob)
        finally:
            if run.copied is not None and not claimed:  # void, failed, or not this blob
                run.copied.discard()
    if again is not None:  # the first child's box is gone; the second has the time left
        log.warning("%s: compiling the stored copy again", again)
        return compile_in_child(
            files,
            spec,
            out_dir,
            blob_id,
            timeout_seconds=max(1.0, timeout_seconds - (time.monotonic() - started)),
            memory_bytes=memory_bytes,
            max_blob_bytes=max_blob_bytes,
            compile_user=compile_user,
            compile_launcher=compile_launcher,
            should_stop=should_stop,
        )
    assert result is not None
    # The child's word is taken for how it compiled, not for where or how big its blob is.
    result["blob_path"] = blob
    result["size_bytes"] = blob.stat().st_size
    result["toolchain"] = Toolchain(**result["toolchain"])
    return compiler.CompileResult(**result), output


def _compile_fields(
    spec: CompileSpec, blob_id: str, memory_bytes: int | None, max_blob_bytes: int | None
) -> dict[str, object]:
    """A compile child's request, but for its files: what it compiles, and its limits."""
    return {
        "target": spec.target.name,
        "spec": spec.canonical(),
        "blob_id": blob_id,
        "memory_bytes": memory_bytes,
        "max_blob_bytes": max_blob_bytes,
    }


def _compile_again(run: _ChildRun, result: dict | None) -> str | None:
    """Why a compile that read the user's files in place is void, or None: a file changed
    while it ran, or the child could not read one where it is (an ACL or a security module
    the mode bits do not show)."""
    if run.changed_in_place:
        return f"{', '.join(map(str, run.changed_in_place))} changed while it was compiled"
    unread = result is not None and result.get("error") == errors.ModelError.code
    if run.in_place and unread:
        return f"the compile child could not read {', '.join(map(str, run.in_place))} in place"
    return None


def reference_in_child(
    files: Mapping[str, Path],
    spec: CompileSpec,
    out_dir: Path,
    cache_key: str,
    *,
    inputs_path: Path | None = None,
    timeout_seconds: float,
    memory_bytes: int | None = None,
    max_reference_bytes: int | None = None,
    compile_user: str | None = None,
    compile_launcher: Path | None = None,
    should_stop: Callable[[], bool] = lambda: False,
    source: tuple[str, Mapping[str, Path]] | None = None,
) -> tuple[Path | None, str | None]:
    """Compute the reference outputs of `spec`'s blob in a child process with the compile's
    limits (time, memory, user, environment): ``(out_dir/<cache_key>.npz, None)``, or
    ``(None, why not)``. It never fails the job: a blob without a reference is still a blob.
    `should_stop` True kills the child (CompileCancelled), as for the compile.
    `max_reference_bytes` caps what the child writes (RLIMIT_FSIZE), as the blob limit does.
    `source`: (format, files by role) of the source a convert stage made `files` from: the
    outputs are then computed from the source itself (`farm.server.stages.source_reference`),
    so the reference proves conversion and compile together (docs §15)."""
    staged = dict(files)
    names: dict[str, str] = {}
    if source is not None:
        for role, relative in layout(source[1]).items():
            staged[f"{SOURCE_PREFIX}{role}"] = source[1][role]
            names[f"{SOURCE_PREFIX}{role}"] = f"source/{relative}"
        names.update({role: f"model.{role}" for role in files})
    with _child_in_box(
        staged,
        out_dir,
        f"{cache_key}.reference",
        compile_identity(compile_user, compile_launcher),
        {
            "task": "reference",
            "target": spec.target.name,
            "spec": spec.canonical(),
            "blob_id": cache_key,
            "memory_bytes": memory_bytes,
            "max_blob_bytes": max_reference_bytes,
            "source_format": source[0] if source else None,
        },
        timeout_seconds,
        should_stop,
        {"inputs": inputs_path},
        names=names or None,
    ) as run:
        if run.timed_out:
            return None, f"no reference outputs: the CPU run took over {timeout_seconds:.0f} s"
        result = _read_result(run.result_path)
        if result is None:
            death = _death(run.returncode, _tail(run.log_path), memory_bytes, max_reference_bytes)
            return None, f"no reference outputs: {death}"
        if "skipped" in result:
            return None, str(result["skipped"])
        try:  # the same checks as for a blob: the box is the compile user's (a link, a FIFO)
            return _take_blob(run.box / f"{cache_key}.npz", out_dir / f"{cache_key}.npz"), None
        except (errors.CompileError, OSError) as error:
            return None, f"no reference outputs: {error}"


@dataclass(frozen=True)
class StageRun:
    """What a stage's child made: the output IR (taken out of the box), what it reports."""

    xml: Path
    bin: Path
    tool_versions: dict
    metrics: dict
    output: str
    sha256: dict[str, str] | None = None
    """The output files' digests as the child hashed them while compiling (None: no
    compile); the store checks them as it takes the files in."""
    compiled: Any = None
    """With `compile_spec`: the `CompileResult` of the same child (its blob taken out of the
    box), or the compile's error (the stage itself succeeded), to raise as a compile's."""


STAGE_OUTPUT = {"xml": "out/model.xml", "bin": "out/model.bin"}
"""Where a stage's child writes its output IR, relative to its box."""
CACHE_ENTRIES = "cache-entries"
"""Where a pipeline child finds the compiled entries it is given (`pipeline_in_child`)."""


def stage_in_child(
    kind: str,
    files: Mapping[str, Path],
    names: Mapping[str, str],
    args: Mapping[str, object],
    out_dir: Path,
    stage_key: str,
    *,
    timeout_seconds: float,
    memory_bytes: int | None = None,
    max_output_bytes: int | None = None,
    compile_user: str | None = None,
    compile_launcher: Path | None = None,
    should_stop: Callable[[], bool] = lambda: False,
    options: Mapping[str, object] | None = None,
    compile_spec: tuple[CompileSpec, str] | None = None,
) -> StageRun:
    """Run one stage (`kind`: convert, compress, ...) in a child with the compile's limits
    (time, memory, output size, user, environment, no network): its input `files` staged at
    `names` (relative paths, under ``input/``), its output IR moved to `out_dir`.

    The child is `farm.server.stages.child`: it runs the kind's module. Raises
    ConversionError (with the child's output) for a stage that failed, CompileTimeout past
    `timeout_seconds`, CompileCancelled when `should_stop` says so.
    `compile_spec`: (spec, blob id): the same child then compiles the output for the spec
    (the compile op's code and properties, from the model still in memory), its blob moved to
    ``out_dir/<blob id>.blob``; a failed compile is `StageRun.compiled`, not the stage's."""
    compile_fields = None
    if compile_spec is not None:
        spec, blob_id = compile_spec
        compile_fields = {"target": spec.target.name, "spec": spec.canonical(), "blob_id": blob_id}
    with _child_in_box(
        files,
        out_dir,
        f"{stage_key}.stage",
        compile_identity(compile_user, compile_launcher),
        {
            "task": "stage",
            "kind": kind,
            "args": dict(args),
            "options": dict(options or {}),
            "memory_bytes": memory_bytes,
            "max_blob_bytes": max_output_bytes,
            "compile": compile_fields,
        },
        timeout_seconds,
        should_stop,
        names={role: f"input/{name}" for role, name in names.items()},
    ) as run:
        result, output = _stage_result(run, kind, timeout_seconds, memory_bytes, max_output_bytes)
        taken = {
            role: _take_blob(run.box / relative, out_dir / Path(relative).name)
            for role, relative in STAGE_OUTPUT.items()
        }
        compiled = None
        if compile_fields is not None:
            compiled = _compiled_in_stage(result.get("compiled") or {}, run.box, out_dir)
    sha256 = result.get("output_sha256")
    return StageRun(
        taken["xml"],
        taken["bin"],
        dict(result.get("tool_versions") or {}),
        dict(result.get("metrics") or {}),
        output,
        {role: str(sha256[role]) for role in STAGE_OUTPUT} if sha256 else None,
        compiled,
    )


def drift_in_child(
    stage_kind: str,
    files: Mapping[str, Path],
    names: Mapping[str, str],
    args: Mapping[str, object],
    out_dir: Path,
    stage_key: str,
    *,
    timeout_seconds: float,
    memory_bytes: int | None = None,
    compile_user: str | None = None,
    compile_launcher: Path | None = None,
    should_stop: Callable[[], bool] = lambda: False,
) -> dict:
    """Measure a compression stage's drift in a child of its own with the compile's limits,
    after the compression's child has ended (farm.server.stages.drift): `files` are the
    uncompressed IR, the compressed one (roles ``compressed/...``) and any calibration files,
    staged at `names` under ``input/``. Its metrics (`drift`, `drift_seconds`, the child's
    `seconds` and `peak_rss_bytes`); raises like `stage_in_child`. Nothing is written out."""
    with _child_in_box(
        files,
        out_dir,
        f"{stage_key}.drift",
        compile_identity(compile_user, compile_launcher),
        {
            "task": "stage",
            "kind": "drift",
            "args": dict(args),
            "options": {"stage_kind": stage_kind},
            "memory_bytes": memory_bytes,
            "max_blob_bytes": None,  # writes nothing of its own
        },
        timeout_seconds,
        should_stop,
        names={role: f"input/{name}" for role, name in names.items()},
    ) as run:
        result, _ = _stage_result(run, "drift", timeout_seconds, memory_bytes, None)
    return dict(result.get("metrics") or {})


def _stage_result(
    run: _ChildRun,
    kind: str,
    timeout_seconds: float,
    memory_bytes: int | None,
    max_output_bytes: int | None,
) -> tuple[dict, str]:
    """A stage child's result and output, or the error it ended with."""
    output = _tail(run.log_path)
    if run.timed_out:
        raise _with_output(
            CompileTimeout(
                f"{kind} ran longer than its time limit of {timeout_seconds:.0f} s "
                "(FARM_MAX_RUN_SECONDS)"
            ),
            output,
        )
    result = _read_result(run.result_path)
    if result is None:
        death = _death(run.returncode, output, memory_bytes, max_output_bytes)
        raise _with_output(errors.ConversionError(f"{kind}: {death}"), output)
    if "error" in result:
        error_class = _CHILD_ERRORS.get(result["error"], errors.ConversionError)
        raise _with_output(error_class(result["message"]), output)
    return result, output


def _compiled_in_stage(compiled: dict, box: Path, out_dir: Path):
    """The compile of a stage's child (`stage_in_child`): its `CompileResult` with the blob
    taken out of the box, as `compile_in_child` takes it, or the error to raise."""
    from farm.server.jobs import compiler

    if "error" in compiled or "blob_id" not in compiled:
        code = compiled.get("error", errors.CompileError.code)
        message = compiled.get("message", "the stage's child reported no compile")
        return _CHILD_ERRORS.get(code, errors.CompileError)(message)
    blob_id = compiled.pop("blob_id")
    blob = _take_blob(box / f"{blob_id}.blob", out_dir / f"{blob_id}.blob")
    compiled["blob_path"] = blob
    compiled["size_bytes"] = blob.stat().st_size
    compiled["toolchain"] = Toolchain(**compiled["toolchain"])
    return compiler.CompileResult(**compiled)


@dataclass(frozen=True)
class PipelineRun:
    """What a pipeline's child compiled (taken out of the box) and its reference run."""

    outputs: dict[str, Path]
    reference: dict
    output: str


def pipeline_in_child(
    files: Mapping[str, Path],
    kind: str,
    target: str,
    options: Mapping[str, object],
    out_dir: Path,
    bundle_key: str,
    *,
    timeout_seconds: float,
    memory_bytes: int | None = None,
    compile_user: str | None = None,
    compile_launcher: Path | None = None,
    should_stop: Callable[[], bool] = lambda: False,
    convert_task: str | None = None,
    cache_entries: Mapping[str, Path] | None = None,
) -> PipelineRun:
    """Compile a GenAI pipeline folder (`files`: relative path -> file) in a child with the
    compile's limits (§17, `farm.server.bundles.compile.child_main`); its outputs (cache entries
    or NPU blobs, by their path in the bundle) are moved to `out_dir`. `cache_entries` (name ->
    file): compiled entries staged for the child beside the folder, read-only, in the folder
    its request names ``cache_entries``."""
    from farm.core.bundles import safe_path  # signing: not in the compile child's imports

    # Roles of their own (absolute: never a folder file's), staged under CACHE_ENTRIES.
    entries = {f"/{CACHE_ENTRIES}/{name}": path for name, path in (cache_entries or {}).items()}
    names = {relative: f"pipeline/{relative}" for relative in files}
    names |= {role: role.lstrip("/") for role in entries}
    with _child_in_box(
        {**files, **entries},
        out_dir,
        f"{bundle_key}.pipeline",
        compile_identity(compile_user, compile_launcher),
        {
            "task": "pipeline",
            "kind": kind,
            "convert_task": convert_task,
            "target": target,
            "options": dict(options),
            "memory_bytes": memory_bytes,
            "cache_entries": CACHE_ENTRIES if entries else None,
        },
        timeout_seconds,
        should_stop,
        names=names,
    ) as run:
        output = _tail(run.log_path)
        if run.timed_out:
            raise _with_output(
                CompileTimeout(
                    f"the {kind} pipeline ran longer than its time limit of "
                    f"{timeout_seconds:.0f} s (FARM_MAX_RUN_SECONDS)"
                ),
                output,
            )
        result = _read_result(run.result_path)
        if result is None:
            raise _with_output(_death(run.returncode, output, memory_bytes, None), output)
        if "error" in result:
            error_class = _CHILD_ERRORS.get(result["error"], errors.CompileError)
            raise _with_output(error_class(result["message"]), output)
        outputs = {}
        for name, relative in result["outputs"].items():
            if not safe_path(name):  # the child's word: a plain relative path only
                raise errors.CompileError(f"the pipeline's child named an output {name!r}")
            dest = out_dir / name
            dest.parent.mkdir(parents=True, exist_ok=True)
            outputs[name] = _take_blob(_in_box(run.box, relative, name), dest)
    return PipelineRun(outputs, dict(result.get("reference") or {}), output)


@dataclass(frozen=True)
class _ChildRun:
    box: Path
    log_path: Path
    result_path: Path
    returncode: int
    timed_out: bool
    in_place: list[Path]
    """The user's files the child read where they are (`compile_in_child`'s `in_place`)."""
    changed_in_place: list[Path]
    """Those whose version changed while the child ran (its work is void)."""
    blob_id: str
    """The name of the blob it wrote in its box: ``<blob_id>.blob``."""
    ahead: bool = False
    """It compiled a request given before its job existed (`request_compile_ahead`)."""
    copied: CopiedBlob | None = None
    """The copy made of its blob as it ended (a request given ahead), for the job to claim."""


def _finished_run(
    box: Path,
    log_path: Path,
    result_path: Path,
    returncode: int,
    timed_out: bool,
    read_in_place: Mapping[str, tuple[Path, FileVersion]],
    blob_id: str,
    ahead: bool = False,
    copied: CopiedBlob | None = None,
) -> _ChildRun:
    """A child's run once it ended: which of the user's files it read where they are, and
    which of those changed meanwhile (checked now, after its end)."""
    changed = [path for path, kept in read_in_place.values() if version_now(path) != kept]
    read = [path for path, _ in read_in_place.values()]
    return _ChildRun(
        box, log_path, result_path, returncode, timed_out, read, changed, blob_id, ahead, copied
    )


@contextlib.contextmanager
def _child_in_box(
    files: Mapping[str, Path],
    out_dir: Path,
    name: str,
    identity: ChildUser | None,
    fields: Mapping[str, object],
    timeout_seconds: float,
    should_stop: Callable[[], bool],
    extra_files: Mapping[str, Path | None] | None = None,
    names: Mapping[str, str] | None = None,
    in_place: Mapping[str, tuple[Path, FileVersion]] | None = None,
) -> Iterator[_ChildRun]:
    """Stage the model's files (and `extra_files`, each passed to the child under its field
    name, None: not given) in a box of the child's own, write its request (`fields` and where
    everything is), run it to its end, and remove the box after the caller took what it
    wanted from it. Request, result and log sit beside `out_dir`, named after `name`.
    `names`: where each role's file goes in the box (a relative path; a model folder's layout);
    default ``model.<role>``. `in_place`: see `compile_in_child`. A child started ahead that
    was given this very request already (`request_compile_ahead`) is only watched to its end;
    one given another is ended, and a child of this request's own runs it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    request = out_dir.parent / f"{name}.request.json"
    result_path = out_dir.parent / f"{name}.result.json"
    log_path = out_dir.parent / f"{name}.log"
    result_path.unlink(missing_ok=True)
    read_in_place = _readable_as_copied(in_place or {}, identity)
    waiting = _take_waiting(fields, identity)
    ahead = waiting.ahead if waiting is not None else None
    if ahead is not None and not _asked_ahead(
        ahead, files, fields, read_in_place, extra_files, names
    ):
        assert waiting is not None
        waiting.discard()  # given another request ahead: a child of the job's own runs this one
        waiting = ahead = None
    box = waiting.box if waiting is not None else _make_box(out_dir, identity)
    try:
        if waiting is not None and ahead is not None:
            request.write_bytes(ahead.payload)  # beside the job's log, as any child's request
            taken, waiting = waiting, None  # `run` ends it, whatever happens
            try:
                returncode, timed_out = taken.run(
                    request, result_path, log_path, timeout_seconds, should_stop
                )
            except BaseException:
                if taken.copied is not None:  # no one will claim it
                    taken.copied.discard()
                raise
            yield _finished_run(
                box, log_path, result_path, returncode, timed_out, read_in_place,
                ahead.blob_id, ahead=True, copied=taken.copied,
            )  # fmt: skip
            return
        staged = {}
        for role, path in files.items():
            dest = _in_box(box, (names or {}).get(role), role)
            if role in read_in_place:
                dest.symlink_to(read_in_place[role][0])
            else:
                _stage(Path(path), dest, identity)
            staged[role] = dest
        extras = {
            field: str(_stage(Path(path), box / f"{field}{Path(path).suffix}", identity))
            if path
            else None
            for field, path in (extra_files or {}).items()
        }
        request.write_bytes(_request_payload({**fields, **extras}, staged, box, identity))
        if waiting is not None:
            taken, waiting = waiting, None  # `run` ends it, whatever happens
            returncode, timed_out = taken.run(
                request, result_path, log_path, timeout_seconds, should_stop
            )
        else:
            returncode, timed_out = _run_child(
                request, result_path, log_path, box, timeout_seconds, should_stop, identity
            )
        yield _finished_run(box, log_path, result_path, returncode, timed_out, read_in_place, name)
    finally:
        if waiting is not None:  # an error before its request: it never had one
            waiting.discard()
        _remove_box(box, identity)


def _request_payload(
    fields: Mapping[str, object],
    staged: Mapping[str, Path],
    box: Path,
    identity: ChildUser | None,
) -> bytes:
    """A child's request: `fields`, and where its files and its box are."""
    return json.dumps(
        {
            **fields,
            "files": {role: str(path) for role, path in staged.items()},
            "out_dir": str(box),
            # The launcher has switched user before the child starts; root switches in the
            # child, after loading OpenVINO.
            "run_as": [identity.uid, identity.gid] if identity and not identity.launcher else None,
            "parent": os.getpid(),
        }
    ).encode()


def _remove_box(box: Path, identity: ChildUser | None) -> None:
    shutil.rmtree(box, ignore_errors=True)
    if box.exists() and identity and identity.launcher:  # folders the child made are its own
        as_compile_user(identity, child_environment(os.environ, Path("/")), "--empty", str(box))
        shutil.rmtree(box, ignore_errors=True)


def _in_box(box: Path, relative: str | None, role: str) -> Path:
    """Where a staged file goes: ``model.<role>``, or `relative` (folders made as needed)."""
    if relative is None:
        return box / f"model.{role}"
    dest = box.joinpath(*relative.split("/"))
    if not dest.resolve().is_relative_to(box.resolve()):
        raise errors.ModelFileError(f"{relative!r}: not a path inside the model's folder")
    dest.parent.mkdir(parents=True, exist_ok=True)
    return dest


def _run_child(
    request: Path,
    result_path: Path,
    log_path: Path,
    box: Path,
    timeout_seconds: float,
    should_stop: Callable[[], bool],
    identity: ChildUser | None = None,
) -> tuple[int, bool]:
    """Start the child in `box` as `identity` (None: this process's user) and watch it until
    it ends; returns (exit code, timed out). Whatever it leaves running in its process group
    is killed before its exit is collected."""
    with (
        open(log_path, "wb") as log,
        open(request, "rb") as request_file,
        open(result_path, "wb") as result_file,
    ):
        env = child_environment(os.environ, box)
        child = _start_child(box, identity, env, request_file, result_file, log)
        return _watch_child(child, identity, env, timeout_seconds, should_stop)


def _start_child(
    box: Path,
    identity: ChildUser | None,
    env: dict[str, str],
    request: IO[bytes],
    result: IO[bytes],
    log: IO[bytes],
    ahead_for: Target | None = None,
) -> subprocess.Popen:
    """Start ``python -m farm.server.jobs.sandbox REQUEST_FD RESULT_FD [TARGET]`` in `box` as
    `identity`, in a process group of its own; given `ahead_for`, it loads OpenVINO for that
    target before it reads its request (`prestart_compile_child`)."""
    fds = (request.fileno(), result.fileno())
    # -P: the box (the working directory) is not put on the child's import path.
    command = [sys.executable, "-P", "-m", "farm.server.jobs.sandbox", *map(str, fds)]
    if ahead_for is not None:
        command.append(ahead_for.name)
    return subprocess.Popen(
        launched(identity, command, env),
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=box,
        env=env,
        pass_fds=fds,
        process_group=0,
        preexec_fn=_die_with_parent,
    )


def _watch_child(
    child: subprocess.Popen,
    identity: ChildUser | None,
    env: Mapping[str, str],
    timeout_seconds: float,
    should_stop: Callable[[], bool],
    reaping: threading.Lock | None = None,
) -> tuple[int, bool]:
    """Wait for `child` to end, killing it past `timeout_seconds` or when `should_stop`;
    returns (exit code, timed out). Whatever it leaves running in its process group is killed
    before its exit is collected (holding `reaping`, which another thread that kills the group
    holds too)."""
    deadline = time.monotonic() + timeout_seconds
    exited = _exit_watch(child.pid)
    try:
        # Woken at the deadline, not up to a poll after it: a child still running at its limit
        # is over it, even one that would have ended within that poll.
        while not _has_exited(
            exited, child.pid, min(POLL_SECONDS, max(0.0, deadline - time.monotonic()))
        ):
            if should_stop():
                raise CompileCancelled("compile cancelled")
            if time.monotonic() >= deadline:
                return -signal.SIGKILL, True
    finally:
        with reaping or contextlib.nullcontext():
            # Not yet collected, the child's pid (its process group's id) is still its own.
            kill_group(child.pid, identity, _has_exited(exited, child.pid, 0), env)
            child.wait()
        os.close(exited)
    return child.returncode, False


# --- a compile child started ahead of its job -------------------------------------------------


class _WaitingChild:
    """A compile child started before its job's request exists (`prestart_compile_child`):
    in a box of its own, it loads OpenVINO and the target's plugin, then waits for its request
    on a pipe. Until `run` copies them beside the job's request, where a child started for the
    job writes them, its result and output go to files without a name."""

    def __init__(self, target: Target, identity: ChildUser | None) -> None:
        self.target, self.identity, self.pid = target, identity, os.getpid()
        self.ahead: _Ahead | None = None
        self._writer: threading.Thread | None = None
        self._taker: threading.Thread | None = None
        self._ending = threading.Event()
        self.copied: CopiedBlob | None = None
        """The copy `on_blob` made of the blob of its request given ahead, if any."""
        self._reaping = threading.Lock()
        """Held to kill the child's group and to collect the child: the group is killed only
        while the child is not collected (its pid, the group's id, then still its own)."""
        # Where `_make_box` puts the box of a job folder in the temporary directory.
        self.box = _make_box(Path(tempfile.gettempdir(), "job"), identity)
        self.env = child_environment(os.environ, self.box)
        self._request: int | None = None
        try:
            # Open as long as the child lives: `run` or `discard` closes them.
            self._result = tempfile.TemporaryFile()  # noqa: SIM115
            self._log = tempfile.TemporaryFile()  # noqa: SIM115
            read_end, self._request = os.pipe()
            with os.fdopen(read_end, "rb") as request:
                self.child = _start_child(
                    self.box, identity, self.env, request, self._result, self._log, target
                )
        except BaseException:
            self._close()
            _remove_box(self.box, identity)
            raise

    def fits(self, fields: Mapping[str, object], identity: ChildUser | None) -> bool:
        """Whether this child can run the request `fields` of a child for `identity`: a
        compile (no other task) for its target, as that user, from this process."""
        return (
            fields.get("task") is None
            and fields.get("target") == self.target.name
            and identity == self.identity
            and os.getpid() == self.pid
            # A child given its request ahead may have ended already, its result kept.
            and not (_exited_now(self.child.pid) and not self._has_result())
        )

    def _has_result(self) -> bool:
        return self.ahead is not None and os.fstat(self._result.fileno()).st_size > 0

    def give_ahead(
        self,
        in_place: Mapping[str, tuple[Path, FileVersion]],
        fields: Mapping[str, object],
        on_blob: Callable[[Path, threading.Event], CopiedBlob | None] | None = None,
    ) -> bool:
        """Give the child a compile request now, before its job exists: `fields`, and the
        user's files `in_place` (by role, with the version each had when it was hashed), read
        where they are. The job's compile takes the child only if it asks for the very same
        (`_asked_ahead`), and checks the files' versions after the child's end, as for
        any compile that read them in place. `on_blob` is called, on a thread of its own, with
        the blob the child wrote once it ended with a result that is not an error, unless it
        was ended first (`discard`). Whether it was given (not where the child may not read
        every file where it is)."""
        readable = _readable_as_copied(in_place, self.identity)
        if self.ahead is not None or self._request is None or set(readable) != set(in_place):
            return False
        staged = {}
        for role, (real, _) in readable.items():
            staged[role] = _in_box(self.box, None, role)
            staged[role].symlink_to(real)
        payload = _request_payload(fields, staged, self.box, self.identity)
        taker = None
        if on_blob is not None:
            watch = _exit_watch(self.child.pid)  # now: nothing collects the child before `run`
            blob = self.box / f"{fields['blob_id']}.blob"
            taker = threading.Thread(
                target=self._take_compiled,
                args=(watch, blob, on_blob),
                name="farm-ahead-blob",
                daemon=True,
            )
        self.ahead = _Ahead(dict(fields), readable, payload)
        self._start_writing(payload)
        if taker is not None:
            try:
                taker.start()
            except BaseException:
                os.close(watch)
                raise
            self._taker = taker
        return True

    def _take_compiled(
        self,
        watch: int,
        blob: Path,
        on_blob: Callable[[Path, threading.Event], CopiedBlob | None],
    ) -> None:
        """Wait for the child's end (`watch`, its pidfd); when it wrote a result that is not
        an error, and no one is ending it, hand its `blob` to `on_blob`, and keep the copy it
        makes for the job (`copied`). Best effort: what `on_blob` does not do, the job does."""
        try:
            select.select([watch], [], [])
        finally:
            os.close(watch)
        if self._ending.is_set():
            return
        try:
            with self._reaping:  # whatever the child left running cannot write the blob on
                if self.child.returncode is None:
                    kill_group(self.child.pid, self.identity, True, self.env)
            written = self._result.fileno()
            result = json.loads(os.pread(written, os.fstat(written).st_size, 0))
            if isinstance(result, dict) and "error" not in result:
                self.copied = on_blob(blob, self._ending)  # ending it stops the copy
        except Exception:
            log.debug("the blob of the compile given ahead was not taken ahead", exc_info=True)

    def _start_writing(self, payload: bytes) -> None:
        """Write `payload` to the child's request pipe on a thread, then close the pipe: a
        request bigger than the pipe holds waits for the child to read it, and a child that
        never does is then ended by the watch (its limits, a cancel)."""
        request_end, self._request = self._request, None  # the writer closes it
        assert request_end is not None, "a waiting child runs one request"
        self._writer = threading.Thread(
            target=_write_request, args=(request_end, payload), name="farm-request"
        )
        self._writer.start()

    def run(
        self,
        request: Path,
        result_path: Path,
        log_path: Path,
        timeout_seconds: float,
        should_stop: Callable[[], bool],
    ) -> tuple[int, bool]:
        """Hand the child its request (the file `request`), unless it was given one ahead,
        and watch it as `_run_child` does; its result and output then at `result_path` and
        `log_path`."""
        try:
            if self.ahead is None:
                try:
                    payload = request.read_bytes()
                except BaseException:
                    self._end()
                    raise
                self._start_writing(payload)
            return _watch_child(
                self.child, self.identity, self.env, timeout_seconds, should_stop, self._reaping
            )
        except BaseException:
            self._ending.set()  # a blob being copied for nothing: stopped
            raise
        finally:
            self._join_threads()  # the child has ended: the write is done or broken
            for unnamed, path in ((self._result, result_path), (self._log, log_path)):
                unnamed.seek(0)
                with open(path, "wb") as named:
                    shutil.copyfileobj(unnamed, named)
            self._close()

    def discard(self) -> None:
        """End the child, which no job took, and remove its box."""
        self._ending.set()
        self._close_request()  # a child not yet killed reads no request, and ends
        self._end()
        self._join_threads()
        if self.copied is not None:
            self.copied.discard()
        self._close()
        _remove_box(self.box, self.identity)

    def _join_threads(self) -> None:
        for thread in (self._writer, self._taker):
            if thread is not None:
                thread.join()
        self._writer = self._taker = None

    def _end(self) -> None:
        """Kill the child's process group and collect the child (once: its pid is then free)."""
        with self._reaping:
            kill_group(self.child.pid, self.identity, _exited_now(self.child.pid), self.env)
            self.child.wait()

    def _close_request(self) -> None:
        if self._request is not None:
            os.close(self._request)
            self._request = None

    def _close(self) -> None:
        self._close_request()
        for unnamed in (getattr(self, "_result", None), getattr(self, "_log", None)):
            if unnamed is not None:
                unnamed.close()


def _write_request(pipe: int, payload: bytes) -> None:
    """Write a waiting child's request and close the pipe (its end of input). A child that
    died says how by its exit, not here."""
    with contextlib.suppress(OSError), os.fdopen(pipe, "wb") as request:
        request.write(payload)


_WAITING: list[_WaitingChild] = []
"""The compile child started ahead of its job, if any (one at most)."""


def prestart_compile_child(
    target: Target, compile_user: str | None = None, compile_launcher: Path | None = None
) -> None:
    """Start a compile child for `target` now, to be taken by this process's next compile for
    that target (`compile_in_child`): its interpreter's start and OpenVINO's import (about
    0.25 s) then happen beside whatever comes before the compile (the embedded `farm submit`:
    the model's hash). It holds what any compile child holds, no more; until its request it
    writes nothing and reads no model, and its memory and file-size limits come with the
    request; `discard_prestarted` ends it if no compile takes it.
    Best effort: a child that cannot start here fails again, with its error, in the job."""
    discard_prestarted()
    with contextlib.suppress(OSError, subprocess.SubprocessError, errors.FarmError):
        _WAITING.append(_WaitingChild(target, compile_identity(compile_user, compile_launcher)))


def discard_prestarted() -> None:
    """End the compile child started ahead (`prestart_compile_child`) that nothing took."""
    while _WAITING:
        _WAITING.pop().discard()


class CopiedBlob(Protocol):
    """What `on_blob` makes of the blob of a compile given its request ahead: a copy of it
    elsewhere (the local store's `CopiedAhead`). The job checks that the blob in the box
    `matches` it, then claims it for the blob it took out of the box; otherwise it is
    discarded."""

    def matches(self, path: Path) -> bool: ...

    def claim(self, path: Path) -> bool: ...

    def discard(self) -> None: ...


AHEAD_BLOB_ID = "ahead"
"""The name of the blob a compile given its request ahead writes in its box."""
AHEAD_NOTE = (
    "farm: compiled by the child started ahead of this job, from the submitted files where "
    "they are (checked unchanged at its end)\n"
)
"""The first line of the log of a job whose compile was given its request ahead."""


@dataclass(frozen=True)
class _Ahead:
    """The request a waiting child was given before its job existed (`give_ahead`)."""

    fields: dict[str, object]
    in_place: dict[str, tuple[Path, FileVersion]]
    """By role: the user's file it reads (its real path), and the version it was hashed at."""
    payload: bytes

    @property
    def blob_id(self) -> str:
        return str(self.fields["blob_id"])


def request_compile_ahead(
    spec: CompileSpec,
    in_place: Mapping[str, tuple[Path, FileVersion]],
    memory_bytes: int | None,
    max_blob_bytes: int | None,
    on_blob: Callable[[Path, threading.Event], CopiedBlob | None] | None = None,
) -> bool:
    """Give the compile child started ahead (`prestart_compile_child`) the request of the job
    this process is about to make: compile `spec` from the user's files `in_place` (by role,
    with the version each had when its hash began), with the job's limits. The embedded `farm
    submit` calls it before it has hashed the model or loaded the database layer, so the
    compile runs beside both. A file changed since, a different request from the job or a
    submit that needs no compile (a hit) voids it: the child is ended, and the job, if any,
    compiles in a child of its own. `on_blob`: see `_WaitingChild.give_ahead`. Whether the
    child was given it."""
    if not _WAITING or _WAITING[0].target != spec.target:
        return False
    fields = _compile_fields(spec, AHEAD_BLOB_ID, memory_bytes, max_blob_bytes)
    try:
        return _WAITING[0].give_ahead(in_place, fields, on_blob)
    except Exception:  # its box half staged, say: the job starts a child of its own
        log.debug("no request given ahead", exc_info=True)
        discard_prestarted()
        return False


def _asked_ahead(
    ahead: _Ahead,
    files: Mapping[str, Path],
    fields: Mapping[str, object],
    read_in_place: Mapping[str, tuple[Path, FileVersion]],
    extra_files: Mapping[str, Path | None] | None,
    names: Mapping[str, str] | None,
) -> bool:
    """Whether the request given `ahead` is the job's own: the same compile with the same
    limits (all but the blob's name in its box), of the same files, every one read where it
    is at the version it had then, and nothing else."""
    ignored = ("blob_id",)
    same_fields = {k: v for k, v in fields.items() if k not in ignored} == {
        k: v for k, v in ahead.fields.items() if k not in ignored
    }
    return (
        same_fields
        and not extra_files
        and not names
        and set(files) == set(read_in_place)
        and dict(read_in_place) == ahead.in_place
    )


def _take_waiting(fields: Mapping[str, object], identity: ChildUser | None) -> _WaitingChild | None:
    """The child started ahead, if it can run `fields` (else it is ended)."""
    if not _WAITING:
        return None
    waiting = _WAITING.pop()
    if waiting.fits(fields, identity):
        return waiting
    waiting.discard()
    return None


def _exit_watch(pid: int) -> int:
    """A descriptor that becomes readable when child `pid` exits, without collecting it."""
    return os.pidfd_open(pid)


def _has_exited(watch: int, pid: int, timeout: float) -> bool:
    """Whether child `pid` has exited, waiting up to `timeout` seconds; never collects it
    (returns as soon as it exits: a plain sleep rounded every compile up to a multiple of
    POLL_SECONDS, half the run time of a small model's job)."""
    select.select([watch], [], [], timeout)
    return _exited_now(pid)


def _exited_now(pid: int) -> bool:
    """Whether child `pid` has exited, never collecting it (its pid stays its own)."""
    try:
        ended = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return True
    return ended is not None


def _death(
    returncode: int, output: str, memory_bytes: int | None, max_blob_bytes: int | None
) -> errors.CompileError:
    """Why a child that left no result ended, as the error its job fails with."""
    if max_blob_bytes and returncode == -signal.SIGXFSZ:
        return errors.BlobTooLarge(blob_limit_message(max_blob_bytes))
    if memory_bytes and any(sign in output for sign in (*_MEMORY_SIGNS, "MemoryError")):
        # Refused before the compile's own error handling (loading OpenVINO's libraries).
        return errors.CompileError(memory_limit_message(memory_bytes))
    how = f"killed by signal {-returncode}" if returncode < 0 else f"exit code {returncode}"
    if memory_bytes and returncode < 0:
        # A refused allocation that OpenVINO did not turn into an exception (an abort in
        # a compiler thread, a NULL it did not check) ends the child like this.
        hint = f" (it may have exceeded its memory limit of {memory_bytes} bytes)"
    elif returncode == -signal.SIGKILL:
        hint = " (out of memory?)"
    else:
        hint = ""
    return errors.CompileError(f"the compiler process died: {how}{hint}")


_CHILD_ERRORS: dict[str, type[errors.FarmError]] = {
    errors.ConversionError.code: errors.ConversionError,
    errors.ConverterUnavailable.code: errors.ConverterUnavailable,
    errors.CompilerUnavailable.code: errors.CompilerUnavailable,
    errors.PipelineError.code: errors.PipelineError,
    errors.ModelError.code: errors.ModelError,
    errors.SandboxUnavailable.code: errors.SandboxUnavailable,
}
"""The child reports an error by its `code`; anything else is a CompileError."""


def memory_limit_message(memory_bytes: int) -> str:
    return (
        f"the compile exceeded its memory limit of {memory_bytes} bytes "
        f"({memory_bytes / 2**30:.2f} GiB): set FARM_COMPILE_MEMORY_BYTES higher, "
        f"or compile on a host with more memory"
    )


def blob_limit_message(max_blob_bytes: int) -> str:
    return (
        f"the compiled blob exceeded its size limit of {max_blob_bytes} bytes "
        f"({max_blob_bytes / 2**20:.0f} MiB: FARM_MAX_BLOB_RATIO times the model's size plus "
        "FARM_BLOB_BYTES_OVER_MODEL, unless FARM_MAX_BLOB_BYTES is set): nothing was stored; "
        "set FARM_MAX_BLOB_BYTES if this model's blob really is that large"
    )


def _with_output(error: errors.FarmError, output: str) -> Exception:
    error.output = output  # type: ignore[attr-defined]
    return error


# --- who compiles, with what ------------------------------------------------------------------


def child_environment(environ: Mapping[str, str], home: Path) -> dict[str, str]:
    """The compile child's environment: the allowlisted variables of `environ` (ENV_NAMES,
    ENV_PREFIXES), with HOME and TMPDIR in the child's own folder `home`. Nothing else passes:
    not the worker's FARM_* settings (database, broker and S3 credentials, the signing key's
    path), not AWS_* credentials, not LD_PRELOAD."""
    kept = {
        name: value
        for name, value in environ.items()
        if name in ENV_NAMES or name.startswith(ENV_PREFIXES)
    }
    # No bytecode written by a user that cannot write the install anyway.
    return {**kept, "HOME": str(home), "TMPDIR": str(home), "PYTHONDONTWRITEBYTECODE": "1"}


BOX_ROOTS = ("/tmp", "/var/tmp")
"""Where the box goes when the compile user cannot reach the temporary directory (TMPDIR may
be a private folder of the worker's); the blob is then copied to `out_dir` after the compile."""


def _make_box(out_dir: Path, identity: ChildUser | None) -> Path:
    """The child's own folder. Beside `out_dir` when the child is the worker's own user. Else
    closed to others, in a folder the compile user can reach, because OpenVINO resolves its
    cache folder's real path: the temporary directory (where the worker compiles, so the blob
    moves to `out_dir` without a copy), else BOX_ROOTS. Owned by the compile user when the
    worker is root; else the worker's, shared with the compile user's group only (the worker
    must take the blob out of it, and may not enter a folder of another user's)."""
    if identity is None:
        return Path(tempfile.mkdtemp(prefix="box-", dir=out_dir.parent))
    uid, gid = identity.uid, identity.gid
    roots = [Path(tempfile.gettempdir()), *map(Path, BOX_ROOTS)]
    root = next((r for r in roots if r.is_dir() and _may(r, uid, gid, os.X_OK, True)), None)
    if root is None:
        raise errors.SandboxUnavailable(
            f"the compile user (uid {uid}) can reach none of {', '.join(map(str, roots))}:"
            " point TMPDIR at a folder every user may traverse, or set FARM_COMPILE_USER"
        )
    box = Path(tempfile.mkdtemp(prefix="farm-compile-", dir=root))
    if identity.launcher is None:
        os.chown(box, uid, gid)
        return box
    try:
        os.chown(box, -1, gid)
    except PermissionError:
        box.rmdir()
        raise errors.SandboxUnavailable(
            f"this worker (uid {os.getuid()}) is not in the compile user's group (gid {gid}), "
            "so it cannot share a folder with its compile child: add it to that group, as "
            "docker/Dockerfile does"
        ) from None
    box.chmod(0o770)
    return box


def _stage(source: Path, dest: Path, identity: ChildUser | None) -> Path:
    """Put a model file in the box: a link when the child may read the file where it is, else
    a read-only copy. A hard link needs neither the folders above the file (a private home, the
    model cache) to be open to the compile user nor room for a copy."""
    if identity is None:
        dest.symlink_to(source.absolute())
        return dest
    real = source.resolve()
    # A file of the child's own it could chmod; one it may write, it could change.
    if _readable_only(real.stat(), identity.uid, identity.gid):
        with contextlib.suppress(OSError):  # another file system: copy
            os.link(real, dest)
            return dest
    shutil.copyfile(real, dest)
    dest.chmod(0o444)
    return dest


def readable_in_place(path: Path, identity: ChildUser | None) -> bool:
    """Whether a compile child of `identity` (None: this process's user) may read `path` where
    it is, instead of a copy: a regular file it may read, on a path that only this process's
    user and root can change. The file and every folder on its real path belong to one of
    them; no other user may write the file, nor a folder unless it is sticky (as /tmp is: its
    other users may move only their own entries). Another user's folder could put another
    file in the model's place for the compile alone, unseen by the version checks; the file's
    owner can still write it, and `compile_in_child` checks its version before and after."""
    owners = {0, os.geteuid()}
    try:
        real = path.resolve(strict=True)
        if _file_system_of(real) not in LOCAL_FILE_SYSTEMS:
            return False
        info = real.stat()
        if not stat.S_ISREG(info.st_mode) or info.st_uid not in owners or info.st_mode & 0o022:
            return False
        if identity is not None and not _readable_only(info, identity.uid, identity.gid):
            return False
        for folder in real.parents:
            above = folder.stat()
            if above.st_uid not in owners:
                return False
            if above.st_mode & 0o022 and not above.st_mode & stat.S_ISVTX:
                return False
            if identity is not None and not _allows(above, identity.uid, identity.gid, os.X_OK):
                return False
    except OSError:
        return False
    return True


LOCAL_FILE_SYSTEMS = frozenset(
    {"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "zfs", "tmpfs", "overlay"}
)
"""Where a file's version (inode, size, mtime, ctime) is the kernel's own, seen at once: not
a network file system, whose attributes a client may cache while the data it reads is new."""


def _file_system_of(path: Path) -> str | None:
    """The type of the file system `path` (a real path) lies on, from /proc/self/mounts."""
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return None
    found, longest = None, -1
    for line in mounts:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ").replace("\\011", "\t")
        if Path(path).is_relative_to(point) and len(point) >= longest:  # the last mount wins
            found, longest = fields[2], len(point)
    return found


def _readable_as_copied(
    in_place: Mapping[str, tuple[Path, FileVersion]], identity: ChildUser | None
) -> dict[str, tuple[Path, FileVersion]]:
    """`in_place` with each path resolved, once, to the real path the child reads, checked and
    versioned again (a link in another user's folder could point elsewhere at each look):
    when the child may read every file where it is and each still has the version it was
    copied at; else nothing (one model's files come from one place)."""
    found = {}
    for role, (path, version) in in_place.items():
        try:
            real = path.resolve(strict=True)
        except OSError:
            return {}
        if version_now(real) != version or not readable_in_place(real, identity):
            return {}
        found[role] = (real, version)
    return found


def _readable_only(info: os.stat_result, uid: int, gid: int) -> bool:
    """Readable by `uid`/`gid`, which neither owns it nor may write it."""
    return (
        info.st_uid != uid
        and _allows(info, uid, gid, os.R_OK)
        and not _allows(info, uid, gid, os.W_OK)
    )


def _may(path: Path, uid: int, gid: int, access: int, every_parent: bool = False) -> bool:
    """Whether `uid`/`gid` (no other groups) may `access` `path` (and pass every folder above)."""
    folders = [path, *path.parents] if every_parent else [path]
    return all(_allows(folder.stat(), uid, gid, access) for folder in folders)


def _allows(info: os.stat_result, uid: int, gid: int, access: int) -> bool:
    shift = 6 if info.st_uid == uid else 3 if info.st_gid == gid else 0
    return bool((info.st_mode >> shift) & access)


def _take_blob(written: Path, dest: Path) -> Path:
    """Move the blob out of the box into `dest`, refusing anything but a regular file of its
    own: the box belongs to the compile user, who could have left a link to a file of the
    worker's there (the signing key), for the worker to upload. Anything else (a directory,
    a FIFO) is refused where it is, and goes with the box."""
    try:
        if not _a_blob_file(os.lstat(written)):
            raise _not_a_blob(written)
        os.replace(written, dest)  # moves the entry itself, a link as a link
    except FileNotFoundError:
        raise errors.CompileError(f"OpenVINO compiled but wrote no blob to {written}") from None
    except OSError as error:
        if error.errno == errno.EXDEV:
            _copy_blob(written, dest)  # another file system than `dest`'s
        elif not _a_blob_file_at(written):  # swapped after the check (a directory)
            raise _not_a_blob(written) from error
        else:
            raise
    if not _a_blob_file(os.lstat(dest)):  # swapped after the check
        if stat.S_ISDIR(os.lstat(dest).st_mode):
            shutil.rmtree(dest, ignore_errors=True)  # its links are removed, never followed
        else:
            dest.unlink()
        raise _not_a_blob(written)
    return dest


def _a_blob_file_at(path: Path) -> bool:
    try:
        return _a_blob_file(os.lstat(path))
    except FileNotFoundError:
        return False


def _copy_blob(written: Path, dest: Path) -> None:
    """Copy a regular file only: not through a link, not from a FIFO that would block."""
    descriptor = os.open(written, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(descriptor, "rb") as source:
        if not _a_blob_file(os.fstat(descriptor)):
            raise _not_a_blob(written)
        with open(dest, "wb") as sink:
            shutil.copyfileobj(source, sink, 1 << 20)


def _a_blob_file(info: os.stat_result) -> bool:
    """A regular file with no other name (none the compile user could still write it through)."""
    return stat.S_ISREG(info.st_mode) and info.st_nlink == 1


def _not_a_blob(written: Path) -> errors.CompileError:
    return errors.CompileError(f"the compile left something other than a blob file at {written}")


def _read_result(path: Path) -> dict | None:
    """The child's result, or None when it ended before writing all of it."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _tail(path: Path) -> str:
    with open(path, "rb") as stream:
        size = stream.seek(0, os.SEEK_END)
        stream.seek(max(0, size - LOG_TAIL_BYTES))
        return stream.read().decode("utf-8", errors="replace")


# --- the child --------------------------------------------------------------------------------


def _limit_resources(memory_bytes: int | None, max_blob_bytes: int | None) -> None:
    """Cap this process's address space and file size, no core dumps (all only ever lowered)."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    for limit, value in (
        (resource.RLIMIT_AS, memory_bytes),
        (resource.RLIMIT_FSIZE, max_blob_bytes),
    ):
        if value:
            _, hard = resource.getrlimit(limit)
            if hard != resource.RLIM_INFINITY:
                value = min(value, hard)
            resource.setrlimit(limit, (value, value))
    # Python ignores SIGXFSZ, so a write past RLIMIT_FSIZE would fail with EFBIG, which
    # OpenVINO drops without a word (a truncated blob); the signal ends the child instead.
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)


_LOADED: list[object] = []
"""OpenVINO objects kept for the child's lifetime: dropping them would unload the plugin and
frontend libraries, which the child, switched to the compile user, may not be able to load
again."""


def _load_openvino(target: Target, roles: set[str]) -> None:
    """Load the target's plugin and the model format's frontend while the child is still the
    worker's user; best effort: what fails here fails again, with its real error, in the
    compile (an allocation the memory limit refuses, a plugin this host lacks)."""
    import openvino as ov

    from farm.toolchain import device_name

    with contextlib.suppress(Exception):
        core = ov.Core()
        _LOADED.append(core)
        core.get_versions(device_name(target))
    with contextlib.suppress(Exception):
        manager = ov.frontend.FrontEndManager()
        _LOADED.append(manager)
        _LOADED.append(manager.load_by_framework("onnx" if "onnx" in roles else "ir"))


def _load_reference_code() -> None:
    """Import what a reference run needs (numpy.random, zipfile, ...) while still the worker's
    user: the compile user may not be able to read the Python installation (under /root)."""
    from farm.core.reference import InputSpec, Reference, seeded_inputs
    from farm.server.jobs import reference  # noqa: F401

    made = seeded_inputs("0" * 64, [InputSpec("x", (1,), "float32"), InputSpec("i", (1,), "int64")])
    Reference.load(io.BytesIO(Reference(made, made).to_bytes()))


def _become(uid: int, gid: int, parent: int) -> None:
    """Switch to the compile user for good (no way back, no setuid gains)."""
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    _die_with(parent)  # a change of user cleared it


def _die_with(parent: int) -> None:
    """End this process (and its process group) when `parent`, the worker, ends. The kernel's
    parent-death signal covers a root worker; a worker of another uid may not signal this
    process, not even by that signal, so a thread also watches for it."""
    _die_with_parent()
    if os.getppid() != parent:  # the worker died before the line above
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1)
        os.killpg(0, signal.SIGKILL)

    # The watcher needs little stack: a default 8 MiB one would count against the child's
    # address-space limit like the compile's own memory.
    previous = threading.stack_size(256 * 1024)
    try:
        threading.Thread(target=watch, name="worker-watch", daemon=True).start()
    finally:
        threading.stack_size(previous)


def _out_of_memory(error: BaseException | None) -> bool:
    """Whether `error`, or what caused it, is an allocation the address-space limit refused."""
    while error is not None:
        if isinstance(error, MemoryError) or any(sign in str(error) for sign in _MEMORY_SIGNS):
            return True
        error = error.__cause__ or error.__context__
    return False


def _child_main(request_fd: str, result_fd: str, ahead_for: str | None = None) -> int:
    # Before any thread starts (a thread inherits both; `_become` sets the flag for its own
    # thread only): no core dump of a crash while loading, no privileges gained through exec.
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    if ahead_for is not None:  # started before its request: load what any compile loads
        _load_ahead(Target.parse(ahead_for))
    with os.fdopen(int(request_fd), "rb") as request_file:
        raw = request_file.read()
    if not raw:  # started ahead, and no job took it
        _exit_now()
    request = json.loads(raw)
    parent = request["parent"]
    if not request.get("run_as"):
        _die_with(parent)
    memory_bytes = request.get("memory_bytes")
    result = os.fdopen(int(result_fd), "w")  # written at the very end
    # Before the model is read, and (unless started ahead) before OpenVINO is imported: the
    # address-space limit counts all the process has mapped, whenever it was mapped.
    _limit_resources(memory_bytes, request.get("max_blob_bytes"))
    if request.get("task") == "stage":
        return _stage_child(request, result, parent)
    if request.get("task") == "pipeline":
        return _pipeline_child(request, result, parent)
    reference = request.get("task") == "reference"
    if not converts(request):
        skip_conversion_api()  # `farm.runtime_import`
    from farm.server.jobs import compiler

    spec = CompileSpec.from_canonical(request["target"], request["spec"])
    files = {role: Path(path) for role, path in request["files"].items()}
    _load_openvino(CPU if reference else spec.target, set(files))
    if reference:
        _load_reference_code()
        if request.get("source_format"):
            from farm.server.stages import source_reference

            source_reference.prepare(
                request["source_format"],
                {r.removeprefix(SOURCE_PREFIX): p for r, p in files.items()},
            )
    try:
        if request.get("run_as"):
            uid, gid = request["run_as"]
            _become(uid, gid, parent)
    except OSError as error:
        code, message = (
            errors.SandboxUnavailable.code,
            f"cannot switch to the compile user: {error}",
        )
        payload: dict = {"error": code, "message": message}
    else:
        if reference:
            payload = _reference(files, spec, request)
        else:
            payload = _compile(
                lambda: compiler.compile_to_file(
                    files, spec, Path(request["out_dir"]), request["blob_id"]
                ),
                memory_bytes,
            )
    result.write(json.dumps(payload))
    result.close()
    _exit_now()


def _load_ahead(target: Target) -> None:
    """What a compile child for `target` loads before it knows its model (as
    `_child_main` loads it for a compile of an IR), for a child started ahead."""
    skip_conversion_api()
    from farm.server.jobs import compiler  # noqa: F401

    # Nothing that writes: the box belongs to the compile user, and this is still root.
    _load_openvino(target, {"xml", "bin"})


def converts(request: Mapping[str, Any]) -> bool:
    """Whether a child of `request` may convert a model (`ov.convert_model`): a stage, a
    pipeline's export, the reference of a source from its framework; not a compile, nor the
    reference of the model as it is."""
    task = request.get("task")
    return task in ("stage", "pipeline") or bool(
        task == "reference" and request.get("source_format")
    )


def _exit_now() -> NoReturn:
    """End the child as soon as its result is written: the blob (or reference) is a closed
    file, and the interpreter's teardown (unloading OpenVINO's plugins, joining its thread
    pools, freeing the compiled model) took 0.3-0.7 s of every compile measured (8 MB
    model, bench/README.md submit_overhead) for nothing the parent reads."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _stage_child(request: dict, result: io.TextIOWrapper, parent: int) -> NoReturn:
    """The stage op: load the kind's code as the worker's user, switch user, run it."""
    from farm.server.stages import child

    runner = child.load(request["kind"], request)  # before the switch of user
    payload: dict
    if isinstance(runner, dict):  # the kind's frameworks are missing here
        _stage_exit(result, runner)
    after, from_memory = None, True
    if request.get("compile"):  # convert and compile in this one child (docs §15)
        spec = CompileSpec.from_canonical(request["compile"]["target"], request["compile"]["spec"])
        _load_openvino(spec.target, {"xml"})  # the plugin, before the switch of user
        after = _compile_after_stage(spec, request)
        # A weightless blob leaves weights out by their offsets in the IR's files: only a
        # compile of the files read back makes one (one from memory holds every weight).
        from_memory = not spec.weightless
    try:
        if request.get("run_as"):
            uid, gid = request["run_as"]
            _become(uid, gid, parent)
    except OSError as error:
        payload = {
            "error": errors.SandboxUnavailable.code,
            "message": f"cannot switch to the compile user: {error}",
        }
    else:
        payload = child.run(
            runner, request, request.get("memory_bytes"), after, after_in_memory=from_memory
        )
    _stage_exit(result, payload)


def _compile_after_stage(spec: CompileSpec, request: dict):
    """What the stage's child does once its stage has its output: compile it for `spec` as the
    compile op does (`compiler.compile_to_file`), from a clone of the model in memory while
    `child.run` saves the IR (that model, written losslessly: no FP16 compression), or, for a
    kind that wrote its IR itself, read back from those files, hashing them meanwhile for the
    store; ``{"compiled": ...}``, with ``"output_sha256"`` in the second case."""

    def after(outcome, stage_request, compiling: threading.Event | None) -> dict:
        from farm.core.hashing import sha256_file
        from farm.server.jobs import compiler

        paths = {role: stage_request.out_dir / Path(rel).name for role, rel in STAGE_OUTPUT.items()}
        box = Path(request["out_dir"])
        blob_id = request["compile"]["blob_id"]
        if outcome.model is not None:
            compiled = _compile(
                lambda: compiler.compile_to_file(
                    paths,
                    spec,
                    box,
                    blob_id,
                    model=outcome.model.clone(),  # the compile may reshape it; the save reads it
                    compiling=compiling,
                ),
                request.get("memory_bytes"),
            )
            compiled.setdefault("blob_id", blob_id)
            return {"compiled": compiled}
        digests: dict[str, str] = {}
        hashing = threading.Thread(
            target=lambda: digests.update({r: sha256_file(p) for r, p in paths.items()}),
            name="hash-ir",
        )
        hashing.start()
        compiled = _compile(
            lambda: compiler.compile_to_file(paths, spec, box, blob_id),
            request.get("memory_bytes"),
        )
        compiled.setdefault("blob_id", blob_id)
        hashing.join()
        return {"compiled": compiled, "output_sha256": digests}

    return after


def _stage_exit(result: io.TextIOWrapper, payload: dict) -> NoReturn:
    """Write the stage's result and end the child at once. Its output files are written and
    closed; an ordinary interpreter exit would only tear down what the frameworks built
    (measured: 3 to 4 s after converting a 512 MB torch.export program, freeing torch's
    tensors and modules one by one), time the job waits for and nobody uses."""
    result.write(json.dumps(payload))
    result.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


PIPELINE_EXPORTER = "farm.server.bundles.export"
"""The module that exports a Hugging Face folder into a pipeline folder (optimum-intel)."""


def _pipeline_child(request: dict, result: io.TextIOWrapper, parent: int) -> int:
    """The pipeline op: load GenAI as the worker's user, switch user, compile (§17)."""
    from farm.server.bundles import compile as bundle_compile

    bundle_compile.preload()  # before the switch of user
    try:
        # A Hugging Face folder (no custom code: refused at submit) is exported before the
        # switch: transformers imports dozens of modules lazily from the worker's Python, which
        # the compile user may not read. The time and memory limits already hold. Loaded by
        # name: the frameworks stay in this child (the import contracts, §13).
        exported = None
        if request.get("convert_task"):
            exporter = importlib.import_module(PIPELINE_EXPORTER)
            exporter.preload()
            exported = exporter.export_in_child(request)
    except errors.FarmError as error:
        result.write(json.dumps({"error": error.code, "message": str(error)}))
        result.close()
        return 0
    if exported is not None and request.get("run_as"):
        uid, gid = request["run_as"]
        for path in [exported, *exported.rglob("*")]:
            os.chown(path, uid, gid)
    try:
        if request.get("run_as"):
            uid, gid = request["run_as"]
            _become(uid, gid, parent)
    except OSError as error:
        payload: dict = {
            "error": errors.SandboxUnavailable.code,
            "message": f"cannot switch to the compile user: {error}",
        }
    else:
        payload = bundle_compile.child_main(request)
    memory_bytes = request.get("memory_bytes")
    said = str(payload.get("message", ""))
    if (
        memory_bytes
        and payload.get("error") != errors.SandboxUnavailable.code
        and any(sign in said for sign in _MEMORY_SIGNS)
    ):  # what failed is kept: the signs are a guess (a noexec mount fails to map segments too)
        payload = {
            "error": "out_of_memory",
            "message": f"{memory_limit_message(memory_bytes)} (OpenVINO: {said})",
        }
    result.write(json.dumps(payload))
    result.close()
    return 0


def _compile(compile_call: Callable, memory_bytes: int | None) -> dict:
    try:
        compiled = compile_call()
        payload = asdict(compiled)
        payload["blob_path"] = str(compiled.blob_path)
    except (errors.CompileError, errors.CompilerUnavailable, MemoryError) as error:
        code = getattr(error, "code", "out_of_memory")
        payload = {"error": code, "message": str(error)}
        if memory_bytes and _out_of_memory(error):
            payload = {"error": "out_of_memory", "message": memory_limit_message(memory_bytes)}
        # The message is one line; OpenVINO's full text (which source file refused what)
        # goes to the captured output, and so into the job log.
        print(f"{type(error).__name__}: {error}", file=sys.stderr)
        if error.__cause__ is not None:
            print(f"OpenVINO: {error.__cause__}", file=sys.stderr)
    return payload


def _reference(files, spec: CompileSpec, request: dict) -> dict:
    from farm.server.jobs.reference import ReferenceSkipped, compute_reference

    out = Path(request["out_dir"]) / f"{request['blob_id']}.npz"
    inputs = Path(request["inputs"]) if request.get("inputs") else None
    source_files = {
        role.removeprefix(SOURCE_PREFIX): path
        for role, path in files.items()
        if role.startswith(SOURCE_PREFIX)
    }
    model_files = {r: p for r, p in files.items() if not r.startswith(SOURCE_PREFIX)}
    outputs_from = None
    if request.get("source_format"):
        from farm.server.stages import source_reference

        outputs_from = source_reference.outputs_from(
            request["source_format"], source_files, Path(request["out_dir"]) / "source"
        )
    try:
        compute_reference(model_files, spec, request["blob_id"], out, inputs, outputs_from)
    except ReferenceSkipped as skipped:
        return {"skipped": str(skipped)}
    except (errors.FarmError, MemoryError) as error:
        print(f"{type(error).__name__}: {error}", file=sys.stderr)
        return {"skipped": f"no reference outputs: {error or 'out of memory'}"}
    return {"reference": str(out)}


if __name__ == "__main__":
    sys.exit(_child_main(*sys.argv[1:4]))
