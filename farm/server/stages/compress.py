"""The `compress` and `quantize` stages, child side: read an IR, run NNCF, save the IR
(`compress_model`), and measure what it cost: the weights' size before and after, and the drift
of the compressed model's outputs from the uncompressed model's on the same inputs
(`measure_drift`).

The farm runs the two in two sandboxed children, one after the other (docs/architecture.md
§15): this module's `run` compresses, `farm.server.stages.drift` measures. So the compression
child's peak memory is NNCF's own, and the drift's (the FP32 model compiled on CPU, above
NNCF's) is its own child's. NNCF and OpenVINO are imported here, never in farm/core.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from farm.core.compression import (
    CALIBRATION_ROLE,
    COMPRESS,
    QUANTIZE,
    canonical_compress,
    canonical_quantize,
    resolve_group_size,
)
from farm.core.errors import ConversionError, ConverterUnavailable
from farm.core.reference import InputSpec, seeded_inputs
from farm.server.stages.child import StageOutcome, StageRequest

OUTPUT_XML = "model.xml"
"""The stage output's main IR, relative to its folder (its weights: `model.bin`)."""
MAX_DRIFT_SAMPLES = 32
"""Inputs the drift is measured on at most: the reference inputs, then calibration samples."""
_CPU_F32 = {"INFERENCE_PRECISION_HINT": "f32"}
"""Both models run in f32 on CPU, so the drift is the compression's, not bf16's."""


@dataclass
class StageResult:
    """What a compression stage wrote and measured."""

    files: dict[str, Path]
    """The output IR's files by relative path; `OUTPUT_XML` is the main one."""
    metrics: dict[str, Any]
    """`size_before`, `size_after` (bytes of weights), `ratio`, `weights`, the NNCF settings
    actually used (`resolved`), `seconds`; after `measure_drift` (`run_stage`) also `drift`
    (`max_abs_diff`, `mean_abs_diff`, `min_cosine`, `top1_agreement` or None, `samples`) and
    `drift_seconds` (the two CPU runs the drift takes)."""
    tool_versions: dict[str, str] = field(default_factory=dict)


def tool_versions() -> dict[str, str]:
    """The versions this stage's output depends on (recorded, not keyed: §15)."""
    import openvino as ov

    return {"nncf": _nncf().__version__, "openvino": ov.get_version()}


def run_stage(
    kind: str,
    args: Mapping[str, Any],
    xml: Path,
    out_dir: Path,
    *,
    reference_inputs: Sequence[Mapping[str, np.ndarray]] = (),
    calibration: Sequence[Mapping[str, np.ndarray]] = (),
    seed: str = "",
    memory_bytes: int | None = None,
) -> StageResult:
    """Compress (`compress`) or quantize (`quantize`) the IR at `xml` into `out_dir`, then
    measure its drift: `compress_model` and `measure_drift` in one process (the farm runs them
    in two children, §15).

    `reference_inputs` are the inputs the drift is measured on; when none are given, inputs
    seeded from `seed` (the stage key) are made like a blob's reference inputs. `calibration`
    are `quantize`'s samples (farm.core.calibration.load_samples), also used for drift.
    `memory_bytes`: the memory limit; a model too large to run within it on CPU is compressed
    without its drift measured (`drift` None, `drift_note` says why)."""
    result = compress_model(kind, args, xml, out_dir, calibration=calibration)
    measured = measure_drift(
        xml,
        result.files[OUTPUT_XML],
        reference_inputs=reference_inputs,
        calibration=calibration,
        seed=seed,
        memory_bytes=memory_bytes,
    )
    result.metrics.update(measured)
    return result


