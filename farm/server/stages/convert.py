"""The ``convert`` stage, child side: a source into OpenVINO IR (docs/architecture.md §15).

- TFLite, PaddlePaddle (.pdmodel), TensorFlow SavedModel and frozen graphs: OpenVINO's own
  frontends (`ov.convert_model` on the file or folder); no framework installed.
- Paddle 3 programs (.json, PIR; convert arg ``program: pir``): paddle2onnx into ONNX, then
  OpenVINO's ONNX frontend (converter `paddle`: OpenVINO 2026.4 reads only .pdmodel).
- PyTorch: a torch.export program (`torch.export.load`) or a TorchScript archive
  (`torch.jit.load`), after checking the zip's layout (`sources.torch_archive_kind`): nothing
  is unpickled with Python's pickle, so a pickled module (`torch.save(model)`) is refused
  before torch sees it. `--example-input` gives the inputs' shapes and types.
- Hugging Face folders: optimum-intel's OpenVINO exporter (`main_export`) for the task, offline;
  a folder with its own code runs only when the admin allows it (FARM_ALLOW_REMOTE_CODE).

Writes ``out/model.xml`` and ``out/model.bin`` (weights as they are: no FP16 compression, so
the IR computes what the source does).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from farm.core import sources
from farm.core.errors import ConversionError, ConverterUnavailable, ModelFileError
from farm.core.stages import CONVERTERS, NUMPY_DTYPES
from farm.server.stages.child import StageOutcome, StageRequest

FRAMEWORK_MODULES = {
    sources.PT2: ("torch", "torch.export.pt2_archive"),
    sources.TORCHSCRIPT: ("torch",),
    sources.HUGGINGFACE: ("torch", "transformers", "optimum.exporters.openvino"),
}
DISTRIBUTIONS = {
    sources.PT2: ("torch",),
    sources.TORCHSCRIPT: ("torch",),
    sources.HUGGINGFACE: ("torch", "transformers", "optimum-intel"),
}
PADDLE_PIR_MODULES = ("paddle", "paddle2onnx")
PADDLE_PIR_DISTRIBUTIONS = ("paddlepaddle", "paddle2onnx")
"""A Paddle 3 program (convert arg ``program: pir``): paddle2onnx writes ONNX, OpenVINO reads it."""
PADDLE_ONNX_OPSET = 17
TASK_RT_INFO = ("farm", "task")
"""Where a Hugging Face folder's IR records the task it was exported for (its rt_info)."""
_VERSIONS: dict[str, str] = {}
"""Read in `prepare`, before the child switches user (the metadata may be unreadable after)."""


def prepare(
    args: dict[str, Any], *, switching_user: bool = False, files: dict[str, Path] | None = None
) -> None:
    """Import OpenVINO and the format's framework (as the worker's user, before the sandbox
    switches user); ConverterUnavailable names the extra when the framework is missing.
    `switching_user`: the child switches to the compile user next, who may not read the Python
    installation: torch and transformers import dozens of modules lazily, so the conversion runs
    once now on a tiny model of farm's own (never on the user's files)."""
    import openvino  # noqa: F401

    fmt = args["format"]
    pir = args.get("program") == sources.PADDLE_PIR
    for name in PADDLE_PIR_MODULES if pir else FRAMEWORK_MODULES.get(fmt, ()):
        try:
            # paddle2onnx prints while it loads; the child's stdout is not a log.
            with contextlib.redirect_stdout(sys.stderr):
                importlib.import_module(name)
        except ImportError as error:
            converter = "optimum" if fmt == sources.HUGGINGFACE else "torch"
            converter = "paddle" if pir else converter
            extra = CONVERTERS[converter].extra
            raise ConverterUnavailable(
                f"this worker cannot convert {fmt} sources: {error}; install the converter "
                f"with pip install 'farm[{extra}]'"
            ) from None
    import openvino as ov

    _VERSIONS["openvino"] = ov.get_version()
    for distribution in PADDLE_PIR_DISTRIBUTIONS if pir else DISTRIBUTIONS.get(fmt, ()):
        _VERSIONS[distribution] = _version(distribution)
    if switching_user and pir:
        # What paddle2onnx imports as it exports (the compile user may not read them).
        for name in ("paddle2onnx.convert", "onnx", "paddle.inference"):
            with contextlib.suppress(ImportError), contextlib.redirect_stdout(sys.stderr):
                importlib.import_module(name)
    if switching_user and fmt in sources.TORCH_FORMATS:
        _warm_up_torch(fmt)
    if switching_user and fmt == sources.HUGGINGFACE:
        _warm_up_optimum(args["task"], (files or {}).get("config.json"))


