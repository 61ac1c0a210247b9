"""On-device verification: does this blob compute its reference numbers here, and how fast?

`farm verify` pulls the blob (verified as for any import) and its reference outputs (their
signature binds them to the blob), imports the blob, runs the reference inputs, compares every
output (`farm.core.reference.compare`), times a warm-up and N runs, and reports it all to the
farm with the device's full name and driver. A failed verification quarantines the blob on the
farm: the first device that catches a bad blob stops it spreading. A verification is recorded as
such, not as a pull: pulls count what apps use (`farm gc` reads them). docs/architecture.md §14.

A blob's reference outputs follow the blob (its job succeeds when the blob is stored): while
they are `pending` a verification waits for them (`wait_for_reference`, up to `wait_seconds`),
then, still pending, it has not judged the blob (`ReferencePending`, exit 4): never a failure,
never reported, never a quarantine. A blob whose reference was skipped has none: a refusal.

Edge-safe: OpenVINO and numpy only, through the agent's `BlobSource`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import openvino as ov

from farm.core import hashing
from farm.core.errors import (
    BlobNotAvailable,
    FarmError,
    Incompatible,
    IntegrityMismatch,
    ReferencePending,
)
from farm.core.reference import (
    Reference,
    Tolerance,
    compare,
    default_tolerance,
    output_label,
    percentile,
    summary,
)
from farm.core.rss import peak_rss_bytes, reset_peak_rss
from farm.core.spec import Target
from farm.edge.agent import EdgeAgent, verify_weights
from farm.toolchain import last_line, property_or_none

log = logging.getLogger(__name__)

DEFAULT_RUNS = 10
WARMUP_RUNS = 1
REFERENCE_WAIT_SECONDS = 120.0
"""How long a verification waits for reference outputs still being computed (`--wait`)."""
REFERENCE_POLL_SECONDS = (0.25, 5.0)
"""Resolve again after the first figure, doubling up to the second, while they are pending."""
PENDING = "pending"


@dataclass
class Verification:
    """What one verification found; `report()` is what the farm records."""

    cache_key: str
    blob_sha256: str
    agent_id: str
    device: str
    device_name: str
    openvino_version: str
    driver_version: str | None
    tolerance: Tolerance
    passed: bool = False
    figures: dict[str, Any] = field(default_factory=dict)
    latencies_ms: list[float] = field(default_factory=list)
    import_seconds: float | None = None
    peak_rss_bytes: int | None = None
    error: str | None = None
    """Why the verification could not judge the blob (one line); None when it could."""
    error_detail: str | None = None
    """OpenVINO's own text of that error (logged, and in `farm verify --json`)."""
    farm_answer: dict[str, Any] | None = None
    """The farm's answer to the report: `{"id", "passed", "quarantined"}`."""

    @property
    def outcome(self) -> str:
        """ "passed", "failed" (outputs outside tolerance: counts against the blob) or "error"
        (the verification could not judge it: never counts against it)."""
        if self.error is not None:
            return "error"
        return "passed" if self.passed else "failed"

    def report(self) -> dict[str, Any]:
        finite = _finite_or_none
        latencies = self.latencies_ms
        return {
            "blob_sha256": self.blob_sha256,
            "agent_id": self.agent_id,
            "device_name": self.device_name,
            "openvino_version": self.openvino_version,
            "driver_version": self.driver_version,
            "passed": self.passed and self.error is None,
            "max_abs_error": finite(self.figures.get("max_abs_error")),
            "mean_abs_error": finite(self.figures.get("mean_abs_error")),
            "min_cosine": finite(self.figures.get("min_cosine")),
            "tolerance": {
                "atol": self.tolerance.atol,
                "rtol": self.tolerance.rtol,
                "min_cosine": self.tolerance.min_cosine,
            },
            "outputs": [
                {
                    key: finite(value) if isinstance(value, float) else value
                    for key, value in o.items()
                }
                for o in self.figures.get("outputs", [])
            ],
            "runs": len(latencies),
            "latency_p50_ms": percentile(latencies, 0.5) if latencies else None,
            "latency_p90_ms": percentile(latencies, 0.9) if latencies else None,
            "latency_min_ms": min(latencies) if latencies else None,
            "import_seconds": self.import_seconds,
            "peak_rss_bytes": self.peak_rss_bytes,
            "error": self.error,
        }