def compress_model(
    kind: str,
    args: Mapping[str, Any],
    xml: Path,
    out_dir: Path,
    *,
    calibration: Sequence[Mapping[str, np.ndarray]] = (),
) -> StageResult:
    """Compress (`compress`) or quantize (`quantize`, on its `calibration` samples) the IR at
    `xml` into `out_dir`: what the stage's child does, NNCF and nothing else (the drift is
    measured after, `measure_drift`). Metrics: the sizes, `weights`, `resolved`, `seconds`."""
    import openvino as ov

    nncf = _nncf()
    started = time.monotonic()
    model = ov.Core().read_model(xml)
    weights = weight_count(model)
    if kind == COMPRESS:
        canonical = canonical_compress(args)
        settings = _compress_settings(canonical, weights)
        mode = nncf.CompressWeightsMode(settings.pop("mode"))
        compressed = _nncf_call(nncf.compress_weights, model, mode=mode, **settings)
        resolved = {"mode": mode.value, **settings}
    elif kind == QUANTIZE:
        canonical = canonical_quantize(args)
        if not calibration:
            raise ConversionError("quantize: no calibration samples reached the stage")
        device = nncf.TargetDevice[canonical["device"].upper()]
        dataset = nncf.Dataset(list(calibration), _as_model_inputs)
        compressed = _nncf_call(
            nncf.quantize, model, dataset, target_device=device, subset_size=len(calibration)
        )
        resolved = {"precision": canonical["precision"], "device": device.value}
        resolved["calibration_samples"] = len(calibration)
    else:
        raise ConversionError(f"not a compression stage: {kind!r}")

    out_dir.mkdir(parents=True, exist_ok=True)
    out_xml = out_dir / OUTPUT_XML
    # No FP16 compression of what NNCF left in f32 (scales, biases): the drift measured is
    # NNCF's alone, and the compile decides its own precision.
    ov.save_model(compressed, out_xml, compress_to_fp16=False)
    del compressed, model
    size_before = _weights_bytes(xml)
    size_after = _weights_bytes(out_xml)
    metrics: dict[str, Any] = {
        "size_before": size_before,
        "size_after": size_after,
        "ratio": round(size_after / size_before, 6) if size_before else None,
        "weights": weights,
        "resolved": resolved,
        "seconds": round(time.monotonic() - started, 3),
    }
    files = {OUTPUT_XML: out_xml, out_xml.with_suffix(".bin").name: out_xml.with_suffix(".bin")}
    return StageResult(files, metrics, tool_versions())


def measure_drift(
    xml: Path,
    compressed_xml: Path,
    *,
    reference_inputs: Sequence[Mapping[str, np.ndarray]] = (),
    calibration: Sequence[Mapping[str, np.ndarray]] = (),
    seed: str = "",
    memory_bytes: int | None = None,
) -> dict[str, Any]:
    """The drift of the compressed IR's outputs from the uncompressed IR's (issue 27 item 4):
    both compiled and run on CPU in f32 on the same inputs, one at a time (each compiled form
    released before the next is made). `drift` (see `drift`), `drift_seconds`, and when the
    model is too large to run within `memory_bytes` on CPU `drift` None and `drift_note`."""
    import openvino as ov

    from farm.server.jobs.reference import skip_reason

    started = time.monotonic()
    too_large = skip_reason(_weights_bytes(xml), memory_bytes)
    if too_large:
        note = too_large.replace("no reference outputs", "drift not measured")
        return {"drift": None, "drift_note": note, "drift_seconds": 0.0}
    core = ov.Core()
    model = core.read_model(xml)
    inputs = list(reference_inputs) or [seeded_inputs(seed, _input_specs(model))]
    inputs = (inputs + list(calibration))[:MAX_DRIFT_SAMPLES]
    expected = _outputs(core, model, inputs)
    del model
    actual = _outputs(core, core.read_model(compressed_xml), inputs)
    return {
        "drift": drift(expected, actual),
        "drift_seconds": round(time.monotonic() - started, 3),
    }


def weight_count(model: Any) -> int:
    """The model's parameters: elements of its floating-point constants of rank 2 or more
    (matrices and kernels; scalars and shape constants are not weights)."""
    total = 0
    for op in model.get_ops():
        if op.get_type_name() != "Constant":
            continue
        output = op.get_output_element_type(0)
        shape = op.get_output_shape(0)
        if output.is_real() and len(shape) >= 2:
            total += int(np.prod([int(d) for d in shape]))
    return total


