"""The ``convert`` stage, child side: a source into OpenVINO IR (docs/architecture.md §15).

- TFLite, PaddlePaddle, TensorFlow SavedModel and frozen graphs: OpenVINO's own frontends
  (`ov.convert_model` on the file or folder); no framework installed.
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

import importlib.metadata
import shutil
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
_VERSIONS: dict[str, str] = {}
"""Read in `prepare`, before the child switches user (the metadata may be unreadable after)."""


def prepare(args: dict[str, Any]) -> None:
    """Import OpenVINO and the format's framework (as the worker's user, before the sandbox
    switches user); ConverterUnavailable names the extra when the framework is missing."""
    import openvino  # noqa: F401

    fmt = args["format"]
    for name in FRAMEWORK_MODULES.get(fmt, ()):
        try:
            importlib.import_module(name)
        except ImportError as error:
            converter = "optimum" if fmt == sources.HUGGINGFACE else "torch"
            extra = CONVERTERS[converter].extra
            raise ConverterUnavailable(
                f"this worker cannot convert {fmt} sources: {error}; install the converter "
                f"with pip install 'farm[{extra}]'"
            ) from None
    import openvino as ov

    _VERSIONS["openvino"] = ov.get_version()
    for distribution in DISTRIBUTIONS.get(fmt, ()):
        _VERSIONS[distribution] = _version(distribution)
    if fmt in sources.TORCH_FORMATS:
        _warm_up_torch(fmt)


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
    import openvino as ov

    fmt = request.args["format"]
    source = sources.Source(fmt, request.files, request.input_dir)
    global _NAME
    _NAME = str(request.options.get("source_name") or source.path.name)
    if fmt == sources.HUGGINGFACE:
        _huggingface(source, request)
        return StageOutcome(dict(_VERSIONS))
    model = _torch(source, request.args) if fmt in sources.TORCH_FORMATS else _native(source)
    ov.save_model(model, request.out_dir / "model.xml", compress_to_fp16=False)
    return StageOutcome(dict(_VERSIONS))


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
        hint = ""
        if source.format == sources.PADDLE and "json" in source.files:
            hint = (
                f"; OpenVINO {ov.get_version().split('-')[0]} reads Paddle's .pdmodel format: "
                "save the model with FLAGS_enable_pir_api=0 (paddle.jit.save writes "
                ".pdmodel + .pdiparams then)"
            )
        raise ConversionError(_failed(source, error) + hint) from error


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
    return model


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
    shutil.move(xml, request.out_dir / "model.xml")
    shutil.move(xml.with_suffix(".bin"), request.out_dir / "model.bin")
    shutil.rmtree(exported, ignore_errors=True)


def _failed(source: sources.Source, error: Exception, tool: str = "OpenVINO") -> str:
    from farm.toolchain import last_line

    return f"cannot convert {_NAME} ({source.format}): {tool}: {last_line(error)[:2000]}"


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