def verify_blob(
    agent: EdgeAgent,
    cache_key: str,
    device: str | None = None,
    *,
    runs: int = DEFAULT_RUNS,
    overrides: Mapping[str, float | None] | None = None,
    weights: Path | None = None,
    report: bool = True,
    record: dict[str, Any] | None = None,
    wait_seconds: float = REFERENCE_WAIT_SECONDS,
) -> Verification:
    """Verify the blob of `cache_key` on `device` (default: its target's) and report it (unless
    `report` is False). `overrides`: atol, rtol or min_cosine instead of the defaults.

    Three outcomes. *passed*: every output within tolerance. *failed*: an output outside it,
    the only finding that counts against the blob (the farm quarantines it). *error*: the
    verification could not judge the blob (OpenVINO would not import it here, for want of
    memory or a device library; the reference inputs do not fit its inputs; the run failed);
    reported with its cause, never counted against the blob. Refusals that come before any
    run raise and report nothing: the record's (signature, digest, status, quarantine), no
    reference outputs, no such device on this machine, a device of another class than the
    blob's target, a weightless blob without its model's own `.bin`. `record`: the farm's
    record of the blob, when the caller resolved it already. Reference outputs still pending
    are waited for up to `wait_seconds`, then `ReferencePending` (nothing reported)."""
    record = wait_for_reference(agent, cache_key, record, wait_seconds)
    fetched = agent.fetch(cache_key, blob=record)
    blob = fetched.blob
    target = Target.parse(blob["target"])
    device = device or target.device
    _check_device(device, target)
    if blob.get("weightless"):
        if weights is None:
            raise IntegrityMismatch(
                f"blob {cache_key} is weightless: give the model's own .bin (--weights)"
            )
        verify_weights(blob, weights)
    reference = _reference(agent, record)
    result = Verification(
        cache_key=cache_key,
        blob_sha256=blob["sha256"],
        agent_id=agent.agent_id,
        device=device,
        device_name=_device_property(device, "FULL_DEVICE_NAME") or device,
        openvino_version=ov.get_version(),
        driver_version=_device_property(device, "NPU_DRIVER_VERSION") if "NPU" in device else None,
        tolerance=_tolerance(target, None, overrides),
    )
    reset_peak_rss()
    try:
        imported = _import(agent, cache_key, device, weights, record)
        result.import_seconds = imported.import_seconds
        result.tolerance = _tolerance(target, run_precision(imported.compiled), overrides)
        outputs, result.latencies_ms = _run(
            imported.compiled, reference.inputs, list(reference.outputs), runs
        )
    except HarnessError as error:
        result.error, result.error_detail = str(error), error.detail
        log.warning("verification of blob %s could not run: %s", cache_key, error.detail)
    else:
        result.figures = summary(compare(reference.outputs, outputs, result.tolerance))
        result.passed = bool(result.figures["passed"])
    result.peak_rss_bytes = peak_rss_bytes()
    if report:
        result.farm_answer = agent.source.report_verification(cache_key, result.report())
    return result


class HarnessError(Exception):
    """The verification could not judge the blob: an error of the verification, never a
    failure of the blob. `str()` is one readable line; `detail` is OpenVINO's own text."""

    def __init__(self, summary: str, detail: str | None = None) -> None:
        super().__init__(summary)
        self.detail = (detail or summary)[:4000]


_OUT_OF_MEMORY = ("bad_alloc", "out of memory", "cannot allocate memory", "failed to allocate")
_MISSING_LIBRARY = ("cannot load library", "no such file", "failed to create plugin", ".so")


def _import(agent: EdgeAgent, cache_key: str, device: str, weights, record):
    """`agent.load`, whose failures to import a blob whose bytes are the signed ones are the
    machine's, named (HarnessError): out of memory, a missing device library, or OpenVINO's
    last line."""
    raw: BaseException
    try:
        return agent.load(cache_key, device, weights, blob=record, report=False)
    except FarmError as error:
        # What OpenVINO raised is its cause (`importer.import_failure`); any other farm error
        # (a refusal of the record, the network, the disk) is not the import's.
        if not isinstance(error.__cause__, (RuntimeError, MemoryError)):
            raise
        raw = error.__cause__
    except (RuntimeError, MemoryError) as error:
        raw = error
    text = f"{type(raw).__name__}: {raw}"
    lowered = text.lower()
    if isinstance(raw, MemoryError) or any(sign in lowered for sign in _OUT_OF_MEMORY):
        cause = "out of memory"
    elif any(sign in lowered for sign in _MISSING_LIBRARY):
        cause = f"a library of the {device} plugin is missing or cannot be loaded"
    else:
        cause = "OpenVINO refused it"
    said = last_line(raw) if isinstance(raw, Exception) else text
    raise HarnessError(f"could not import the blob on {device}: {cause} ({said})", text)


