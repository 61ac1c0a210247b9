"""Reference outputs of a converted model, computed from its source (docs §14, §15).

A blob compiled from a converted source is judged against what the source computes, not what
the converted IR computes: `farm verify` then proves the conversion and the compile together.
PyTorch sources run in torch (`torch.export.load(...).module()`, `torch.jit.load`); Hugging
Face folders in transformers (the task's model class, as optimum's `TasksManager` names it,
loaded from the folder's files only, never with the folder's own code, in f32, its outputs
taken by the converted IR's output names); Paddle 3 programs (.json) in Paddle's
inference engine; TFLite, Paddle .pdmodel and TensorFlow sources are read again
from the original file by OpenVINO's own frontend and run on CPU in f32 (no framework on the
worker). A Hugging Face folder with its own code keeps the converted IR's outputs: its classes
are code farm does not run outside the conversion.

Runs in the sandbox's reference child (`sandbox.reference_in_child`); `prepare` loads the
framework before the child switches user.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from farm.core import sources
from farm.core.errors import ModelError
from farm.core.reference import output_label

Outputs = Callable[[Any, dict[str, np.ndarray]], dict[str, np.ndarray]]
"""(the shaped converted model, inputs by name) -> outputs by the converted model's names."""


HF_IGNORED_INPUTS = ("beam_idx",)
"""Inputs of an exported model the transformers model does not take: a stateful model's beam
reordering, which is the identity on a first (reference) run."""


def prepare(fmt: str, files: Mapping[str, Path] | None = None) -> None:
    """Load the source's framework as the worker's user (the child switches user next, and the
    compile user may not read the Python installation): torch runs once on a tiny model;
    transformers imports the folder's architecture (its config.json's `model_type`, read as
    JSON) and runs a tiny BERT of farm's own. `files`: the source's files by role."""
    if fmt in sources.TORCH_FORMATS:
        from farm.server.stages import convert

        # Imports torch and runs it once on a tiny model (the child switches user next).
        convert.prepare({"format": fmt}, switching_user=True)
    elif fmt == sources.HUGGINGFACE:
        _prepare_huggingface((files or {}).get("config.json"))
    elif fmt == sources.PADDLE and "json" in (files or {}):
        import paddle.inference  # noqa: F401


def outputs_from(fmt: str, files: Mapping[str, Path], folder: Path) -> Outputs | None:
    """How to compute the outputs from the source, or None: use the converted model's."""
    if fmt in sources.TORCH_FORMATS:
        return lambda model, inputs: _named(model, _torch_outputs(fmt, files, model, inputs))
    if fmt == sources.HUGGINGFACE:
        source = sources.Source(fmt, dict(files), folder)
        if sources.hf_custom_code(source):
            return None
        return lambda model, inputs: _huggingface_outputs(source, model, inputs)
    if fmt == sources.PADDLE and "json" in files:
        return lambda model, inputs: _named(model, _paddle_outputs(files, model, inputs))
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


def _prepare_huggingface(config: Path | None) -> None:
    import json

    import torch
    import transformers
    from optimum.exporters.tasks import TasksManager  # noqa: F401
    from transformers import BertConfig, BertForSequenceClassification

    model_type = ""
    if config is not None:
        with contextlib.suppress(OSError, ValueError, AttributeError):
            model_type = str(json.loads(config.read_text()).get("model_type") or "")
    package = model_type.replace("-", "_")
    if package.isidentifier():  # the package is lazy: its modeling module is what runs
        for name in (
            f"transformers.models.{package}",
            f"transformers.models.{package}.modeling_{package}",
        ):
            with contextlib.suppress(ImportError):
                importlib.import_module(name)
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    sizes: dict[str, Any] = {
        "vocab_size": 16,
        "hidden_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "intermediate_size": 8,
        "max_position_embeddings": 16,
    }
    tiny = BertConfig(**sizes)
    with torch.no_grad():
        BertForSequenceClassification(tiny).eval()(input_ids=torch.zeros((1, 4), dtype=torch.long))


def _huggingface_outputs(
    source: sources.Source, model: Any, inputs: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """The task's transformers model on the reference inputs, by the IR's input names; its
    outputs by the IR's output names (ModelError when the two do not match by name)."""
    import inspect

    import torch
    from optimum.exporters.tasks import TasksManager

    task = _task_of(model, source)
    config = sources.hf_config(source)
    model_class = TasksManager.get_model_class_for_task(
        task, framework="pt", model_type=str(config.get("model_type") or "") or None
    )
    module = model_class.from_pretrained(
        str(source.path), local_files_only=True, trust_remote_code=False
    )
    module = module.float().eval()  # f32 whatever the weights were saved in
    accepted = inspect.signature(module.forward).parameters
    arguments = {}
    for port in model.inputs:
        name = port.get_any_name()
        if name in accepted:
            arguments[name] = torch.from_numpy(np.ascontiguousarray(inputs[name]))
        elif name not in HF_IGNORED_INPUTS:
            raise ModelError(
                f"the converted model's input {name!r} is not an argument of "
                f"{type(module).__name__}: cannot run the source on the reference inputs"
            )
    with torch.no_grad():
        result = module(**arguments, return_dict=True)
    outputs = {}
    for index, port in enumerate(model.outputs):
        names = sorted(port.get_names())
        found = next((name for name in names if name in result), None)
        if found is None:
            raise ModelError(
                f"the converted model's output {', '.join(names) or index} is none of "
                f"{type(module).__name__}'s outputs ({', '.join(result.keys())})"
            )
        outputs[output_label(names, index)] = result[found].detach().cpu().numpy()
    return outputs


def _task_of(model: Any, source: sources.Source) -> str:
    """The task the IR was exported for (the convert stage records it in the IR's rt_info);
    from config.json for an IR converted before it did."""
    from farm.server.stages.convert import TASK_RT_INFO

    if model.has_rt_info(list(TASK_RT_INFO)):
        return str(model.get_rt_info(list(TASK_RT_INFO)).astype(str))
    task = sources.hf_task(source)
    if task is None:
        raise ModelError(f"{source.path}: the task it was converted for is not known")
    return task


def _paddle_outputs(
    files: Mapping[str, Path], model: Any, inputs: dict[str, np.ndarray]
) -> list[np.ndarray]:
    """A Paddle 3 program in Paddle's own inference engine, on CPU, its graph optimisations
    off (the program as written), the inputs by the IR's input names."""
    import paddle.inference as inference

    config = inference.Config(str(files["json"]), str(files["pdiparams"]))
    config.disable_gpu()
    config.switch_ir_optim(False)
    config.disable_glog_info()
    predictor = inference.create_predictor(config)
    for port in model.inputs:
        name = port.get_any_name()
        handle = predictor.get_input_handle(name)
        handle.reshape(list(inputs[name].shape))
        handle.copy_from_cpu(np.ascontiguousarray(inputs[name]))
    predictor.run()
    return [predictor.get_output_handle(n).copy_to_cpu() for n in predictor.get_output_names()]
