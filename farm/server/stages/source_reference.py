"""Reference outputs of a converted model, computed from its source (docs §14, §15).

A blob compiled from a converted source is judged against what the source computes, not what
the converted IR computes: `farm verify` then proves the conversion and the compile together.
PyTorch sources run in torch (`torch.export.load(...).module()`, `torch.jit.load`); TFLite,
Paddle and TensorFlow sources are read again from the original file by OpenVINO's own frontend
and run on CPU in f32 (no framework on the worker). Hugging Face folders keep the converted IR's
outputs: running transformers here would need the model's Python classes in the child.

Runs in the sandbox's reference child (`sandbox.reference_in_child`); `prepare` loads the
framework before the child switches user.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from farm.core import sources
from farm.core.errors import ModelError

Outputs = Callable[[Any, dict[str, np.ndarray]], dict[str, np.ndarray]]
"""(the shaped converted model, inputs by name) -> outputs by the converted model's names."""


def prepare(fmt: str) -> None:
    if fmt in sources.TORCH_FORMATS:
        from farm.server.stages import convert

        # Imports torch and runs it once on a tiny model (the child switches user next).
        convert.prepare({"format": fmt}, switching_user=True)


def outputs_from(fmt: str, files: Mapping[str, Path], folder: Path) -> Outputs | None:
    """How to compute the outputs from the source, or None: use the converted model's."""
    if fmt in sources.TORCH_FORMATS:
        return lambda model, inputs: _named(model, _torch_outputs(fmt, files, model, inputs))
    if fmt in sources.NATIVE_FORMATS:
        source = sources.Source(fmt, dict(files), folder)
        return lambda model, inputs: _named(model, _native_outputs(source, model, inputs))
    return None


def _ordered(model: Any, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
    return [inputs[port.get_any_name()] for port in model.inputs]


def _named(model: Any, arrays: list[np.ndarray]) -> dict[str, np.ndarray]:
    ports = list(model.outputs)
    if len(arrays) != len(ports):
        raise ModelError(
            f"the source computes {len(arrays)} outputs, the converted model {len(ports)}"
        )
    return {
        (port.get_any_name() if port.get_names() else f"output{index}"): np.array(array)
        for index, (port, array) in enumerate(zip(ports, arrays, strict=True))
    }


def _torch_outputs(
    fmt: str, files: Mapping[str, Path], model: Any, inputs: dict[str, np.ndarray]
) -> list[np.ndarray]:
    import torch

    path = files.get("pt2") or files["torchscript"]
    sources.torch_archive_kind(path)  # never hand torch a pickle
    if fmt == sources.PT2:
        module = torch.export.load(str(path)).module()
    else:
        module = torch.jit.load(str(path), map_location="cpu").eval()
    with torch.no_grad():
        result = module(
            *[torch.from_numpy(np.ascontiguousarray(a)) for a in _ordered(model, inputs)]
        )
    return [t.detach().cpu().numpy() for t in _flatten(result)]


def _flatten(value: Any) -> list[Any]:
    if isinstance(value, list | tuple):
        return [item for part in value for item in _flatten(part)]
    if isinstance(value, dict):
        return [item for part in value.values() for item in _flatten(part)]
    return [value]


def _native_outputs(
    source: sources.Source, model: Any, inputs: dict[str, np.ndarray]
) -> list[np.ndarray]:
    import openvino as ov

    from farm.server.jobs.reference import REFERENCE_PROPERTIES

    path = {
        sources.TFLITE: source.files.get("tflite"),
        sources.PADDLE: source.files.get("pdmodel") or source.files.get("json"),
        sources.FROZEN_PB: source.files.get("pb"),
        sources.SAVEDMODEL: source.path,
    }[source.format]
    original = ov.convert_model(str(path))
    original.reshape({index: port.get_partial_shape() for index, port in enumerate(model.inputs)})
    compiled = ov.Core().compile_model(original, "CPU", REFERENCE_PROPERTIES)
    results = compiled.create_infer_request().infer(_ordered(model, inputs))
    return [np.array(results[port], copy=True) for port in compiled.outputs]
