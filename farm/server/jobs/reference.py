"""Reference outputs at compile time: run the source model on CPU in f32, as the blob was shaped.

Runs in the sandbox's child process (`sandbox.reference_in_child`), after the compile's child
has exited: the two peaks never add up. The model is read and shaped exactly as the compiler
does (`farm.prepare`), so the inputs fit the blob; the CPU plugin runs it in f32 with
`EXECUTION_MODE_HINT=ACCURACY`, the most exact numbers this host can give.
docs/architecture.md §14.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import openvino as ov

from farm.core.errors import ModelError
from farm.core.reference import InputSpec, Reference, load_inputs, seeded_inputs
from farm.core.spec import CompileSpec
from farm.prepare import apply_shapes, read_model
from farm.toolchain import last_line

REFERENCE_PROPERTIES = {"INFERENCE_PRECISION_HINT": "f32", "EXECUTION_MODE_HINT": "ACCURACY"}
REFERENCE_BYTES_PER_MODEL_BYTE = 2
REFERENCE_BYTES_OVER_MODEL = 256 * 2**20
"""A CPU run of a model needs about its weights twice (the mapped file and the plugin's packed
copy) plus activations: the estimate a worker checks against its memory budget before trying."""


class ReferenceSkipped(Exception):
    """No reference for this blob, for a reason worth recording (not a failure of the job)."""


def reference_memory_bytes(model_bytes: int) -> int:
    return REFERENCE_BYTES_PER_MODEL_BYTE * model_bytes + REFERENCE_BYTES_OVER_MODEL


def skip_reason(model_bytes: int, memory_bytes: int | None) -> str | None:
    """Why a model is too large to run here for its reference (None: it fits)."""
    need = reference_memory_bytes(model_bytes)
    if memory_bytes is not None and need > memory_bytes:
        return (
            f"no reference outputs: a CPU run of this {model_bytes}-byte model needs about "
            f"{need} bytes, over the worker's compile memory limit of {memory_bytes} "
            "(FARM_COMPILE_MEMORY_BYTES)"
        )
    return None


def compute_reference(
    files: Mapping[str, Path],
    spec: CompileSpec,
    cache_key: str,
    out_path: Path,
    inputs_path: Path | None = None,
    outputs_from: Callable[[ov.Model, dict[str, np.ndarray]], dict[str, np.ndarray]] | None = None,
) -> Path:
    """Write the reference file of `spec`'s blob to `out_path`: the inputs (the submitter's, or
    seeded from `cache_key`) and the f32 outputs of the source model. `outputs_from`: computes
    the outputs from a converted model's own source instead (docs §15)."""
    core = ov.Core()
    model = read_model(core, files)
    apply_shapes(model, spec)
    names = [port.get_any_name() for port in model.inputs]
    if inputs_path is not None:
        inputs = _fit_supplied(load_inputs(inputs_path), model)
    else:
        inputs = seeded_inputs(cache_key, [_input_spec(port) for port in model.inputs])
    if outputs_from is not None:
        try:
            return Reference(inputs, outputs_from(model, inputs)).save(out_path)
        except ModelError:
            raise
        except Exception as error:  # the framework's own errors: any class
            why = f"no reference outputs: the source's run failed: {last_line(error)}"
            raise ReferenceSkipped(why) from error
    try:
        compiled = core.compile_model(model, "CPU", REFERENCE_PROPERTIES)
        results = compiled.create_infer_request().infer([inputs[name] for name in names])
    except Exception as error:  # OpenVINO raises RuntimeError for any refusal
        why = f"no reference outputs: the CPU run failed: {last_line(error)}"
        raise ReferenceSkipped(why) from error
    outputs = {}
    for index, port in enumerate(compiled.outputs):
        name = port.get_any_name() if port.get_names() else f"output{index}"
        outputs[name] = np.array(results[port], copy=True)
    return Reference(inputs, outputs).save(out_path)


def _input_spec(port: ov.Output) -> InputSpec:
    shape = port.get_partial_shape()
    if shape.is_dynamic:
        raise ReferenceSkipped(
            f"no reference outputs: input {port.get_any_name()!r} has the dynamic shape "
            f"{shape}; give --shape, or reference inputs with `farm submit --inputs FILE.npz`"
        )
    return InputSpec(port.get_any_name(), tuple(d.get_length() for d in shape), str(_dtype(port)))


def _dtype(port: ov.Output) -> np.dtype:
    return np.dtype(port.get_element_type().to_dtype())


def _fit_supplied(supplied: dict[str, np.ndarray], model: ov.Model) -> dict[str, np.ndarray]:
    """The submitter's arrays, one per input by name (or by position when there is one input
    and one array), each of the input's element type and a shape it accepts."""
    if len(model.inputs) == 1 and len(supplied) == 1:
        supplied = {model.inputs[0].get_any_name(): next(iter(supplied.values()))}
    fitted = {}
    for port in model.inputs:
        name = port.get_any_name()
        if name not in supplied:
            given = ", ".join(supplied) or "none"
            raise ModelError(
                f"--inputs has no array for the model's input {name!r} (arrays: {given})"
            )
        array = supplied[name]
        if not port.get_partial_shape().compatible(ov.PartialShape(list(array.shape))):
            raise ModelError(
                f"--inputs array {name!r} has shape {list(array.shape)}; the input takes "
                f"{port.get_partial_shape()}"
            )
        fitted[name] = array.astype(_dtype(port), copy=False)
    return fitted
