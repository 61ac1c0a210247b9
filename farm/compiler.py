"""The only place that compiles: read a model, apply shapes, compile with OpenVINO, write the blob.

The blob is written by OpenVINO itself through its model cache (`CACHE_DIR` + `CACHE_BLOB_ID`)
rather than through `CompiledModel.export_model()`, which returns the whole blob as Python bytes:
for a 512 MB model that is ~6x slower and ~0.5 GB more peak memory (OPENVINO_NOTES.md). The file
is therefore an OpenVINO cache entry; `farm.blobformat` finds the export payload inside it.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np
import openvino as ov
from openvino import opset13 as ops

from farm.blobformat import read_header
from farm.spec import KNOWN_TARGETS, MAX_ELEMENTS, SINGLE_INPUT, CompileSpec, Target, Toolchain

NPU_COMPILER_LIBRARY = "libopenvino_intel_npu_compiler_loader.so"


class CompileError(Exception):
    """The model or spec cannot be compiled: the job fails with this message, no retry."""

    output: str = ""
    """What the compiler printed before it failed, when it ran in a child (`farm.sandbox`)."""


class ModelError(CompileError):
    """The model files cannot be read, or the spec does not fit the model."""


class CompilerUnavailable(RuntimeError):
    """This host cannot compile for the target (compiler library or device missing).

    Not the model's fault: the job belongs on a host that can compile for the target.
    """

    output: str = ""
    """What the compiler printed before it gave up, when it ran in a child (`farm.sandbox`)."""


@dataclass(frozen=True)
class CompileResult:
    blob_path: Path
    payload_offset: int
    size_bytes: int
    toolchain: Toolchain
    compile_seconds: float
    """Wall time of `compile_model`, minus the time OpenVINO spent writing the blob."""
    export_seconds: float
    """Wall time from the blob file's first appearance to the end of the write."""
    peak_rss_bytes: int
    """Peak resident memory of this process during the compile (VmHWM, reset before)."""
    properties: dict[str, str]


def openvino_release() -> str:
    """``2026.4.1`` from the full build string ``2026.4.1-22982-e213a147257-releases/2026/4``."""
    return ov.get_version().split("-", 1)[0]


def read_model(core: ov.Core, files: Mapping[str, Path]) -> ov.Model:
    name = files.get("xml") or files.get("onnx")
    if "xml" in files:
        _refuse_dtd(files["xml"])
    try:
        if "onnx" in files:
            # The ONNX frontend only: read_model would try every frontend on a bad file, and
            # the TensorFlow one prints its parse errors straight to the process's stderr.
            frontend = ov.frontend.FrontEndManager().load_by_framework("onnx")
            model = frontend.convert(frontend.load(str(files["onnx"])))
        else:
            model = core.read_model(str(files["xml"]), str(files["bin"]))
    except Exception as error:  # OpenVINO raises RuntimeError for every parse failure
        raise ModelError(f"cannot read model {name}: {_last_line(error)}") from error
    try:
        for port in [*model.inputs, *model.outputs]:
            port.get_names()
    except UnicodeDecodeError:
        raise ModelError(
            f"cannot read model {name}: its input or output names are not UTF-8"
        ) from None
    if not model.outputs:
        # The ONNX frontend turns an empty file into an empty model, which compiles.
        raise ModelError(f"cannot read model {name}: it has no outputs (empty or not a model?)")
    return model


def _refuse_dtd(xml: Path) -> None:
    """OpenVINO IR never declares a DTD. OpenVINO's parser (pugixml) does not expand entities,
    but refusing DTDs keeps entity tricks (XXE, billion laughs) out of every tool that may read
    a stored model later."""
    overlap = b""
    with open(xml, "rb") as stream:
        while chunk := stream.read(1 << 20):
            window = overlap + chunk
            if b"<!DOCTYPE" in window or b"<!ENTITY" in window:
                raise ModelError(
                    f"cannot read model {xml}: it declares a DTD (<!DOCTYPE or <!ENTITY); "
                    "OpenVINO IR has none, and farm refuses XML entities"
                )
            overlap = chunk[-8:]


