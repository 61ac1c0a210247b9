"""spec.py: parsing, validation and the canonical form that feeds the cache key."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given

from farm.core.spec import MAX_TILES, CompileSpec, SpecError, Target, Toolchain
from tests.strategies import specs


@pytest.mark.parametrize(
    ("text", "name"),
    [
        ("4000", "NPU.4000"),
        ("NPU4000", "NPU.4000"),
        ("NPU.4000", "NPU.4000"),
        ("npu.4000", "NPU.4000"),
        (" 3720 ", "NPU.3720"),
        ("5010", "NPU.5010"),
        ("NPU5020", "NPU.5020"),
        ("CPU", "CPU"),
        ("cpu", "CPU"),
    ],
)
def test_target_spellings(text, name):
    assert Target.parse(text).name == name


@pytest.mark.parametrize("text", ["4001", "GPU", "", "NPU.", "NPU", "NPU.40000", "4000x"])
def test_unknown_device_lists_the_known_ones(text):
    with pytest.raises(
        SpecError, match=re.escape("known devices: NPU.3720, NPU.4000, NPU.5010, NPU.5020, CPU")
    ):
        Target.parse(text)


@pytest.mark.parametrize("platform", sorted(MAX_TILES))
def test_tiles_from_one_to_the_platform_maximum(platform):
    maximum = MAX_TILES[platform]
    for tiles in range(1, maximum + 1):
        assert CompileSpec.create(platform, tiles=tiles).tiles == tiles
    for tiles in (0, maximum + 1, -1):
        with pytest.raises(SpecError, match=f"1 to {maximum}"):
            CompileSpec.create(platform, tiles=tiles)


def test_tiles_message_names_the_platform_and_its_maximum():
    with pytest.raises(SpecError, match=r"tiles=7 is outside what NPU.4000 supports \(1 to 6\)"):
        CompileSpec.create("4000", tiles=7)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tiles": 1}, "NPU targets only"),
        ({"compiler_params": "optimization-level=1"}, "NPU targets only"),
        ({"performance_hint": "fastest"}, "not one of LATENCY, THROUGHPUT"),
        ({"shapes": ["x[1,a]"]}, "positive integer"),
        ({"shapes": ["x[]"]}, "1 to 8 dimensions"),
        ({"shapes": ["x[-1,3]"]}, "positive integer"),
        ({"shapes": ["x[0,3]"]}, "from 1 to"),
        ({"shapes": ["x[99999999999]"]}, "from 1 to"),
        ({"shapes": ["x[65536,65536,65536]"]}, "elements"),
        ({"shapes": ["x[1,1,1,1,1,1,1,1,1]"]}, "1 to 8 dimensions"),
        ({"shapes": ["x1,3"]}, "is not NAME"),
        ({"shapes": ["x[1,3]", "x[1,4]"]}, "two different shapes"),
        ({"shapes": ["[1,3]", "y[1,3]"]}, "only allowed for a single input"),
        ({"batch": 0}, "from 1 to 4096"),
        ({"batch": 5000}, "from 1 to 4096"),
        ({"batch": 2, "shapes": ["x[2,3]"]}, "not both"),
        ({"batch": 2, "layout": ["x:CHW"]}, "no batch axis N"),
        ({"layout": ["x:NCHW"]}, "needs --batch"),
        ({"batch": 2, "layout": ["x:N1"]}, "not a layout"),
        ({"batch": 2, "layout": ["x:NN"]}, "not a layout"),
        ({"config": ["NUM_STREAM=2"]}, "allowed: DYNAMIC_QUANTIZATION_GROUP_SIZE"),
        ({"config": ["INFERENCE_PRECISION_HINT=f64"]}, "use one of: bf16, f16, f32"),
        ({"config": ["NUM_STREAMS=many"]}, "must be an integer"),
        ({"config": ["NUM_STREAMS=0"]}, "at least 1"),
        ({"config": ["PERFORMANCE_HINT=LATENCY"]}, "use --hint"),
        ({"config": ["CACHE_DIR=/tmp"]}, "set by farm itself"),
        ({"config": ["NOEQUALS"]}, "is not KEY=VALUE"),
    ],
)
def test_cpu_spec_errors(kwargs, message):
    with pytest.raises(SpecError, match=message):
        CompileSpec.create("CPU", **kwargs)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ("turbo=on", "unknown compiler parameter 'turbo'"),
        ("optimization-level=3", "not one of: 0, 1, 2"),
        ("performance-hint-override=throughput", "not one of: efficiency, latency"),
        ("optimization-level", "is not KEY=VALUE"),
        ("optimization-level=1 optimization-level=2", "given twice"),
    ],
)
def test_npu_compiler_param_errors(params, message):
    with pytest.raises(SpecError, match=message):
        CompileSpec.create("4000", compiler_params=params)


def test_npu_config_allowlist_is_its_own():
    spec = CompileSpec.create("3720", config=["npu_batch_mode=plugin", "NPU_TURBO=yes"])
    assert spec.config == {"NPU_BATCH_MODE": "PLUGIN", "NPU_TURBO": "YES"}
    with pytest.raises(SpecError, match="not allowed for NPU"):
        CompileSpec.create("3720", config=["NUM_STREAMS=2"])


def test_canonical_form_of_a_full_npu_spec():
    spec = CompileSpec.create(
        "npu4000",
        tiles=4,
        performance_hint="latency",
        compiler_params="performance-hint-override=LATENCY optimization-level=2",
        shapes=["image[1,3,224,224]", "mask[1,224]"],
        weightless=True,
        config=["npu_qdq_optimization=yes"],
    )
    assert spec.target == Target("NPU", "4000")
    assert spec.canonical() == {
        "tiles": 4,
        "performance_hint": "LATENCY",
        "compiler_params": "optimization-level=2 performance-hint-override=latency",
        "shapes": {"image": [1, 3, 224, 224], "mask": [1, 224]},
        "batch": None,
        "layout": {},
        "weightless": True,
        "config": {"NPU_QDQ_OPTIMIZATION": "YES"},
    }


def test_canonical_form_of_a_batched_cpu_spec():
    spec = CompileSpec.create("CPU", batch=4, layout=["x:nchw"], config={"num_streams": "02"})
    canonical = spec.canonical()
    assert canonical["batch"] == 4
    assert canonical["layout"] == {"x": "NCHW"}
    assert canonical["config"] == {"NUM_STREAMS": "2"}
    assert CompileSpec.create("CPU", batch=4, layout=["NCHW"]).layout == {"": "NCHW"}


def test_equivalent_spellings_are_equal_specs():
    a = CompileSpec.create(
        "4000",
        performance_hint="latency",
        compiler_params="optimization-level=2 performance-hint-override=latency",
    )
    b = CompileSpec.create(
        "NPU.4000",
        performance_hint="LATENCY",
        compiler_params={"performance-hint-override": "Latency", "optimization-level": "2"},
    )
    assert a == b and a.canonical() == b.canonical()


def test_toolchain_key_part_depends_on_the_target():
    toolchain = Toolchain("2026.4.1", "2026.4.1-22982", None, "meta=1.0;ov=2026.4.1;isa=AVX2")
    assert toolchain.key_part(Target.parse("4000")) == {"openvino": "2026.4.1"}
    assert toolchain.key_part(Target.parse("CPU")) == {
        "openvino": "2026.4.1",
        "runtime_requirements": "meta=1.0;ov=2026.4.1;isa=AVX2",
    }
    with pytest.raises(SpecError, match="RUNTIME_REQUIREMENTS"):
        Toolchain("2026.4.1").key_part(Target.parse("CPU"))


def test_from_canonical_rejects_unknown_fields():
    with pytest.raises(SpecError, match="unknown spec fields: colour"):
        CompileSpec.from_canonical("CPU", {"colour": "red"})


# --- properties: parse(render(x)) == x, and the canonical form is stable ------------------


def cli_to_kwargs(args: list[str]) -> tuple[str, dict]:
    """What the `farm submit` flags mean, as `CompileSpec.create` arguments."""
    flags = {
        "--tiles": "tiles",
        "--hint": "performance_hint",
        "--batch": "batch",
        "--compiler-params": "compiler_params",
    }
    repeated = {"--shape": "shapes", "--layout": "layout", "--config": "config"}
    device, kwargs = None, {"shapes": [], "layout": [], "config": []}
    rest = iter(args)
    for flag in rest:
        if flag == "--weightless":
            kwargs["weightless"] = True
        elif flag == "--device":
            device = next(rest)
        elif flag in repeated:
            kwargs[repeated[flag]].append(next(rest))
        else:
            value = next(rest)
            kwargs[flags[flag]] = int(value) if flag in ("--tiles", "--batch") else value
    return device, kwargs


@given(specs())
def test_canonical_round_trip(spec):
    canonical = spec.canonical()
    assert json.loads(json.dumps(canonical)) == canonical
    assert CompileSpec.from_canonical(spec.target, canonical) == spec


@given(specs())
def test_cli_round_trip(spec):
    device, kwargs = cli_to_kwargs(spec.cli_args())
    assert CompileSpec.create(device, **kwargs) == spec
