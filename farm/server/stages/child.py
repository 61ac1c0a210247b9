"""The sandbox's ``stage`` op, child side: run one stage kind's module and report.

Runs in the sandbox's child process (`sandbox.stage_in_child`) with the compile's limits. The
kind's module is imported (and its frameworks loaded) before the child switches to the compile
user, then it runs with no network: the Hugging Face and PyTorch hub variables are set offline.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from farm.core import errors
from farm.core.rss import peak_rss_bytes, reset_peak_rss

MODULES = {
    "convert": "farm.server.stages.convert",
    "compress": "farm.server.stages.compress",
    "quantize": "farm.server.stages.compress",
    "drift": "farm.server.stages.drift",  # a compress or quantize stage's drift, measured after
}
"""Stage kind -> the module that runs it in the child: ``prepare(args)``, ``run(request)``."""
OFFLINE = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "DO_NOT_TRACK": "1",
    "TORCH_HOME": "",  # set to the box below: nothing read from or written to a shared cache
}


@dataclass(frozen=True)
class StageRequest:
    """What a kind's `run` gets: its input files by role (in ``input/`` of its box, laid out
    as the source was), canonical args, options (settings the worker passes) and where to
    write ``model.xml`` / ``model.bin``."""

    kind: str
    files: dict[str, Path]
    input_dir: Path
    args: dict[str, Any]
    options: dict[str, Any]
    out_dir: Path


@dataclass
class StageOutcome:
    tool_versions: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    model: Any = None
    """The output model in memory, for a kind that leaves writing its IR to `run` (convert):
    `run` saves it, beside the `after` step, which may read it (docs §15)."""


OUTPUT_IR = {"xml": "model.xml", "bin": "model.bin"}
"""The output IR's files in the request's ``out_dir``, by role."""
After = Callable[[StageOutcome, StageRequest, "threading.Event | None"], dict]
"""What the child does with a stage that succeeded (`run`'s `after`)."""


def load(kind: str, raw: dict) -> ModuleType | dict:
    """The kind's module, imported with its frameworks (`prepare`) now, as the worker's user
    (the compile user may not be able to read them); or the error payload when it cannot.
    `raw`: the request; a module whose frameworks import lazily runs itself once on a model of
    its own when the child is about to switch user (``run_as``)."""
    for name, value in OFFLINE.items():
        os.environ[name] = value or str(Path.cwd() / ".torch")
    os.environ["HF_HOME"] = str(Path.cwd() / ".hf")
    try:
        module = importlib.import_module(MODULES[kind])
        files = {role: Path(path) for role, path in raw["files"].items()}
        module.prepare(raw["args"], switching_user=bool(raw.get("run_as")), files=files)
    except errors.FarmError as error:
        print(f"{type(error).__name__}: {error}", file=sys.stderr)
        return {"error": error.code, "message": str(error)}
    return module


def run(
    module: ModuleType,
    raw: dict,
    memory_bytes: int | None,
    after: After | None = None,
    *,
    after_in_memory: bool = True,
) -> dict:
    """Run the stage; the payload the parent reads (an error code and message, or versions
    and metrics). The message names the file and the converter's reason; the traceback goes
    to the log. `after`: what the child does next with a stage that succeeded (the sandbox's
    compile, docs §15), its fields added to the payload; its time is not the stage's. For a
    kind that returns its model in memory, `after` runs in a thread while the IR is saved, and
    sets the event it is given when its compile is in OpenVINO; unless `after_in_memory` is
    false (it needs the IR's files: a weightless compile), then the IR is saved first and
    `after` is given no model."""
    box = Path(raw["out_dir"])
    request = StageRequest(
        kind=raw["kind"],
        files={role: Path(path) for role, path in raw["files"].items()},
        input_dir=box / "input",
        args=raw["args"],
        options=raw.get("options") or {},
        out_dir=box / "out",
    )
    request.out_dir.mkdir()
    started = time.perf_counter()
    reset_peak_rss()
    try:
        outcome: StageOutcome = module.run(request)
        converted = time.perf_counter()
        if outcome.model is not None and (after is None or not after_in_memory):
            _save(outcome.model, request.out_dir)
            outcome.model = None
    except errors.FarmError as error:
        print(f"{type(error).__name__}: {error}", file=sys.stderr)
        return {"error": error.code, "message": str(error)}
    except MemoryError:
        return _out_of_memory(memory_bytes)
    outcome.metrics.setdefault("peak_rss_bytes", peak_rss_bytes())
    payload: dict[str, Any] = {"tool_versions": outcome.tool_versions, "metrics": outcome.metrics}
    if outcome.model is None:
        outcome.metrics.setdefault("seconds", round(time.perf_counter() - started, 3))
        return payload if after is None else {**payload, **after(outcome, request, None)}
    # The IR is saved while `after` (the compile) runs from the model in memory: on a 512 MB
    # program, saving took 0.4-1.2 s that the compile used to wait for. Not hashed here: the
    # parent hashes it as it stores it, beside the blob's upload, not beside the compile.
    # The stage's peak RSS is the conversion's (taken above), not the compile's beside it.
    assert after is not None  # else saved above
    beside = _beside(after, outcome, request)
    saving = time.perf_counter()
    try:
        _save(outcome.model, request.out_dir)
    except MemoryError:  # the compile beside it may have taken the memory: once more, alone
        done = beside.result()
        try:
            _save(outcome.model, request.out_dir)
        except MemoryError:
            return _out_of_memory(memory_bytes)
    else:
        done = beside.result()
    saved = time.perf_counter() - saving
    outcome.metrics.setdefault("seconds", round(converted - started + saved, 3))
    return {**payload, **done}


def _out_of_memory(memory_bytes: int | None) -> dict:
    from farm.server.jobs.sandbox import memory_limit_message

    message = memory_limit_message(memory_bytes) if memory_bytes else "out of memory"
    return {"error": errors.ConversionError.code, "message": message}


def _save(model: Any, out_dir: Path) -> None:
    """Save `model` as the stage's output IR in `out_dir` (losslessly: no FP16 compression)."""
    import openvino as ov

    ov.save_model(model, out_dir / OUTPUT_IR["xml"], compress_to_fp16=False)


def _beside(after: After, outcome: StageOutcome, request: StageRequest) -> Future[dict]:
    """`after` run in a thread, returned once it has entered OpenVINO's compile (or ended).
    OpenVINO's `save_model` holds the GIL for all of its work, and `compile_model` lets it go:
    a save started first would hold the compile back until it ended (measured: 1.8 s of a 512
    MB program's), a save started once the compile is in OpenVINO runs beside it."""
    compiling = threading.Event()
    pool = ThreadPoolExecutor(1, thread_name_prefix="after-stage")
    done = pool.submit(after, outcome, request, compiling)
    pool.shutdown(wait=False)  # its one thread ends with `after`
    while not compiling.wait(0.01) and not done.done():
        pass
    return done