def _warm_up_optimum(task: str, config: Path | None) -> None:
    """Export a tiny BERT of our own with optimum-intel, and import the modules of the
    folder's own architecture (read from its config.json's model_type: JSON, no code)."""
    import json

    import torch
    import transformers
    from optimum.exporters.openvino import main_export
    from transformers import BertConfig, BertForSequenceClassification

    model_type = ""
    if config is not None:
        with contextlib.suppress(OSError, ValueError, AttributeError):
            model_type = str(json.loads(config.read_text()).get("model_type") or "")
    if model_type.isidentifier():
        with contextlib.suppress(ImportError):
            importlib.import_module(f"transformers.models.{model_type.replace('-', '_')}")
    with tempfile.TemporaryDirectory(prefix="farm-warm-up-") as folder:
        torch.manual_seed(0)
        sizes: dict[str, Any] = {
            "vocab_size": 64,
            "hidden_size": 8,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "intermediate_size": 8,
            "max_position_embeddings": 64,
        }
        BertForSequenceClassification(BertConfig(**sizes)).save_pretrained(folder + "/in")
        # Best effort: what it misses fails again, with its real error, in the conversion.
        with contextlib.redirect_stdout(sys.stderr), contextlib.suppress(Exception):
            main_export(
                model_name_or_path=folder + "/in",
                output=folder + "/out",
                task="text-classification",
                local_files_only=True,
            )
    transformers.logging.get_logger(__name__)
    del task  # the folder's task's own classes were imported with its architecture


def _warm_up_torch(fmt: str) -> None:
    """Run the whole conversion once on a tiny model of our own, as the worker's user: torch
    and OpenVINO's PyTorch frontend import dozens of modules lazily, and the compile user may
    not be able to read the Python installation they come from (a root worker's /root)."""
    import io

    import openvino as ov
    import torch

    module = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()).eval()
    example = (torch.zeros(1, 2),)
    buffer = io.BytesIO()
    if fmt == sources.PT2:
        torch.export.save(torch.export.export(module, example), buffer)
        buffer.seek(0)
        ov.convert_model(torch.export.load(buffer))
    else:
        torch.jit.save(torch.jit.trace(module, example), buffer)
        buffer.seek(0)
        ov.convert_model(torch.jit.load(buffer, map_location="cpu"), example_input=example)


def run(request: StageRequest) -> StageOutcome:

    fmt = request.args["format"]
    source = sources.Source(fmt, request.files, request.input_dir)
    global _NAME
    _NAME = str(request.options.get("source_name") or source.path.name)
    if fmt == sources.HUGGINGFACE:
        _huggingface(source, request)
        return StageOutcome(dict(_VERSIONS))
    if request.args.get("program") == sources.PADDLE_PIR:
        model = _paddle_pir(source, request.out_dir.parent)
    elif fmt in sources.TORCH_FORMATS:
        model = _torch(source, request.args)
    else:
        model = _native(source)
    return StageOutcome(dict(_VERSIONS), model=model)  # saved by the child (child.run)


_NAME = ""
"""The source's name as submitted, for messages (its files are staged under fixed names)."""


def _native(source: sources.Source) -> Any:
    import openvino as ov

    path = {
        sources.TFLITE: source.files.get("tflite"),
        sources.PADDLE: source.files.get("pdmodel") or source.files.get("json"),
        sources.FROZEN_PB: source.files.get("pb"),
        sources.SAVEDMODEL: source.path,
    }[source.format]
    try:
        return ov.convert_model(str(path))
    except Exception as error:  # OpenVINO raises RuntimeError/OpConversionFailure/...
        raise ConversionError(_failed(source, error)) from error


def _paddle_pir(source: sources.Source, scratch: Path) -> Any:
    """A Paddle 3 program (.json + .pdiparams): paddle2onnx writes ONNX (OpenVINO 2026.4
    reads only the older .pdmodel), which OpenVINO's ONNX frontend reads."""
    import openvino as ov
    import paddle2onnx  # type: ignore[import-untyped]

    onnx = Path(tempfile.mkdtemp(prefix="paddle2onnx-", dir=scratch)) / "model.onnx"
    try:
        with contextlib.redirect_stdout(sys.stderr):
            paddle2onnx.export(
                str(source.files["json"]),
                str(source.files["pdiparams"]),
                save_file=str(onnx),
                opset_version=PADDLE_ONNX_OPSET,
                enable_onnx_checker=True,
                optimize_tool="None",
            )
    except Exception as error:  # paddle2onnx asserts, and raises what paddle raises
        raise ConversionError(_failed(source, error, "paddle2onnx")) from None
    except SystemExit as exited:  # and exits on some refusals
        why = RuntimeError(f"it exited with status {exited.code}")
        raise ConversionError(_failed(source, why, "paddle2onnx")) from None
    if not onnx.is_file():
        raise ConversionError(f"cannot convert {_NAME} (paddle): paddle2onnx wrote no model")
    try:
        return ov.convert_model(str(onnx))
    except Exception as error:
        raise ConversionError(_failed(source, error)) from error