def wait_for_reference(
    agent: EdgeAgent,
    cache_key: str,
    record: dict[str, Any] | None = None,
    wait_seconds: float = REFERENCE_WAIT_SECONDS,
) -> dict[str, Any]:
    """The blob's record once its reference outputs are no longer pending (ready, or none
    will come), resolving again while they are, up to `wait_seconds`; `ReferencePending`
    past that: the verification has not judged the blob yet."""
    record = record or agent.resolve(cache_key)
    deadline = time.monotonic() + wait_seconds
    pause = REFERENCE_POLL_SECONDS[0]
    while record.get("reference_state") == PENDING:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ReferencePending(
                f"blob {cache_key}'s reference outputs are still being computed (they follow "
                f"the blob; waited {wait_seconds:g} s): not judged yet, nothing reported; run "
                "farm verify again later, or wait longer with --wait SECONDS"
            )
        time.sleep(min(pause, left))
        pause = min(2 * pause, REFERENCE_POLL_SECONDS[1])
        record = agent.resolve(cache_key)
    return record


def verify_once(
    agent: EdgeAgent,
    cache_key: str,
    device: str | None = None,
    weights: Path | None = None,
    wait_seconds: float = REFERENCE_WAIT_SECONDS,
) -> dict[str, Any] | None:
    """Verify the blob unless this device already did; the report (this run's, or the one
    kept), or None when the blob has no reference outputs to verify against (nothing to do).
    Reference outputs still pending after `wait_seconds`: a report whose `error` says the
    blob was not judged yet (`reference_pending`), neither kept nor sent: the next pass tries
    again.

    The report is kept in the cache, keyed by the blob's bytes, the device's full name, its
    driver and this machine's OpenVINO: a driver or OpenVINO update verifies again. A failure
    is kept too: an admin who releases a blob this device failed is not overruled on the next
    pass (the farm has the failed report). An error (the verification could not judge the blob:
    out of memory...) is not kept: the next pass tries again."""
    try:
        record = wait_for_reference(agent, cache_key, None, wait_seconds)
    except ReferencePending as pending:
        return {"passed": False, "error": str(pending), "reference_pending": True}
    if not record.get("reference_sha256"):
        return None
    target_device = device or Target.parse(record["target"]).device
    stamp = _stamp(agent, record, target_device)
    if stamp.exists():
        with contextlib.suppress(OSError, ValueError):
            kept = json.loads(stamp.read_text())
            if isinstance(kept, dict) and "passed" in kept:
                return kept
    result = verify_blob(agent, cache_key, target_device, weights=weights, record=record)
    outcome = result.report()
    if result.error is None:  # an error (out of memory...) is tried again on the next pass
        stamp.parent.mkdir(parents=True, exist_ok=True)
        stamp.write_text(json.dumps(outcome))
    return outcome


def _stamp(agent: EdgeAgent, record: dict[str, Any], device: str) -> Path:
    driver = _device_property(device, "NPU_DRIVER_VERSION") if "NPU" in device else None
    identity = "\n".join(
        [
            record["sha256"],
            _device_property(device, "FULL_DEVICE_NAME") or device,
            driver or "",
            ov.get_version(),
        ]
    )
    mark = hashlib.sha256(identity.encode()).hexdigest()[:32]
    return agent.cache.root / "verified" / f"{record['cache_key']}.{mark}.json"


def _check_device(device: str, target: Target) -> None:
    """The device exists here and is of the blob's class (a CPU cannot run an NPU blob: that
    is no failure of the blob)."""
    wanted = target.device
    if device.split(".")[0].upper() != wanted:
        raise Incompatible(f"the blob is for {target.name}; it cannot run on {device}")
    available = ov.Core().available_devices
    if not any(name.split(".")[0] == wanted for name in available):
        raise Incompatible(
            f"this machine has no {wanted} device (OpenVINO sees {', '.join(available) or 'none'})"
        )


def _tolerance(
    target: Target, precision: str | None, overrides: Mapping[str, float | None] | None
) -> Tolerance:
    """The row of the tolerance table for the target's device computing in `precision` (a CPU
    in bf16 on AMX Xeons, in f16 when told so; farm/core/tolerance.py), then `overrides`."""
    base = default_tolerance(target.device, precision)
    values = {"atol": base.atol, "rtol": base.rtol, "min_cosine": base.min_cosine}
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    return Tolerance(**values)


def run_precision(compiled: ov.CompiledModel) -> str | None:
    """The tolerance table's name of what `compiled` computes in. With
    ``EXECUTION_MODE_HINT=ACCURACY`` and no precision hint the CPU plugin runs f32 and reports
    the precision as ``dynamic``."""
    precision = precision_name(property_or_none(compiled, "INFERENCE_PRECISION_HINT"))
    mode = str(property_or_none(compiled, "EXECUTION_MODE_HINT") or "")
    if precision == "dynamic" and mode.upper().endswith("ACCURACY"):
        return "f32"
    return precision


