"""Paddle 3's own format, a PIR program (.json + .pdiparams), which OpenVINO 2026.4 does not
read: converted on the farm by the `paddle` converter (paddle2onnx into ONNX, then OpenVINO),
its reference outputs computed by Paddle's inference engine, verified (docs §15). The model is
written by paddle itself in a subprocess (tests/make_sources.py `paddle3`); nothing downloaded.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from farm.core.reference import Reference
from tests.conftest import service_missing
from tests.integration.conftest import settled_reference
from tests.integration.test_sources import ROOT, make_source

pytestmark = pytest.mark.slow

PADDLE_RUN = """
import sys, numpy as np, paddle.inference as inference
from farm.core.reference import Reference
reference = Reference.load(sys.argv[3])
config = inference.Config(sys.argv[1], sys.argv[2])
config.disable_gpu()
config.switch_ir_optim(False)
predictor = inference.create_predictor(config)
for name, array in reference.inputs.items():
    handle = predictor.get_input_handle(name)
    handle.reshape(list(array.shape))
    handle.copy_from_cpu(array)
predictor.run()
np.save(sys.argv[4], predictor.get_output_handle(predictor.get_output_names()[0]).copy_to_cpu())
"""
"""Paddle on the reference's inputs: the test's own account of what the source computes."""


def farm(home: Path, *args: str) -> dict:
    env = {**os.environ, "FARM_HOME": str(home)}
    result = subprocess.run(
        [sys.executable, "-m", "farm", *args, "--json"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def paddle3(tmp_path_factory) -> Path:
    missing = [m for m in ("paddle", "paddle2onnx") if importlib.util.find_spec(m) is None]
    if missing:
        service_missing("paddle and paddle2onnx", RuntimeError(f"{missing} (scripts/frameworks)"))
    return make_source("paddle3", tmp_path_factory.mktemp("paddle3") / "model")


def test_a_paddle3_program_converts_compiles_and_verifies_against_paddle(paddle3, tmp_path):
    from farm import converters

    assert paddle3.suffix == ".json"
    assert "paddle2onnx" in converters.probe()["paddle"]
    home = tmp_path / "farm-home"
    submitted = farm(home, "submit", str(paddle3), "-d", "CPU", "--wait")
    assert submitted["job"]["state"] == "succeeded", submitted
    key = submitted["cache_key"]

    ir = farm(home, "pull", str(paddle3), "--ir", str(tmp_path / "ir"))
    assert ir["tool_versions"]["paddle2onnx"].startswith("2.1")
    assert ir["tool_versions"]["paddlepaddle"].startswith("3.")

    # The reference outputs are Paddle's own, bit for bit, on the reference inputs.
    assert (
        settled_reference(lambda: farm(home, "status", key)["blob"]["reference_state"]) == "ready"
    )
    references = list((home / "store" / "references" / key).glob("*.npz"))
    assert len(references) == 1
    reference = Reference.load(references[0])
    assert list(reference.inputs) == ["x"]
    ran = subprocess.run(
        [
            sys.executable,
            "-c",
            PADDLE_RUN,
            str(paddle3),
            str(paddle3.with_suffix(".pdiparams")),
            str(references[0]),
            str(tmp_path / "paddle"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        check=False,
    )
    assert ran.returncode == 0, ran.stderr[-3000:]
    (output,) = reference.outputs.values()
    assert output.shape == (1, 5)
    assert np.array_equal(output, np.load(tmp_path / "paddle.npy"))

    verified = farm(home, "verify", str(paddle3), "-d", "CPU")
    assert verified["passed"], verified
    assert 0 <= verified["max_abs_error"] <= 0.01, verified
