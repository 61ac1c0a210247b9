"""Run one compile in a child process that the caller can watch, stop and time out.

A compile can take hours, use tens of GB, or crash on a hostile model. In a child process it
fails its own job only; the parent stays free to renew the job's lease, notice a cancel, and
kill the compile (an OpenVINO compile cannot be interrupted inside a process). The child's
stderr is the compiler's own output and goes into the job log.

Limits: wall time (the parent kills the child past `timeout_seconds`) and memory (the child's
address space, ``RLIMIT_AS``, so an allocation past the limit fails inside the child instead of
waking the kernel's OOM killer, which may pick the worker). No core dumps: a crashing compile
of a 20 GB model would otherwise write 20 GB to disk.

Note: ``RLIMIT_AS`` counts reserved address space, not only resident memory: thread stacks,
allocator arenas and the memory-mapped ``.bin`` all count. A compile needs about 0.7 GB of it
before touching the model (Python, OpenVINO, its CPU plugin); the default limit is a share of
the host's memory (`Settings.resolved_compile_memory_bytes`), far above that.

Protocol: ``python -m farm.server.jobs.sandbox REQUEST.json RESULT.json``; the result holds
either the `CompileResult` fields or ``{"error": code, "message": ...}`` (the error's
`FarmError.code`).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path

from farm.core import errors
from farm.core.errors import CompileCancelled, CompileTimeout
from farm.core.spec import CompileSpec, Toolchain

POLL_SECONDS = 0.5
LOG_TAIL_BYTES = 64 * 1024
"""How much of the compiler's output is kept for the job log."""
_MEMORY_SIGNS = (
    "std::bad_alloc",  # C++ new
    "Failed to allocate",  # OpenVINO's CPU plugin
    "Cannot allocate memory",  # ENOMEM
    "Resource temporarily unavailable",  # EAGAIN: no room for a new thread's stack
    "failed to map segment",  # the loader, opening a plugin library
)
"""How an allocation refused by ``RLIMIT_AS`` shows in the errors of a compile (measured)."""