def drift(
    expected: Sequence[Mapping[str, np.ndarray]], actual: Sequence[Mapping[str, np.ndarray]]
) -> dict[str, Any]:
    """How far `actual` outputs are from `expected` ones, over all samples and outputs:
    the largest and mean absolute difference, the smallest cosine similarity of an output
    (its samples concatenated), and where an output is class scores (rank 2, more than one
    class) the share of rows whose arg-max agrees (None when no output is)."""
    max_abs, abs_sum, count = 0.0, 0.0, 0
    cosines: list[float] = []
    agreements: list[float] = []
    for name in expected[0] if expected else ():
        want = np.concatenate([sample[name].astype(np.float64).ravel() for sample in expected])
        got = np.concatenate([sample[name].astype(np.float64).ravel() for sample in actual])
        difference = np.abs(got - want)
        if difference.size:
            max_abs = max(max_abs, float(difference.max()))
            abs_sum, count = abs_sum + float(difference.sum()), count + difference.size
        cosines.append(_cosine(want, got))
        shape = expected[0][name].shape
        if len(shape) == 2 and shape[1] > 1:
            rows_want = np.concatenate([s[name] for s in expected]).argmax(axis=1)
            rows_got = np.concatenate([s[name] for s in actual]).argmax(axis=1)
            agreements.append(float((rows_want == rows_got).mean()))
    return {
        "max_abs_diff": max_abs,
        "mean_abs_diff": abs_sum / count if count else 0.0,
        "min_cosine": min(cosines, default=1.0),
        "top1_agreement": min(agreements) if agreements else None,
        "samples": len(expected),
    }


def _cosine(want: np.ndarray, got: np.ndarray) -> float:
    norms = float(np.linalg.norm(want) * np.linalg.norm(got))
    if norms == 0.0:
        return 1.0 if not want.any() and not got.any() else 0.0
    return float(np.clip(np.dot(want, got) / norms, -1.0, 1.0))


def _compress_settings(canonical: Mapping[str, Any], weights: int) -> dict[str, Any]:
    settings: dict[str, Any] = {"mode": canonical["mode"]}
    if "group_size" in canonical:
        settings["group_size"] = resolve_group_size(canonical, weights)
        settings["ratio"] = canonical["ratio"]
        settings["all_layers"] = canonical["all_layers"]
    return settings


def _nncf_call(function: Any, *args: Any, **kwargs: Any) -> Any:
    """Run NNCF; its refusals (a group size that does not divide a layer, say) are the
    model's or the arguments' fault: the job fails with NNCF's reason, no retry."""
    import nncf

    refusals = (
        nncf.errors.ParameterNotSupportedError,
        nncf.errors.ValidationError,
        nncf.errors.InvalidGroupSizeError,
        nncf.errors.UnsupportedModelError,
        nncf.errors.UnsupportedDatasetError,
    )
    try:
        return function(*args, **kwargs)
    except refusals as error:
        raise ConversionError(f"NNCF refused: {error}") from None


def _outputs(
    core: Any, model: Any, samples: Sequence[Mapping[str, np.ndarray]]
) -> list[dict[str, np.ndarray]]:
    """The model's outputs on each sample, by output name (or position), on CPU in f32; the
    compiled model is released on return."""
    compiled = core.compile_model(model, "CPU", _CPU_F32)
    names = [_output_name(output, index) for index, output in enumerate(compiled.outputs)]
    request = compiled.create_infer_request()
    results = []
    for sample in samples:
        produced = request.infer(dict(sample))
        results.append({name: np.array(produced[i]) for i, name in enumerate(names)})
    del request, compiled
    return results


def _output_name(output: Any, index: int) -> str:
    names = output.get_names()
    return min(names) if names else f"output{index}"


def _input_specs(model: Any, dynamic: int = 1) -> list[InputSpec]:
    """The model's inputs, dynamic dimensions at `dynamic` (1: drift inputs must be concrete;
    -1: a calibration sample may have any size there)."""
    specs = []
    for parameter in model.inputs:
        shape = tuple(
            d.get_length() if d.is_static else dynamic for d in parameter.get_partial_shape()
        )
        dtype = parameter.get_element_type().to_dtype().name
        specs.append(InputSpec(parameter.get_any_name(), shape, dtype))
    return specs