def check_input_sizes(model: ov.Model) -> None:
    """Refuse inputs with a zero dimension (nothing to compute) or absurdly many elements (no
    buffer could hold them): the compiler would fail late, or try to allocate exabytes."""
    for port in model.inputs:
        shape = port.get_partial_shape()
        if shape.rank.is_dynamic:
            continue
        dims = [dim.get_length() for dim in shape if dim.is_static]
        label = f"{port.get_any_name()}{shape}"
        if 0 in dims:
            raise ModelError(f"input {label} has a zero dimension; give its shape with --shape")
        elements = 1
        for dim in dims:
            elements *= dim
        if elements > MAX_ELEMENTS:
            raise ModelError(
                f"input {label} has {elements} elements, more than {MAX_ELEMENTS}; "
                "give a smaller shape with --shape"
            )


def apply_shapes(model: ov.Model, spec: CompileSpec) -> None:
    """Reshape to `spec.shapes`, or set the batch on the axis the layout names."""
    if spec.shapes:
        new_shapes = {
            _input_port(model, name, "--shape"): ov.PartialShape(list(dims))
            for name, dims in spec.shapes.items()
        }
        try:
            model.reshape(new_shapes)
        except Exception as error:
            raise ModelError(f"cannot reshape the model: {_last_line(error)}") from error
    if spec.batch is not None:
        for name, text in spec.layout.items():
            ov.layout_helpers.set_layout(_input_port(model, name, "--layout"), ov.Layout(text))
        if not any(
            ov.layout_helpers.has_batch(ov.layout_helpers.get_layout(port)) for port in model.inputs
        ):
            names = ", ".join(port.get_any_name() for port in model.inputs)
            raise ModelError(
                f"the model does not say which axis is the batch; give --layout NAME:LAYOUT "
                f"(for example --layout {model.inputs[0].get_any_name()}:NCHW); inputs: {names}"
            )
        try:
            ov.set_batch(model, spec.batch)
        except Exception as error:
            raise ModelError(f"cannot set batch {spec.batch}: {_last_line(error)}") from error


def check_static(model: ov.Model, target: Target) -> None:
    """NPU compiles static shapes only: name every dynamic input dimension and the fix."""
    dynamic = []
    for port in model.inputs:
        shape = port.get_partial_shape()
        if shape.rank.is_dynamic:
            dynamic.append(f"{port.get_any_name()} (rank unknown)")
            continue
        axes = [str(i) for i, dim in enumerate(shape) if dim.is_dynamic]
        if axes:
            dynamic.append(f"{port.get_any_name()}{shape} (dimension {', '.join(axes)})")
    if dynamic:
        example = model.inputs[0].get_any_name()
        raise ModelError(
            f"{target} needs static shapes, but these inputs are dynamic: {'; '.join(dynamic)}. "
            f"Give the shapes with --shape NAME[d1,d2,...], for example --shape {example}[1,...]"
        )


def compile_properties(spec: CompileSpec) -> dict[str, str]:
    """OpenVINO properties for `spec`, as strings (they are logged and stored with the job)."""
    target = spec.target
    props: dict[str, str] = {}
    if target.is_npu:
        props["NPU_PLATFORM"] = target.platform
        # Without a device the plugin cannot learn the tile count; it needs the platform's.
        props["NPU_MAX_TILES"] = str(target.max_tiles)
        if spec.tiles is not None:
            props["NPU_TILES"] = str(spec.tiles)
        if spec.compiler_params:
            props["NPU_COMPILATION_MODE_PARAMS"] = spec.canonical()["compiler_params"]
        if spec.batch is not None:
            # The model is reshaped to this batch: compile it at that batch, rather than let
            # AUTO decide by what the host's driver supports (--config NPU_BATCH_MODE wins).
            props["NPU_BATCH_MODE"] = "COMPILER"
    if spec.performance_hint:
        props["PERFORMANCE_HINT"] = spec.performance_hint
    if spec.weightless:
        # ENABLE_WEIGHTLESS alone does nothing on export; OPTIMIZE_SIZE drops the weights.
        props["CACHE_MODE"] = "OPTIMIZE_SIZE"
    props.update(spec.config)
    return props


