"""Read a model and fit it to a compile spec: shapes, batch, static-shape and size checks.

The same steps run on a worker before it compiles, on a submitter before it uploads anything
(`check_model`: bad input fails on the submitter's machine) and on an edge that compiles for
itself. Raises `ModelError` with a message that says what to pass instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import openvino as ov

from farm.core.errors import ModelError
from farm.core.spec import MAX_ELEMENTS, SINGLE_INPUT, CompileSpec, Target
from farm.toolchain import last_line


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
        raise ModelError(f"cannot read model {name}: {last_line(error)}") from error
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
    try:
        stream = open(xml, "rb")  # noqa: SIM115 (closed below)
    except OSError as error:  # not a model error of the file's own, but the job's all the same
        raise ModelError(f"cannot read model {xml}: {error.strerror}") from error
    with stream:
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
            raise ModelError(f"cannot reshape the model: {last_line(error)}") from error
    if spec.batch is not None:
        for name, text in spec.layout.items():
            port = _input_port(model, name, "--layout")
            try:
                ov.layout_helpers.set_layout(port, ov.Layout(text))
            except Exception as error:  # RuntimeError: the layout does not fit the input
                raise ModelError(
                    f"--layout {text} does not fit input {port.get_any_name()}"
                    f"{port.get_partial_shape()}: {last_line(error)}"
                ) from error
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
            raise ModelError(f"cannot set batch {spec.batch}: {last_line(error)}") from error


def check_static(model: ov.Model, target: Target) -> None:
    """NPU compiles static shapes only: name every dynamic input dimension and the fix."""
    dynamic, examples = [], []
    for port in model.inputs:
        shape, name = port.get_partial_shape(), port.get_any_name()
        if shape.rank.is_dynamic:
            dynamic.append(f"{name} (rank unknown)")
            examples.append(f"{name}[1,...]")
            continue
        axes = [str(i) for i, dim in enumerate(shape) if dim.is_dynamic]
        if axes:
            dynamic.append(f"{name}{shape} (dimension {', '.join(axes)})")
            dims = (str(dim.get_length()) if dim.is_static else "1" for dim in shape)
            examples.append(f"{name}[{','.join(dims)}]")
    if dynamic:
        # The example is a dynamic input's, its static dimensions kept (not the first input's,
        # which may be static): a partly dynamic model's hint names the input to fix.
        raise ModelError(
            f"{target} needs static shapes, but these inputs are dynamic: {'; '.join(dynamic)}. "
            f"Give the shapes with --shape NAME[d1,d2,...], for example --shape {examples[0]}"
        )


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
