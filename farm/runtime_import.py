"""OpenVINO's runtime without its model conversion API, in the farm's own processes.

`import openvino` (2026.4.1) also imports `openvino.tools.ovc`, the model conversion API behind
`ov.convert_model`, and with it OpenVINO's telemetry and a lookup of installed packages' metadata:
0.2 s of the 0.35 s the import takes here, paid by every process that loads OpenVINO
(docs/openvino.md, "Importing OpenVINO"). OpenVINO imports it under `except ImportError`, so a
process that never converts a model can leave it out: the `farm` command (conversions run in a
stage's child, never in it) and the compile and reference children (`farm.server.jobs.sandbox`).
A stage's child, a GenAI export and a user's own program import OpenVINO whole.
"""

from __future__ import annotations

import sys

CONVERSION_API = "openvino.tools.ovc"


def skip_conversion_api() -> None:
    """Have this process import OpenVINO without `openvino.tools.ovc` (so without
    `ov.convert_model`): before OpenVINO is first imported; nothing once it is."""
    if "openvino" not in sys.modules:
        sys.modules.setdefault(CONVERSION_API, None)  # type: ignore[arg-type]
