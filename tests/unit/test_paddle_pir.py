"""Paddle 3 programs (.json, PIR) convert with paddle2onnx: their convert stage says so
(``program: pir``), which routes them to workers with the `paddle` converter (docs §15)."""

from __future__ import annotations

import pytest

from farm.core import sources, stages
from farm.core.errors import SpecError


def paddle_pair(folder, suffix: str):
    model = folder / f"model{suffix}"
    model.write_text("{}")
    (folder / "model.pdiparams").write_bytes(b"w")
    return sources.detect(model)


def test_a_paddle3_program_needs_the_paddle_converter_and_a_pdmodel_none(tmp_path):
    (pir,) = stages.recipe_for(paddle_pair(tmp_path, ".json"))
    assert pir.args == {"format": "paddle", "program": "pir"}
    assert pir.needs == "paddle"
    assert stages.CONVERTERS["paddle"].extra == "convert"
    assert set(stages.CONVERTERS["paddle"].modules) == {"paddle2onnx", "paddlepaddle"}
    other = tmp_path / "old"
    other.mkdir()
    (legacy,) = stages.recipe_for(paddle_pair(other, ".pdmodel"))
    assert legacy.args == {"format": "paddle"}
    assert legacy.needs is None
    assert stages.stage_key({"model": {}}, pir) != stages.stage_key({"model": {}}, legacy)


def test_program_is_refused_where_it_does_not_belong():
    with pytest.raises(SpecError, match="program 'pir' is for Paddle 3"):
        stages.Stage.create("convert", {"format": "tflite", "program": "pir"})
    with pytest.raises(SpecError, match="program 'old' is for Paddle 3"):
        stages.Stage.create("convert", {"format": "paddle", "program": "old"})


def test_the_api_checks_the_program_against_the_files():
    pir = {"json": "a" * 64, "pdiparams": "b" * 64}
    legacy = {"pdmodel": "a" * 64, "pdiparams": "b" * 64}
    with_program = [{"stage": "convert", "args": {"format": "paddle", "program": "pir"}}]
    without = [{"stage": "convert", "args": {"format": "paddle"}}]
    assert stages.source_recipe(pir, with_program)[0].needs == "paddle"
    assert stages.source_recipe(legacy, without)[0].needs is None
    for identity, recipe in ((pir, without), (legacy, with_program)):
        with pytest.raises(SpecError, match="converts with program pir"):
            stages.source_recipe(identity, recipe)


def test_golden_stage_key_of_a_paddle3_program():
    """Pinned: the edge computes this key offline; a change here changes every such blob's key.
    sha256 of canonical JSON {"args": {"format": "paddle", "program": "pir"}, "input":
    {"model": {"json": "a"*64, "pdiparams": "b"*64}}, "stage": "convert", "v": 1}."""
    stage = stages.convert_stage("paddle", program="pir")
    identity = {"json": "a" * 64, "pdiparams": "b" * 64}
    assert stages.stage_keys(identity, [stage]) == [
        "be7b64817e15504b64e29a01cccd83b548eca7966b6aefccf030daac2a35e0fa"
    ]