def _torch(source: sources.Source, args: dict[str, Any]) -> Any:
    import openvino as ov
    import torch

    path = source.files.get("pt2") or source.files["torchscript"]
    found = sources.torch_archive_kind(path)  # refuses pickles before torch reads a byte
    examples = args.get("example_input") or []
    inputs = [_example_tensor(torch, entry) for entry in examples]
    try:
        if found == sources.PT2:
            program: Any = torch.export.load(str(path))
        else:
            program = torch.jit.load(str(path), map_location="cpu")
            program.eval()
    except Exception as error:
        raise ConversionError(_failed(source, error, "torch")) from error
    if found == sources.TORCHSCRIPT and not inputs:
        raise ConversionError(
            f"{_NAME}: a TorchScript model needs its inputs' shapes: give "
            "--example-input NAME[d1,d2,...]:TYPE (for example input[1,3,224,224]:f32)"
        )
    try:
        model = ov.convert_model(program, example_input=tuple(inputs) if inputs else None)
    except Exception as error:
        raise ConversionError(_failed(source, error)) from error
    for port, entry in zip(model.inputs, examples, strict=False):
        if entry.get("name"):
            port.get_tensor().set_names({entry["name"]})
    # OpenVINO leaves the inputs of a converted program dynamic; the shapes the program was
    # exported (or the example inputs were given) with are the model's: a static model is
    # what an NPU compiles and what a reference run needs. --shape still reshapes it.
    shapes = [entry["shape"] for entry in examples] or _exported_shapes(program, found)
    if shapes and len(shapes) == len(model.inputs):
        try:
            model.reshape({i: ov.PartialShape(shape) for i, shape in enumerate(shapes)})
        except Exception as error:
            raise ConversionError(_failed(source, error)) from error
    return model


def _exported_shapes(program: Any, found: str) -> list[list[int]]:
    """The static shapes of a torch.export program's user inputs ([] when any is symbolic)."""
    if found != sources.PT2:
        return []
    users = set(program.graph_signature.user_inputs)
    shapes = []
    for node in program.graph.nodes:
        if node.op == "placeholder" and node.name in users:
            value = node.meta.get("val")
            dims = list(getattr(value, "shape", []))
            if not all(isinstance(d, int) for d in dims):
                return []
            shapes.append(dims)
    return shapes


def _example_tensor(torch: Any, entry: dict[str, Any]) -> Any:
    dtype = getattr(torch, NUMPY_DTYPES[entry["dtype"]])
    if dtype.is_floating_point:
        return torch.rand(entry["shape"], dtype=dtype)
    return torch.zeros(entry["shape"], dtype=dtype)


def _huggingface(source: sources.Source, request: StageRequest) -> None:
    from optimum.exporters.openvino import main_export

    custom = sources.hf_custom_code(source)
    allowed = bool(request.options.get("allow_remote_code"))
    if custom and not allowed:
        raise ModelFileError(
            f"{_NAME}: this Hugging Face folder has its own code ({', '.join(custom)}), "
            "which farm does not run unless the farm's admin sets FARM_ALLOW_REMOTE_CODE=true "
            "(it then runs in the sandboxed child only)"
        )
    exported = Path(tempfile.mkdtemp(prefix="optimum-", dir=request.out_dir.parent))
    try:
        main_export(
            model_name_or_path=str(source.path),
            output=exported,
            task=request.args["task"],
            trust_remote_code=allowed,
            local_files_only=True,
            convert_tokenizer=False,
        )
    except Exception as error:
        raise ConversionError(_failed(source, error, "optimum-intel")) from error
    xml = exported / "openvino_model.xml"
    if not xml.is_file():
        made = ", ".join(sorted(p.name for p in exported.iterdir())) or "nothing"
        raise ConversionError(
            f"{_NAME}: optimum-intel wrote no openvino_model.xml (it wrote: {made}); "
            "a pipeline of several models is a job for farm's pipelines"
        )
    import openvino as ov

    # The task, in the IR: the reference run loads the task's transformers class from it.
    model = ov.Core().read_model(xml)
    model.set_rt_info(request.args["task"], list(TASK_RT_INFO))
    ov.save_model(model, request.out_dir / "model.xml", compress_to_fp16=False)
    del model
    shutil.rmtree(exported, ignore_errors=True)


def _failed(source: sources.Source, error: Exception, tool: str = "OpenVINO") -> str:
    from farm.toolchain import last_line

    return f"cannot convert {_NAME} ({source.format}): {tool}: {last_line(error)[:2000]}"


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