def precision_name(precision: object) -> str | None:
    """A compiled model's INFERENCE_PRECISION_HINT as a name of the tolerance table: OpenVINO
    answers an `ov.Type` (whose `str()` is "<Type: 'float32'>", never "f32"); None when the
    plugin reports none."""
    if precision is None:
        return None
    if isinstance(precision, ov.Type):
        return precision.get_type_name()  # "f32", "f16", "bf16"
    text = str(precision).strip().lower()
    return {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}.get(text, text) or None


def _reference(agent: EdgeAgent, record: dict[str, Any]) -> Reference:
    """The blob's reference outputs: their signature checked (when this edge checks signatures)
    before a byte is fetched, then their size and digest."""
    key = record["cache_key"]
    digest, size = record.get("reference_sha256"), record.get("reference_size_bytes")
    if not digest or not isinstance(size, int):
        note = record.get("reference_note") or "its worker recorded none"
        raise BlobNotAvailable(f"blob {key} has no reference outputs to verify against: {note}")
    if agent.trust is not None:
        agent.trust.verify_reference(record)
    with tempfile.TemporaryDirectory(prefix="farm-verify-", dir=agent.cache.root) as folder:
        path = Path(folder) / "reference.npz"
        agent.source.download_reference(key, path, max_bytes=size)
        actual = hashing.sha256_file(path)
        if actual != digest or path.stat().st_size != size:
            raise IntegrityMismatch(
                f"the reference outputs of blob {key} have sha256 {actual}, signed {digest}; "
                "refusing them"
            )
        return Reference.load(path)


def _run(
    compiled: ov.CompiledModel, inputs: dict[str, np.ndarray], expected: list[str], runs: int
) -> tuple[dict[str, np.ndarray], list[float]]:
    """Warm up, then `runs` timed inferences; the outputs of the last, each labelled with the
    reference's name for it when the blob's output carries that name (`expected`), else with
    the model's own name for it (`output_label`)."""
    request = compiled.create_infer_request()
    ordered = _by_port(compiled, inputs)
    try:
        for _ in range(WARMUP_RUNS):
            request.infer(ordered)
        latencies = []
        for _ in range(max(1, runs)):
            started = time.perf_counter()
            request.infer(ordered)
            latencies.append((time.perf_counter() - started) * 1000)
    except Exception as error:  # OpenVINO raises RuntimeError for any refusal
        raise HarnessError(
            f"OpenVINO could not run the reference inputs: {last_line(error)}",
            f"{type(error).__name__}: {error}",
        ) from None
    outputs = {}
    for index, port in enumerate(compiled.outputs):
        names = port.get_names()
        label = next((name for name in expected if name in names), None)
        outputs[label or output_label(names, index)] = np.array(
            request.get_output_tensor(index).data, copy=True
        )
    return outputs, latencies


def _by_port(compiled: ov.CompiledModel, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
    """The reference inputs in the compiled model's input order, by name, else by position (a
    blob may name its inputs differently from the source model), each of a shape the input
    takes (a scalar stays 0-d). An input the reference cannot give, or one of another shape,
    is a HarnessError: the reference and the blob disagree, which says nothing of its numbers."""
    values = list(inputs.values())
    if len(values) != len(compiled.inputs):
        raise HarnessError(
            f"the reference has {len(values)} inputs ({', '.join(inputs) or 'none'}); the blob "
            f"takes {len(compiled.inputs)} ({', '.join(_name(p) for p in compiled.inputs)})"
        )
    ordered = []
    for index, port in enumerate(compiled.inputs):
        names = port.get_names()
        match = next((inputs[name] for name in names if name in inputs), None)
        if match is None:
            match = values[index]
        shape = port.get_partial_shape()
        if not shape.compatible(ov.PartialShape(list(np.shape(match)))):
            raise HarnessError(
                f"the reference input for {_name(port)!r} has shape {list(np.shape(match))}; "
                f"the blob's input takes {shape}"
            )
        ordered.append(np.asarray(match))
    return ordered


def _name(port: ov.Output) -> str:
    return port.get_any_name() if port.get_names() else "(unnamed)"


def _device_property(device: str, name: str) -> str | None:
    try:
        return str(ov.Core().get_property(device, name))
    except Exception:  # an older plugin without it, or no such device here
        return None


def _json_ready(output: dict[str, Any]) -> dict[str, Any]:
    """One output's figures with infinities as null (JSON has no infinity)."""
    return {k: _finite_or_none(v) if isinstance(v, float) else v for k, v in output.items()}


def _finite_or_none(value: Any) -> float | None:
    if value is None or not math.isfinite(value):
        return None
    return float(value)
