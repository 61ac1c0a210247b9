"""Hostile and broken model files, built from the OpenVINO API, the onnx package or raw bytes.

Each builder writes its file(s) under a folder and returns the path to submit (`.xml` or
`.onnx`). The secrets the hostile ones try to reach are named here so a test can check that
nothing of them leaks into an error message, a log or a blob.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import numpy as np

from tests import models

SECRET_FILE = Path("/etc/passwd")
SECRET_SIGN = "root:"
"""What any readable /etc/passwd holds; it must appear in no error, log or blob."""


def _ir(folder: Path, name: str = "m") -> Path:
    return models.save_ir(models.conv_net(), folder / f"{name}.xml")


def _edit_xml(folder: Path, edit: Callable[[str], str]) -> Path:
    xml = _ir(folder)
    xml.write_text(edit(xml.read_text()))
    return xml


def _first_const(text: str, attributes: str) -> str:
    """Replace the first Const layer's offset/size attributes."""
    return re.sub(r'offset="\d+" size="\d+"', attributes, text, count=1)


def xml_mismatched_tags(folder: Path) -> Path:
    """Well-formed until the end: the closing tags do not match the opening ones."""
    return _edit_xml(folder, lambda text: text.replace("</layers>", "</layer>", 1))


def xml_xxe_file(folder: Path) -> Path:
    """An external entity reading a local file, used in a layer name (classic XXE)."""
    doctype = f'<!DOCTYPE net [<!ENTITY xxe SYSTEM "file://{SECRET_FILE}">]>\n'
    return _edit_xml(
        folder,
        lambda text: (
            text.replace('<?xml version="1.0"?>\n', '<?xml version="1.0"?>\n' + doctype)
            .replace('name="x" type="Parameter"', 'name="&xxe;" type="Parameter"')
            .replace('names="x"', 'names="&xxe;"')
        ),
    )


def xml_xxe_parameter_entity(folder: Path) -> Path:
    """An external DTD fetched over the network (a closed local port) via a parameter entity."""
    doctype = (
        '<!DOCTYPE net [<!ENTITY % remote SYSTEM "http://127.0.0.1:9/evil.dtd"> %remote;'
        f'<!ENTITY leak SYSTEM "file://{SECRET_FILE}">]>\n'
    )
    return _edit_xml(
        folder,
        lambda text: text.replace(
            '<?xml version="1.0"?>\n', '<?xml version="1.0"?>\n' + doctype
        ).replace('<net name="conv_net"', '<net name="&leak;"'),
    )


def xml_billion_laughs(folder: Path) -> Path:
    """Nested entities that expand to 10^9 copies of a string if a parser expands them."""
    entities = ['<!ENTITY lol0 "lol">'] + [
        f'<!ENTITY lol{i} "{f"&lol{i - 1};" * 10}">' for i in range(1, 10)
    ]
    doctype = "<!DOCTYPE net [" + "".join(entities) + "]>\n"
    return _edit_xml(
        folder,
        lambda text: text.replace(
            '<?xml version="1.0"?>\n', '<?xml version="1.0"?>\n' + doctype
        ).replace('<net name="conv_net"', '<net name="&lol9;"'),
    )


def xml_zero_bytes(folder: Path) -> Path:
    xml = _ir(folder)
    xml.write_bytes(b"")
    return xml


def bin_zero_bytes(folder: Path) -> Path:
    xml = _ir(folder)
    xml.with_suffix(".bin").write_bytes(b"")
    return xml


def bin_one_byte_short(folder: Path) -> Path:
    """The weights file one byte shorter than the last constant needs."""
    xml = _ir(folder)
    weights = xml.with_suffix(".bin")
    weights.write_bytes(weights.read_bytes()[:-1])
    return xml


def offset_past_bin(folder: Path) -> Path:
    """A constant whose offset lies past the end of the .bin."""
    return _edit_xml(folder, lambda text: _first_const(text, 'offset="1000000" size="1728"'))


def offset_size_overflow(folder: Path) -> Path:
    """offset + size wraps around 2^64 to a small number: an unchecked sum would pass."""
    return _edit_xml(folder, lambda text: _first_const(text, f'offset="{2**64 - 64}" size="1728"'))


def offset_negative(folder: Path) -> Path:
    return _edit_xml(folder, lambda text: _first_const(text, 'offset="-1728" size="1728"'))


