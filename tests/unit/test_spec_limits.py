"""The limits and refusals of a compile spec, to the exact boundary and the exact words.

Each limit is tested on both sides (the largest value accepted, the next one refused), and each
refusal by its whole message: the message names what to change, so a message that drifts is a
user told the wrong thing. Wrong types (a string or a bool where an integer belongs) come in
through the API's JSON: they must be refused as a SpecError (HTTP 422), not crash as a
TypeError (HTTP 500)."""

from __future__ import annotations

import re
from typing import Any

import pytest

from farm.core.spec import (
    MAX_BATCH,
    MAX_DIM,
    MAX_ELEMENTS,
    CompileSpec,
    SpecError,
    Target,
    Toolchain,
)

NPU = "4000"


def refused(target: str = "CPU", **options: Any) -> str:
    with pytest.raises(SpecError) as raised:
        CompileSpec.create(target, **options)
    return str(raised.value)


# --- shapes ----------------------------------------------------------------------------------


def test_a_shape_may_have_eight_dimensions_not_nine():
    assert CompileSpec.create("CPU", shapes=["[1,1,1,1,1,1,1,1]"]).shapes == {"": (1,) * 8}
    assert refused(shapes=["[1,1,1,1,1,1,1,1,1]"]) == (
        "shape '[1,1,1,1,1,1,1,1,1]' must have 1 to 8 dimensions"
    )


def test_a_dimension_may_be_max_dim_not_more():
    assert CompileSpec.create("CPU", shapes=[f"[{MAX_DIM}]"]).shapes == {"": (MAX_DIM,)}
    assert refused(shapes=[f"[{MAX_DIM + 1}]"]) == (
        f"shape '[{MAX_DIM + 1}]': dimension {MAX_DIM + 1} must be from 1 to {MAX_DIM}"
    )


def test_a_text_shape_with_a_zero_dimension_is_refused_naming_the_shape():
    assert refused(shapes=["x[0,3]"]) == f"shape 'x[0,3]': dimension 0 must be from 1 to {MAX_DIM}"


def test_a_shape_may_have_max_elements_not_more():
    side = 2**20
    assert side * side == MAX_ELEMENTS
    assert CompileSpec.create("CPU", shapes=[f"[{side},{side}]"]).shapes == {"": (side, side)}
    assert refused(shapes=[f"[{side},{side + 1}]"]) == (
        f"shape '[{side},{side + 1}]' has {side * (side + 1)} elements, more than {MAX_ELEMENTS}"
    )


@pytest.mark.parametrize("dim", ["3", True, 2.0])
def test_a_json_dimension_that_is_not_an_integer_is_refused(dim):
    assert refused(shapes={"x": [1, dim]}) == (
        f"shape {'x' + str([1, dim])!r}: dimension {dim!r} must be from 1 to {MAX_DIM}"
    )


def test_a_dynamic_dimension_is_refused_saying_npu_blobs_need_static_shapes():
    assert refused(shapes=["[?,3]"]) == (
        "shape '[?,3]': dimension '?' must be a positive integer (NPU blobs need static shapes)"
    )


def test_two_different_shapes_for_one_input_are_refused_naming_it():
    assert refused(shapes=["[1,3]", "[1,4]"]) == "two different shapes for input (single input)"
    assert refused(shapes=["x[1,3]", "x[1,4]"]) == "two different shapes for input x"


def test_an_unnamed_shape_or_layout_goes_with_a_single_input_only():
    assert refused(shapes=["[1,3]", "x[1,3]"]) == (
        "a shape without an input name is only allowed for a single input"
    )
    assert refused(batch=1, layout=["NC", "x:NC"]) == (
        "a layout without an input name is only allowed for a single input"
    )


# --- input names -----------------------------------------------------------------------------


def test_an_input_name_may_have_256_characters_not_257():
    name = "x" * 256
    assert CompileSpec.create("CPU", shapes={name: [1]}).shapes == {name: (1,)}
    assert refused(shapes={name + "x": [1]}) == (
        f"input name {'x' * 40!r} is not a usable input name"
    )


