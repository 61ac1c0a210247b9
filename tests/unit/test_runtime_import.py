"""The farm's own processes import OpenVINO without its model conversion API
(`farm.runtime_import`): the `farm` command, and the compile and reference children; a child that
converts imports it whole."""

from __future__ import annotations

import subprocess
import sys

from farm.server.jobs.sandbox import converts


def _converter_loaded(imported: set[str]) -> bool:
    """Whether the conversion API was loaded (a module left out is still listed, by itself)."""
    return "openvino_telemetry" in imported or "openvino.tools.ovc.convert" in imported


def _imported(args: list[str]) -> set[str]:
    """The modules a fresh Python process imported (`-X importtime`), and that it succeeded."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = (line for line in done.stderr.splitlines() if line.startswith("import time:"))
    return {line.rsplit("|", 1)[-1].strip() for line in lines}


def test_openvino_compiles_and_imports_without_its_conversion_api():
    """Pins this OpenVINO release: it imports `openvino.tools.ovc` under `except ImportError`,
    so left out it costs nothing but `ov.convert_model`."""
    script = (
        "from farm.runtime_import import skip_conversion_api\n"
        "skip_conversion_api()\n"
        "import numpy as np, openvino as ov\n"
        "from openvino import opset13 as ops\n"
        "assert not hasattr(ov, 'convert_model')\n"
        "x = ops.parameter([1, 4], np.float32, name='x')\n"
        "model = ov.Model([ops.relu(x)], [x])\n"
        "blob = ov.Core().compile_model(model, 'CPU').export_model()\n"
        "imported = ov.Core().import_model(blob, 'CPU')\n"
        "assert (imported(np.array([[-1, 0, 1, 2]], np.float32))[0] == [[0, 0, 1, 2]]).all()\n"
    )
    imported = _imported(["-c", script])
    assert "openvino" in imported and not _converter_loaded(imported)


def test_the_farm_command_loads_openvino_without_it():
    imported = _imported(["-m", "farm", "toolchain", "--json"])  # probes this host's OpenVINO
    assert "openvino" in imported and "farm.toolchain" in imported
    assert not _converter_loaded(imported)


def test_a_program_importing_farm_keeps_openvino_whole():
    """Only the `farm` process leaves it out: a caller of the CLI (CliRunner, a script) or of
    the edge SDK keeps `ov.convert_model`."""
    script = (
        "from farm.cli import main\n"
        "main(['toolchain', '--json'], standalone_mode=False)\n"
        "import openvino as ov\n"
        "assert hasattr(ov, 'convert_model')\n"
    )
    assert _converter_loaded(_imported(["-c", script]))


def test_only_children_that_convert_import_it():
    assert not converts({"target": "CPU", "spec": "{}"})  # a compile
    assert not converts({"task": "reference"})  # the reference of an IR or ONNX model
    assert converts({"task": "reference", "source_format": "pt2"})  # from the framework
    assert converts({"task": "stage", "kind": "convert"})
    assert converts({"task": "stage", "kind": "drift"})
    assert converts({"task": "pipeline"})
