"""Reference outputs of a converted Hugging Face folder come from transformers itself (docs §15):
`farm verify` then proves the conversion and the compile together. A tiny BERT made from a
small config with random weights (tests/make_sources.py), nothing downloaded; the frameworks
run in subprocesses (the farm's own children, and the scripts below), never in this process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from farm.core.reference import Reference, compare
from farm.core.tolerance import Tolerance
from tests.integration.conftest import settled_reference
from tests.integration.test_sources import ROOT, SOURCES, frameworks, make_source  # noqa: F401

pytestmark = pytest.mark.slow
SHAPES = SOURCES["huggingface"][2]

TRANSFORMERS_RUN = """
import sys, numpy as np, torch
from transformers import AutoModelForSequenceClassification
from farm.core.reference import Reference
reference = Reference.load(sys.argv[2])
model = AutoModelForSequenceClassification.from_pretrained(sys.argv[1], local_files_only=True)
with torch.no_grad():
    logits = model.eval()(**{k: torch.from_numpy(v) for k, v in reference.inputs.items()}).logits
np.save(sys.argv[3], logits.numpy())
"""
"""Runs the folder in transformers on a reference's inputs (the test's own account)."""

PERTURB = """
import sys
from safetensors.numpy import load_file, save_file
weights = load_file(sys.argv[1])
weights["classifier.bias"] = weights["classifier.bias"] + 0.5
save_file(weights, sys.argv[1], metadata={"format": "pt"})
"""
"""The same architecture with other weights: a conversion that went wrong, as verify sees it."""


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


def python(*args: str) -> None:
    done = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, cwd=ROOT, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(scope="module")
def converted(frameworks, tmp_path_factory) -> dict:  # noqa: F811
    """A tiny BERT submitted to an embedded farm: converted, compiled for CPU, referenced."""
    folder = tmp_path_factory.mktemp("hf")
    bert = make_source("hf", folder / "bert")
    home = folder / "farm-home"
    submitted = farm(home, "submit", str(bert), "-d", "CPU", *SHAPES, "--wait")
    assert submitted["job"]["state"] == "succeeded", submitted
    return {"bert": bert, "home": home, "cache_key": submitted["cache_key"], "folder": folder}


def test_a_hugging_face_blob_is_verified_against_transformers_outputs(converted, tmp_path):
    home, key = converted["home"], converted["cache_key"]
    assert (
        settled_reference(lambda: farm(home, "status", key)["blob"]["reference_state"]) == "ready"
    )
    references = list((home / "store" / "references" / key).glob("*.npz"))
    assert len(references) == 1
    reference = Reference.load(references[0])
    assert sorted(reference.inputs) == ["attention_mask", "input_ids", "token_type_ids"]
    assert list(reference.outputs) == ["logits"]

    # The reference outputs are transformers' own numbers on the reference inputs, bit for bit
    # (the converted IR's CPU run differs from them in the last digits).
    python("-c", TRANSFORMERS_RUN, str(converted["bert"]), str(references[0]), str(tmp_path / "t"))
    torch_logits = np.load(tmp_path / "t.npy")
    assert np.array_equal(reference.outputs["logits"], torch_logits)

    verified = farm(home, "verify", str(converted["bert"]), "-d", "CPU", *SHAPES)
    assert verified["passed"] and verified["outcome"] == "passed", verified
    assert isinstance(verified["max_abs_error"], float)
    assert 0 <= verified["max_abs_error"] <= 0.01, verified
    assert verified["outputs"][0]["name"] == "logits"


def test_a_reference_from_other_weights_fails_where_the_right_one_passes(converted, tmp_path):
    """The reference child on the converted IR, with its source and with a source whose weights
    differ (what a conversion gone wrong looks like): only the first passes the comparison."""
    import shutil

    import openvino as ov

    from farm.core import sources
    from farm.core.spec import CompileSpec
    from farm.server.jobs.sandbox import reference_in_child

    ir = farm(converted["home"], "pull", str(converted["bert"]), "--ir", str(tmp_path / "ir"))
    files = {role: Path(path) for role, path in ir["files"].items()}
    other = tmp_path / "other"
    shutil.copytree(converted["bert"], other)
    python("-c", PERTURB, str(other / "model.safetensors"))

    spec = CompileSpec.create("CPU", shapes=[s.removeprefix("--shape=") for s in SHAPES])
    outcomes = {}
    for name, folder in (("right", converted["bert"]), ("wrong", other)):
        path, note = reference_in_child(
            files,
            spec,
            tmp_path / name,
            converted["cache_key"],
            timeout_seconds=300,
            source=("huggingface", sources.detect(folder).files),
        )
        assert path is not None, note
        reference = Reference.load(path)
        model = ov.Core().read_model(files["xml"])
        model.reshape({n: ov.PartialShape(list(a.shape)) for n, a in reference.inputs.items()})
        compiled = ov.Core().compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
        actual = compiled.create_infer_request().infer(reference.inputs)
        got = {"logits": np.array(actual[compiled.outputs[0]])}
        outcomes[name] = compare(reference.outputs, got, Tolerance(0.04, 0.08, 0.996))[0]
    assert outcomes["right"].passed and outcomes["right"].max_abs_error < 1e-3
    assert not outcomes["wrong"].passed
    assert outcomes["wrong"].max_abs_error > 0.4  # the bias moved by 0.5