def compile_to_file(
    files: Mapping[str, Path], spec: CompileSpec, out_dir: Path, blob_id: str
) -> CompileResult:
    """Compile the model for `spec` and let OpenVINO write ``out_dir/<blob_id>.blob``.

    `out_dir` must not already hold that file: OpenVINO would load it instead of compiling.
    """
    blob_path = Path(out_dir) / f"{blob_id}.blob"
    if blob_path.exists():
        raise FileExistsError(f"{blob_path} exists; compile into an empty folder")
    core = ov.Core()
    model = read_model(core, files)
    apply_shapes(model, spec)
    check_input_sizes(model)
    if spec.target.is_npu:
        check_static(model, spec.target)
    props = compile_properties(spec)
    run_props = {**props, "CACHE_DIR": str(out_dir), "CACHE_BLOB_ID": blob_id}

    _reset_peak_rss()
    watcher = _FileWatcher(blob_path)
    started = time.perf_counter()
    try:
        with watcher:
            compiled = core.compile_model(model, _device(spec.target), run_props)
    except Exception as error:
        raise _compile_failure(spec.target, error) from error
    total = time.perf_counter() - started
    peak = _peak_rss_bytes()
    if not blob_path.is_file():
        raise CompileError(f"OpenVINO compiled but wrote no blob to {blob_path}")
    export_seconds = max(0.0, watcher.finished - watcher.appeared) if watcher.appeared else 0.0
    return CompileResult(
        blob_path=blob_path,
        payload_offset=read_header(blob_path).payload_offset,
        size_bytes=blob_path.stat().st_size,
        toolchain=toolchain_of(compiled, spec.target),
        compile_seconds=total - export_seconds,
        export_seconds=export_seconds,
        peak_rss_bytes=peak,
        properties=props,
    )


def toolchain_of(compiled: ov.CompiledModel, target: Target) -> Toolchain:
    """The toolchain facts of a compiled model, read back from OpenVINO."""
    npu_compiler = None
    runtime_requirements = None
    if target.is_npu:
        npu_compiler = str(_property_or_none(compiled, "NPU_COMPILER_VERSION"))
    else:
        runtime_requirements = str(compiled.get_property("RUNTIME_REQUIREMENTS"))
    return Toolchain(
        openvino=openvino_release(),
        openvino_build=ov.get_version(),
        npu_compiler=npu_compiler,
        runtime_requirements=runtime_requirements,
    )


@cache
def host_toolchain(target: Target) -> Toolchain:
    """The toolchain this host would record for `target`, without compiling the user's model.

    For CPU this compiles a one-op model to learn the RUNTIME_REQUIREMENTS string (the
    COMPATIBILITY_CHECK property raises TypeError in the 2026.4 Python binding).
    """
    if target.is_npu:
        return Toolchain(openvino=openvino_release(), openvino_build=ov.get_version())
    compiled = ov.Core().compile_model(_tiny_model(), "CPU")
    return toolchain_of(compiled, target)


def check_model(files: Mapping[str, Path], spec: CompileSpec) -> list[str]:
    """Read the model and fit it to `spec` without compiling; returns its inputs as text.

    Bad input (unreadable model, truncated weights, a shape for a missing input, a dynamic model
    for NPU) fails here, on the submitter's machine, before anything is uploaded or stored.
    """
    model = read_model(ov.Core(), files)
    apply_shapes(model, spec)
    check_input_sizes(model)
    if spec.target.is_npu:
        check_static(model, spec.target)
    return [f"{port.get_any_name()}{port.get_partial_shape()}" for port in model.inputs]