@pytest.mark.parametrize("name", ["a\x00b", "tab\there", "\udcff"])
def test_an_input_name_with_a_control_character_or_a_lone_surrogate_is_refused(name):
    message = f"input name {name!r} is not a usable input name"
    assert refused(shapes={name: [1]}) == message
    assert refused(batch=1, layout={name: "NC"}) == message


def test_a_layout_given_as_a_mapping_keeps_its_input_names():
    spec = CompileSpec.create("CPU", batch=2, layout={"x": "nc", "y": "N..."})
    assert spec.layout == {"x": "NC", "y": "N..."}


# --- batch and layout ------------------------------------------------------------------------


def test_the_batch_may_be_max_batch_not_more():
    assert CompileSpec.create("CPU", batch=MAX_BATCH).batch == MAX_BATCH
    assert (
        refused(batch=MAX_BATCH + 1) == f"batch={MAX_BATCH + 1} must be an integer from 1 to 4096"
    )


@pytest.mark.parametrize("batch", ["2", True])
def test_a_json_batch_that_is_not_an_integer_is_refused(batch):
    assert refused(batch=batch) == f"batch={batch!r} must be an integer from 1 to {MAX_BATCH}"


def test_batch_refusals_say_which_flag_to_change():
    assert refused(batch=2, shapes=["[1,3]"]) == (
        "give the batch either in --shape or with --batch, not both"
    )
    assert refused(layout=["NC"]) == "--layout only says where the batch axis is; it needs --batch"


def test_a_layout_without_a_batch_axis_is_refused_naming_the_input():
    assert refused(batch=2, layout=["CHW"]) == "layout CHW has no batch axis N"
    assert refused(batch=2, layout=["x:CHW"]) == "layout x:CHW has no batch axis N"


# --- tiles, compiler parameters, properties --------------------------------------------------


@pytest.mark.parametrize("tiles", ["2", True])
def test_json_tiles_that_are_not_an_integer_are_refused(tiles):
    assert refused(NPU, tiles=tiles) == f"tiles={tiles!r} must be an integer"


def test_an_unknown_compiler_parameter_is_refused_listing_the_known_ones():
    assert refused(NPU, compiler_params="speed=max") == (
        "unknown compiler parameter 'speed'; known: optimization-level, performance-hint-override"
    )


def test_a_compiler_parameter_value_is_everything_after_the_first_equals_sign():
    assert refused(NPU, compiler_params="optimization-level=1=2") == (
        "compiler parameter optimization-level='1=2' is not one of: 0, 1, 2"
    )


def test_a_property_farm_sets_itself_is_refused_naming_the_flag_if_there_is_one():
    assert refused(config=["PERFORMANCE_HINT=LATENCY"]) == (
        "PERFORMANCE_HINT is set by farm itself, not through --config; use --hint"
    )
    assert refused(config=["CACHE_DIR=/tmp"]) == (
        "CACHE_DIR is set by farm itself, not through --config"
    )


def test_an_unknown_property_is_refused_listing_the_allowed_ones():
    assert refused(config=["COLOR=blue"]) == (
        "property 'COLOR' is not allowed for CPU targets; allowed: "
        "DYNAMIC_QUANTIZATION_GROUP_SIZE, EXECUTION_MODE_HINT, INFERENCE_PRECISION_HINT, "
        "KV_CACHE_PRECISION, NUM_STREAMS, PERFORMANCE_HINT_NUM_REQUESTS"
    )


def test_a_property_value_is_everything_after_the_first_equals_sign_and_names_its_key():
    assert refused(config=["NUM_STREAMS=2=3"]) == "NUM_STREAMS='2=3' must be an integer"
    assert refused(config={"num_streams": "0"}) == "NUM_STREAMS='0' must be at least 1"


