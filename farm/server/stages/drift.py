"""The drift step of a `compress` or `quantize` stage, child side (issue 27 item 4): the
compressed model's outputs against the uncompressed model's on the same inputs.

Its own sandboxed child, run by the stage phase after the compression's child has ended
(docs/architecture.md §15), so each child's peak memory is its own: NNCF's in the compression's,
the two CPU compiles' here. No NNCF is imported: OpenVINO alone. The request's files: the
uncompressed IR (``xml``, ``bin``), the compressed one (``compressed/xml``, ``compressed/bin``)
and a quantize stage's calibration files (``calibration/...``, also drift inputs); its args:
the stage's, its options ``stage_kind`` (the seed of the drift inputs is the stage's kind and
args, as when both ran in one child).
"""

from __future__ import annotations

import resource
from dataclasses import replace
from pathlib import Path
from typing import Any

from farm.core.compression import QUANTIZE
from farm.server.stages.child import StageOutcome, StageRequest

KIND = "drift"
"""The sandbox stage op's kind for this step (farm.server.stages.child.MODULES)."""
COMPRESSED = "compressed/"
"""Role prefix of the compressed IR's files (``compressed/xml``, ``compressed/bin``)."""


def prepare(
    args: dict[str, Any], *, switching_user: bool = False, files: dict[str, Path] | None = None
) -> None:
    """Import OpenVINO as the worker's user (the compile user may not read it). When
    switching user, one tiny model of farm's own (never the user's files) is compiled and run
    on CPU, and inputs seeded, so the CPU plugin and numpy's random modules are loaded now."""
    import openvino  # noqa: F401

    if switching_user:
        _warm_up()


def _warm_up() -> None:
    import numpy as np
    import openvino as ov
    from openvino import opset13 as ops

    from farm.core.reference import InputSpec, seeded_inputs
    from farm.server.stages import compress

    x = ops.parameter([1, 4], ov.Type.f32, name="x")
    weights = ops.constant(np.full((4, 4), 0.25, np.float32))
    model = ov.Model([ops.matmul(x, weights, False, True)], [x])
    sample = seeded_inputs("warm-up", [InputSpec("x", (1, 4), "float32")])
    compress.drift(*[compress._outputs(ov.Core(), model, [sample])] * 2)


def run(request: StageRequest) -> StageOutcome:
    """Measure the drift; metrics `drift` (or None and `drift_note`), `drift_seconds`."""
    from farm.server.stages import compress

    kind = str(request.options.get("stage_kind") or "")
    samples = []
    if kind == QUANTIZE:
        samples = compress.calibration_samples(replace(request, kind=kind))
    limit, _ = resource.getrlimit(resource.RLIMIT_AS)  # the sandbox's memory limit, if any
    metrics = compress.measure_drift(
        request.files["xml"],
        request.files[f"{COMPRESSED}xml"],
        calibration=samples,
        seed=compress.drift_seed(kind, request.args),
        memory_bytes=None if limit == resource.RLIM_INFINITY else limit,
    )
    return StageOutcome({}, metrics)
