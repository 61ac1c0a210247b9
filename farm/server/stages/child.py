"""The sandbox's ``stage`` op, child side: run one stage kind's module and report.

Runs in the sandbox's child process (`sandbox.stage_in_child`) with the compile's limits. The
kind's module is imported (and its frameworks loaded) before the child switches to the compile
user, then it runs with no network: the Hugging Face and PyTorch hub variables are set offline.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from collections.abc import Callable
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
    after: Callable[[StageOutcome, StageRequest], dict] | None = None,
) -> dict:
    """Run the stage; the payload the parent reads (an error code and message, or versions
    and metrics). The message names the file and the converter's reason; the traceback goes
    to the log. `after`: what the child does next with a stage that succeeded (the sandbox's
    compile, docs §15), its fields added to the payload; its time is not the stage's."""
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
    except errors.FarmError as error:
        print(f"{type(error).__name__}: {error}", file=sys.stderr)
        return {"error": error.code, "message": str(error)}
    except MemoryError:
        from farm.server.jobs.sandbox import memory_limit_message

        message = memory_limit_message(memory_bytes) if memory_bytes else "out of memory"
        return {"error": errors.ConversionError.code, "message": message}
    outcome.metrics.setdefault("seconds", round(time.perf_counter() - started, 3))
    outcome.metrics.setdefault("peak_rss_bytes", peak_rss_bytes())
    payload = {"tool_versions": outcome.tool_versions, "metrics": outcome.metrics}
    return payload if after is None else {**payload, **after(outcome, request)}