def test_a_cpu_toolchain_without_runtime_requirements_is_refused():
    with pytest.raises(
        SpecError, match=re.escape("a CPU toolchain needs its RUNTIME_REQUIREMENTS string")
    ) as raised:
        Toolchain("2025.3.0").key_part(CompileSpec.create("CPU").target)
    assert str(raised.value) == "a CPU toolchain needs its RUNTIME_REQUIREMENTS string"


# --- toolchain files and summaries -----------------------------------------------------------

CPU_ENTRY = {
    "target": "CPU",
    "openvino": "2026.4.1",
    "openvino_build": "2026.4.1-1234",
    "npu_compiler": None,
    "runtime_requirements": "meta=1.0;ov=2026.4.1",
}
NPU_ENTRY = {"target": "NPU.4000", "openvino": "2026.4.1", "npu_compiler": "7.4.0"}


def test_a_toolchain_file_of_one_entry_per_target_is_merged():
    """`farm toolchain --json` prints one entry per target: the release they share, the build
    and runtime requirements of the CPU entry, the compiler of the NPU entry."""
    expected = Toolchain("2026.4.1", "2026.4.1-1234", "7.4.0", "meta=1.0;ov=2026.4.1")
    assert Toolchain.from_json([NPU_ENTRY, CPU_ENTRY]) == expected
    assert Toolchain.from_json([CPU_ENTRY, NPU_ENTRY]) == expected


def test_a_toolchain_file_of_one_object_is_that_toolchain():
    assert Toolchain.from_json(NPU_ENTRY) == Toolchain("2026.4.1", npu_compiler="7.4.0")
    assert Toolchain.from_json({"openvino": "2026.4.1", "openvino_build": "b"}) == Toolchain(
        "2026.4.1", openvino_build="b"
    )


@pytest.mark.parametrize(
    "data", [[], {}, [CPU_ENTRY, "NPU"], [{"openvino": ""}], {"npu_compiler": "7.4.0"}, "2026.4.1"]
)
def test_anything_else_is_not_a_toolchain_file(data):
    with pytest.raises(SpecError) as raised:
        Toolchain.from_json(data)
    assert str(raised.value) == "a toolchain file holds what `farm toolchain --json` prints"


def test_a_toolchain_file_names_one_release():
    with pytest.raises(SpecError) as raised:
        Toolchain.from_json([CPU_ENTRY, {**NPU_ENTRY, "openvino": "2025.4.0"}])
    assert str(raised.value) == (
        "a toolchain file names one OpenVINO release, not ['2025.4.0', '2026.4.1']"
    )


def test_a_cpu_toolchain_file_is_refused_for_an_npu_target_and_the_other_way_round():
    npu, cpu = Target.parse("NPU.4000"), Target.parse("CPU")
    with pytest.raises(SpecError) as raised:
        Toolchain.from_json(CPU_ENTRY, [cpu, npu])
    assert str(raised.value) == (
        "the toolchain file describes CPU, not NPU.4000: write it with "
        "`farm toolchain --device NPU.4000 --json` on the edge that imports the blob"
    )
    with pytest.raises(SpecError, match=r"describes NPU\.4000, not CPU"):
        Toolchain.from_json([NPU_ENTRY], [cpu])
    # An NPU entry stands for every NPU platform (the key holds only the release); a file
    # without targets (written by hand) is taken as it is.
    assert Toolchain.from_json([NPU_ENTRY, CPU_ENTRY], [Target.parse("3720"), cpu]).openvino
    assert Toolchain.from_json({"openvino": "2026.4.1"}, [npu]) == Toolchain("2026.4.1")


def test_a_summary_is_the_target_and_the_flags_that_differ():
    spec = CompileSpec.create("npu4000", tiles=4, performance_hint="latency", batch=2)
    assert spec.summary() == "NPU.4000 --tiles 4 --hint LATENCY --batch 2"
    assert CompileSpec.create("cpu").summary() == "CPU"