def _as_model_inputs(sample: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    return dict(sample)


def _weights_bytes(xml: Path) -> int:
    weights = Path(xml).with_suffix(".bin")
    return weights.stat().st_size if weights.exists() else 0


def _nncf() -> Any:
    """NNCF, imported quietly: progress tables at WARNING only, and no usage telemetry (NNCF
    sends none when NNCF_CI is set; a worker talks to nobody)."""
    os.environ.setdefault("NNCF_CI", "1")
    try:
        import nncf
    except ImportError:
        raise ConverterUnavailable(
            "this worker cannot compress models: NNCF is not installed; install it with "
            "pip install 'farm[compress]'"
        ) from None
    nncf.set_log_level(logging.WARNING)
    return nncf


# --- the sandbox child's entry (farm.server.stages.child) ------------------------------------


def prepare(
    args: dict[str, Any], *, switching_user: bool = False, files: dict[str, Path] | None = None
) -> None:
    """Import OpenVINO and NNCF as the worker's user, before the child switches user;
    `ConverterUnavailable` names the extra when NNCF is missing. `switching_user`: the compile
    user may not read the Python installation, and NNCF imports its algorithms lazily, so both
    run once now on a tiny model of farm's own (never on the user's files)."""
    import openvino  # noqa: F401

    _without_torch()
    nncf = _nncf()
    if switching_user:
        _warm_up(nncf)


def _without_torch() -> None:
    """Keep torch out of this child. NNCF imports it whenever it is installed (its tensor
    functions for PyTorch models), on a worker that also converts PyTorch sources: measured
    1.7 s and 180 MB of resident memory per stage, for nothing, since a stage compresses
    OpenVINO IR with NNCF's OpenVINO backend. A worker with `farm[compress]` alone has no torch
    at all; this makes one with `farm[convert]` too behave the same. Only in the stage's own
    child process (`prepare`): a ``None`` entry makes every later ``import torch`` fail."""
    sys.modules.setdefault("torch", None)  # type: ignore[arg-type]


def _warm_up(nncf: Any) -> None:
    import openvino as ov
    from openvino import opset13 as ops

    x = ops.parameter([1, 3, 4, 4], ov.Type.f32, name="x")
    kernel = ops.constant(np.full((4, 3, 1, 1), 0.5, np.float32))
    conv = ops.convolution(x, kernel, [1, 1], [0, 0], [0, 0], [1, 1])
    weights = ops.constant(np.full((4, 4), 0.25, np.float32))
    model = ov.Model([ops.matmul(ops.reshape(conv, [4, 16], False), weights, True, False)], [x])
    nncf.compress_weights(model.clone(), mode=nncf.CompressWeightsMode.INT8_ASYM)
    sample = np.ones((1, 3, 4, 4), np.float32)
    nncf.quantize(model, nncf.Dataset([sample]), subset_size=1)


def run(request: StageRequest) -> StageOutcome:
    """Run the stage on the request's IR (NNCF only: its drift is the next child's, `drift`);
    `quantize` reads its calibration files, staged beside the model by the stage phase under
    the roles ``calibration/<relative path>``."""
    samples: list[dict[str, np.ndarray]] = []
    if request.kind == QUANTIZE:
        samples = calibration_samples(request)
    result = compress_model(
        request.kind, request.args, request.files["xml"], request.out_dir, calibration=samples
    )
    return StageOutcome(result.tool_versions, result.metrics)


def drift_seed(kind: str, args: Mapping[str, Any]) -> str:
    """The seed of a stage's drift inputs when it has no reference inputs: its kind and args."""
    seed = json.dumps({"kind": kind, "args": dict(args)}, sort_keys=True)
    return hashlib.sha256(seed.encode()).hexdigest()


def calibration_samples(request: StageRequest) -> list[dict[str, np.ndarray]]:
    import openvino as ov

    from farm.core.calibration import load_samples

    files = {
        role.removeprefix(CALIBRATION_ROLE): path
        for role, path in request.files.items()
        if role.startswith(CALIBRATION_ROLE)
    }
    model = ov.Core().read_model(request.files["xml"])
    return load_samples(files, _input_specs(model, dynamic=-1))