def _parameter_shape(folder: Path, dims: list[str]) -> Path:
    def edit(text: str) -> str:
        text = text.replace('shape="1,3,32,32"', f'shape="{",".join(dims)}"', 1)
        port = "".join(f"\n\t\t\t\t\t<dim>{d}</dim>" for d in dims)
        return re.sub(
            r'(names="x">)(\s*<dim>\d+</dim>){4}', lambda m: m.group(1) + port, text, count=1
        )

    return _edit_xml(folder, edit)


def shape_negative_in_xml(folder: Path) -> Path:
    return _parameter_shape(folder, ["-5", "3", "32", "32"])


def shape_huge_in_xml(folder: Path) -> Path:
    """An input of 2^62 elements: any buffer for it would be exabytes."""
    return _parameter_shape(folder, ["1", "3", str(2**30), str(2**30)])


def onnx_zero_bytes(folder: Path) -> Path:
    path = folder / "m.onnx"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")
    return path


def _onnx_matmul(folder: Path, initializer) -> Path:
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        [initializer],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    path = folder / "m.onnx"
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(model, str(path))
    return path


def onnx_truncated(folder: Path) -> Path:
    """A valid ONNX model cut short: the protobuf's declared lengths run past the end."""
    from onnx import numpy_helper

    path = _onnx_matmul(folder, numpy_helper.from_array(np.eye(4, dtype=np.float32), "w"))
    path.write_bytes(path.read_bytes()[:-20])
    return path


def _onnx_external(folder: Path, location: str, length: int) -> Path:
    from onnx import TensorProto

    tensor = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[4, 4])
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", "0"), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    return _onnx_matmul(folder, tensor)


def onnx_external_data_absolute(folder: Path) -> Path:
    """Weights 'stored' in /etc/passwd: a compile would bake the file into the blob."""
    return _onnx_external(folder, str(SECRET_FILE), 64)


def onnx_external_data_traversal(folder: Path) -> Path:
    """Weights in ../../../../../../etc/passwd, relative to wherever the model lands."""
    return _onnx_external(folder, "../" * 12 + str(SECRET_FILE).lstrip("/"), 64)


def input_name_not_utf8(folder: Path) -> Path:
    """The model's input is named with bytes that are not UTF-8."""
    xml = _ir(folder)
    xml.write_bytes(xml.read_bytes().replace(b'names="x"', b'names="\xff\xfex"', 1))
    return xml


def shape_zero_in_xml(folder: Path) -> Path:
    return _parameter_shape(folder, ["0", "3", "32", "32"])


def bin_oversized(folder: Path, extra_bytes: int) -> Path:
    """A valid model whose .bin carries `extra_bytes` of junk after the weights (OpenVINO reads
    it): only a size limit stops it."""
    xml = _ir(folder)
    with open(xml.with_suffix(".bin"), "ab") as weights:
        weights.write(b"\xa5" * extra_bytes)
    return xml


TERMINAL_ESCAPES = "\x1b]0;pwned\x07\x1b]52;c;cHduZWQ=\x07\x1b[2J\x1b[3J\x9b2J"
"""A window title (OSC 0), a clipboard write (OSC 52) and screen clears (ESC [ and C1 CSI)."""


def op_type_terminal_escapes(folder: Path) -> Path:
    """An IR whose op type holds terminal escapes (`TERMINAL_ESCAPES`): OpenVINO refuses the
    op and quotes its type in the error, which reaches job errors, logs and messages."""
    return _edit_xml(
        folder, lambda text: text.replace('type="ReLU"', f'type="ReLU{TERMINAL_ESCAPES}"', 1)
    )


MODEL_FILES: dict[str, Callable[[Path], Path]] = {
    "xml-mismatched-tags": xml_mismatched_tags,
    "xml-xxe-file": xml_xxe_file,
    "xml-xxe-parameter-entity": xml_xxe_parameter_entity,
    "xml-billion-laughs": xml_billion_laughs,
    "xml-zero-bytes": xml_zero_bytes,
    "bin-zero-bytes": bin_zero_bytes,
    "bin-one-byte-short": bin_one_byte_short,
    "offset-past-bin": offset_past_bin,
    "offset-size-overflow": offset_size_overflow,
    "offset-negative": offset_negative,
    "shape-negative-in-xml": shape_negative_in_xml,
    "shape-huge-in-xml": shape_huge_in_xml,
    "onnx-zero-bytes": onnx_zero_bytes,
    "onnx-truncated": onnx_truncated,
    "onnx-external-data-absolute": onnx_external_data_absolute,
    "onnx-external-data-traversal": onnx_external_data_traversal,
    "input-name-not-utf8": input_name_not_utf8,
    "shape-zero-in-xml": shape_zero_in_xml,
}
"""Every hostile model file by case id."""