def compile_in_child(
    files: Mapping[str, Path],
    spec: CompileSpec,
    out_dir: Path,
    blob_id: str,
    *,
    timeout_seconds: float,
    memory_bytes: int | None = None,
    should_stop: Callable[[], bool] = lambda: False,
):
    """Compile in a child process; returns (`CompileResult`, compiler output).

    `memory_bytes` caps the child's address space (None: no cap); a compile that needs more
    fails with CompileError "... exceeded its memory limit of N bytes".
    `should_stop` is called every POLL_SECONDS; True kills the child (CompileCancelled).
    Raises the child's CompileError / ModelError / CompilerUnavailable as the same classes;
    those and CompileTimeout carry the compiler's output in `.output`, for the job log.
    """
    # OpenVINO stays out of the watching process: only the child loads it and compiles.
    from farm.server.jobs import compiler

    out_dir.mkdir(parents=True, exist_ok=True)
    request = out_dir.parent / f"{blob_id}.request.json"
    result_path = out_dir.parent / f"{blob_id}.result.json"
    log_path = out_dir.parent / f"{blob_id}.log"
    request.write_text(
        json.dumps(
            {
                "files": {role: str(path) for role, path in files.items()},
                "target": spec.target.name,
                "spec": spec.canonical(),
                "out_dir": str(out_dir),
                "blob_id": blob_id,
                "memory_bytes": memory_bytes,
            }
        )
    )
    started = time.monotonic()
    timed_out = False
    with open(log_path, "wb") as log:
        child = subprocess.Popen(
            [sys.executable, "-m", "farm.server.jobs.sandbox", str(request), str(result_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent,
        )
        try:
            while child.poll() is None:
                if should_stop():
                    raise CompileCancelled("compile cancelled")
                if time.monotonic() - started > timeout_seconds:
                    timed_out = True
                    break
                # Returns as soon as the child exits: a plain sleep rounded every compile up to
                # a multiple of POLL_SECONDS (half the run time of a small model's job).
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.wait(POLL_SECONDS)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
    output = _tail(log_path)
    if timed_out:
        raise _with_output(
            CompileTimeout(
                f"compile ran longer than its time limit of {timeout_seconds:.0f} s "
                f"(FARM_MAX_RUN_SECONDS)"
            ),
            output,
        )
    if child.returncode != 0 and not result_path.exists():
        if memory_bytes and any(sign in output for sign in (*_MEMORY_SIGNS, "MemoryError")):
            # Refused before the compile's own error handling (loading OpenVINO's libraries).
            raise _with_output(errors.CompileError(memory_limit_message(memory_bytes)), output)
        how = (
            f"killed by signal {-child.returncode}"
            if child.returncode < 0
            else f"exit code {child.returncode}"
        )
        if memory_bytes and child.returncode < 0:
            # A refused allocation that OpenVINO did not turn into an exception (an abort in
            # a compiler thread, a NULL it did not check) ends the child like this.
            hint = f" (it may have exceeded its memory limit of {memory_bytes} bytes)"
        elif child.returncode == -signal.SIGKILL:
            hint = " (out of memory?)"
        else:
            hint = ""
        raise _with_output(errors.CompileError(f"the compiler process died: {how}{hint}"), output)
    result = json.loads(result_path.read_text())
    if "error" in result:
        error = _CHILD_ERRORS.get(result["error"], errors.CompileError)(result["message"])
        raise _with_output(error, output)
    result["blob_path"] = Path(result["blob_path"])
    result["toolchain"] = Toolchain(**result["toolchain"])
    return compiler.CompileResult(**result), output


_CHILD_ERRORS: dict[str, type[errors.CompileError] | type[errors.CompilerUnavailable]] = {
    errors.CompilerUnavailable.code: errors.CompilerUnavailable,
    errors.ModelError.code: errors.ModelError,
}
"""The child reports an error by its `code`; anything else is a CompileError."""


def memory_limit_message(memory_bytes: int) -> str:
    return (
        f"the compile exceeded its memory limit of {memory_bytes} bytes "
        f"({memory_bytes / 2**30:.2f} GiB): set FARM_COMPILE_MEMORY_BYTES higher, "
        f"or compile on a host with more memory"
    )


def _with_output(
    error: errors.CompileError | errors.CompilerUnavailable | CompileTimeout, output: str
) -> Exception:
    error.output = output
    return error


def _die_with_parent() -> None:
    """Linux: the child gets SIGKILL when the process that started it dies."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _tail(path: Path) -> str:
    with open(path, "rb") as stream:
        size = stream.seek(0, os.SEEK_END)
        stream.seek(max(0, size - LOG_TAIL_BYTES))
        return stream.read().decode("utf-8", errors="replace")


def _limit_memory(memory_bytes: int | None) -> None:
    """Cap this process's address space and turn off core dumps (both only ever lowered)."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if memory_bytes:
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        if hard != resource.RLIM_INFINITY:
            memory_bytes = min(memory_bytes, hard)
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))


def _out_of_memory(error: BaseException | None) -> bool:
    """Whether `error`, or what caused it, is an allocation the address-space limit refused."""
    while error is not None:
        if isinstance(error, MemoryError) or any(sign in str(error) for sign in _MEMORY_SIGNS):
            return True
        error = error.__cause__ or error.__context__
    return False


def _child_main(request_path: str, result_path: str) -> int:
    request = json.loads(Path(request_path).read_text())
    memory_bytes = request.get("memory_bytes")
    # Before OpenVINO is imported: the limit covers everything the compile maps or allocates.
    _limit_memory(memory_bytes)
    from farm.server.jobs import compiler

    spec = CompileSpec.from_canonical(request["target"], request["spec"])
    files = {role: Path(path) for role, path in request["files"].items()}
    try:
        result = compiler.compile_to_file(files, spec, Path(request["out_dir"]), request["blob_id"])
        payload = asdict(result)
        payload["blob_path"] = str(result.blob_path)
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
    partial = Path(result_path + ".partial")
    partial.write_text(json.dumps(payload))
    partial.replace(result_path)
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1], sys.argv[2]))