@cache
def unavailable_reason(target: Target) -> str | None:
    """None if this host compiles for `target`, else why not (a tiny model, the real compiler)."""
    props = compile_properties(CompileSpec.create(target))
    try:
        ov.Core().compile_model(_tiny_model(), _device(target), props)
    except Exception as error:
        return str(_compile_failure(target, error))
    return None


def probe_targets() -> dict[str, str | None]:
    """Which targets this host can compile: target name → None if it can, else the reason."""
    return {name: unavailable_reason(Target.parse(name)) for name in KNOWN_TARGETS}


def _device(target: Target) -> str:
    # NPU_PLATFORM selects the platform; the device name stays "NPU" so no device is required.
    return target.device


def _compile_failure(target: Target, error: Exception) -> CompileError | CompilerUnavailable:
    """Classify an OpenVINO compile exception: the host's fault or the model's."""
    text = str(error)
    if target.is_npu:
        if NPU_COMPILER_LIBRARY in text or "compiler loading failed" in text.lower():
            library = re.search(r'Cannot load library "([^"]+)"', text)
            where = os.path.normpath(library.group(1)) if library else NPU_COMPILER_LIBRARY
            return CompilerUnavailable(
                f"cannot compile for {target}: the NPU compiler library {NPU_COMPILER_LIBRARY} "
                f"is missing (looked for {where}). Install the NPU compiler next to OpenVINO, "
                f"or run this job on a host that has it."
            )
        if "Could not find an NPU device" in text:
            return CompilerUnavailable(
                f"cannot compile for {target}: no NPU device, which the driver compiler "
                f"(NPU_COMPILER_TYPE=DRIVER) requires. Use the plugin compiler "
                f"(NPU_COMPILER_TYPE=PLUGIN, library {NPU_COMPILER_LIBRARY}) on this host."
            )
    return CompileError(f"OpenVINO failed to compile for {target}: {_last_line(error)}")


def _input_port(model: ov.Model, name: str, flag: str) -> ov.Output:
    inputs = model.inputs
    names = ", ".join(port.get_any_name() for port in inputs)
    if name == SINGLE_INPUT:
        if len(inputs) != 1:
            raise ModelError(
                f"the model has {len(inputs)} inputs ({names}); name the input in {flag}"
            )
        return inputs[0]
    for port in inputs:
        if name in port.get_names():
            return port
    raise ModelError(f"the model has no input {name!r} ({flag}); its inputs are: {names}")


def _tiny_model() -> ov.Model:
    data = ops.parameter([1, 8], ov.Type.f32, name="x")
    weights = ops.constant(np.ones((8, 8), dtype=np.float32))
    return ov.Model([ops.relu(ops.matmul(data, weights, False, False))], [data], "farm_probe")


def _property_or_none(compiled: ov.CompiledModel, name: str) -> object | None:
    try:
        return compiled.get_property(name)
    except Exception:
        return None


def _last_line(error: Exception) -> str:
    """OpenVINO errors carry a C++ stack of 'Exception from ...' lines; keep the message."""
    lines = [
        line.strip()
        for line in str(error).splitlines()
        if line.strip() and not line.startswith("Exception from")
    ]
    message = " ".join(lines) or type(error).__name__
    return re.sub(r"Check '.*?' failed at \S+:\d+:\s*", "", message)


def _reset_peak_rss() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")  # resets VmHWM, the peak resident set (Linux >= 4.0)
    except OSError:
        pass


def _peak_rss_bytes() -> int:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class _FileWatcher:
    """Notes when a file first appears, to split OpenVINO's compile from its blob write."""

    POLL_SECONDS = 0.005

    def __init__(self, path: Path) -> None:
        self.path = path
        self.appeared: float | None = None
        self.finished = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> _FileWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.finished = time.perf_counter()
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stop.is_set():
            if self.path.exists():
                self.appeared = time.perf_counter()
                return
            self._stop.wait(self.POLL_SECONDS)
