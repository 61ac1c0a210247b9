"""The reference rules edges and workers share: seeded inputs, the file format, the comparison,
and the signature that binds a reference file to its blob."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest

from farm.core.errors import IntegrityMismatch, SignatureError
from farm.core.reference import (
    TOLERANCES,
    InputSpec,
    Reference,
    Tolerance,
    compare,
    default_tolerance,
    output_label,
    percentile,
    seeded_inputs,
    summary,
)
from farm.core.signing import Signer, TrustedKeys, reference_message

KEY_A, KEY_B = "a" * 64, "b" * 64
SPECS = [InputSpec("pixels", (1, 3, 4, 4), "float32"), InputSpec("ids", (2, 5), "int64")]
TIGHT = Tolerance(atol=1e-4, rtol=1e-4, min_cosine=0.99999)


def test_seeded_inputs_are_the_same_for_a_key_and_differ_across_keys_and_inputs():
    first, again, other = (seeded_inputs(k, SPECS) for k in (KEY_A, KEY_A, KEY_B))
    for name in ("pixels", "ids"):
        assert np.array_equal(first[name], again[name])
        assert not np.array_equal(first[name], other[name])
    assert first["pixels"].dtype == np.float32 and first["pixels"].shape == (1, 3, 4, 4)
    assert first["pixels"].min() >= -1 and first["pixels"].max() < 1
    assert first["ids"].dtype == np.int64 and set(np.unique(first["ids"])) == {0, 1}
    two_same = seeded_inputs(
        KEY_A, [InputSpec("a", (64,), "float32"), InputSpec("b", (64,), "float32")]
    )
    assert not np.array_equal(two_same["a"], two_same["b"])


def test_seeded_inputs_are_pinned_so_a_numpy_upgrade_cannot_move_them_silently():
    """Workers and edges of different numpy releases must make the same inputs for a key; if
    this fails, numpy changed its generator: bump REFERENCE_FORMAT, do not edit the numbers."""
    made = seeded_inputs(KEY_A, [InputSpec("x", (3,), "float32"), InputSpec("i", (4,), "int32")])
    assert made["x"].tolist() == pytest.approx([0.35676482, 0.17616679, 0.00780375], abs=1e-7)
    assert made["i"].tolist() == [0, 0, 0, 1]


def test_a_reference_file_round_trips_names_dtypes_and_shapes():
    inputs = seeded_inputs(KEY_A, SPECS)
    outputs = {"logits/0:odd name": np.arange(6, dtype=np.float32).reshape(2, 3)}
    loaded = Reference.load(io.BytesIO(Reference(inputs, outputs).to_bytes()))
    assert list(loaded.inputs) == ["pixels", "ids"]
    assert list(loaded.outputs) == ["logits/0:odd name"]
    for name, value in {**inputs, **outputs}.items():
        got = {**loaded.inputs, **loaded.outputs}[name]
        assert got.dtype == value.dtype and np.array_equal(got, value)


@pytest.mark.parametrize(
    "content",
    [b"", b"not a zip", None],
    ids=["empty", "garbage", "an npz of other arrays"],
)
def test_anything_but_a_reference_file_is_refused(content, tmp_path):
    path = tmp_path / "r.npz"
    if content is None:
        np.savez(path, x=np.zeros(2))
    else:
        path.write_bytes(content)
    with pytest.raises(IntegrityMismatch, match="not a farm reference file"):
        Reference.load(path)


def test_submitted_inputs_must_be_an_npz_of_named_arrays(tmp_path):
    from farm.core.errors import SpecError
    from farm.core.reference import load_inputs

    single = tmp_path / "x.npy"
    np.save(single, np.zeros(3))
    with pytest.raises(SpecError, match=r"not a readable \.npz"):
        load_inputs(single)
    named = tmp_path / "x.npz"
    np.savez(named, pixels=np.ones(2))
    assert list(load_inputs(named)) == ["pixels"]


def test_a_pickled_array_is_never_loaded(tmp_path):
    path = tmp_path / "r.npz"
    meta = np.frombuffer(
        b'{"format": "farm-reference-v1", "inputs": ["x"], "outputs": []}', np.uint8
    )
    np.savez(path, meta=meta, input0=np.array([{"evil": 1}], dtype=object))
    with pytest.raises(IntegrityMismatch):
        Reference.load(path)


def test_identical_outputs_pass_with_zero_error():
    want = {"y": np.linspace(-3, 3, 100, dtype=np.float32)}
    (result,) = compare(want, {"y": want["y"].copy()}, TIGHT)
    assert (result.max_abs_error, result.mean_abs_error, result.passed) == (0.0, 0.0, True)
    assert result.cosine == pytest.approx(1.0)


def test_an_error_just_inside_and_just_outside_the_bound():
    want = np.full(10, 2.0)  # bound: atol + rtol * 2 = 3e-4
    inside = compare({"y": want}, {"y": want + 2.9e-4}, TIGHT)[0]
    outside = compare({"y": want}, {"y": want + 3.1e-4}, TIGHT)[0]
    assert inside.passed and not outside.passed
    assert outside.max_abs_error == pytest.approx(3.1e-4)


def test_a_different_direction_fails_on_cosine_even_with_small_absolute_errors():
    want = np.array([1e-3, 0.0, 0.0])
    got = np.array([0.0, 1e-3, 0.0])
    loose = Tolerance(atol=1.0, rtol=0.0, min_cosine=0.99)
    result = compare({"y": want}, {"y": got}, loose)[0]
    assert result.cosine == pytest.approx(0.0) and not result.passed


def test_missing_outputs_other_shapes_and_nan_fail():
    want = {"a": np.ones(4), "b": np.ones(4)}
    results = compare(want, {"a": np.ones(5)}, TIGHT)
    assert [r.passed for r in results] == [False, False]
    assert math.isinf(results[1].max_abs_error)
    nan = compare({"y": np.ones(3)}, {"y": np.array([1.0, np.nan, 1.0])}, TIGHT)[0]
    assert not nan.passed


def test_outputs_are_matched_by_position_when_the_blob_renames_them():
    result = compare({"source_name": np.ones(3)}, {"Result_7": np.ones(3)}, TIGHT)[0]
    assert result.passed and result.name == "source_name"


def test_position_never_pairs_an_output_with_another_expected_one():
    expected = {"a": np.zeros(3), "b": np.ones(3)}
    a, b = compare(expected, {"b": np.ones(3), "x": np.zeros(3)}, TIGHT)
    assert (a.passed, b.passed) == (False, True)  # a is missing; never compared with b


def test_summary_reports_the_worst_output():
    results = compare(
        {"a": np.ones(4), "b": np.ones(4)}, {"a": np.ones(4), "b": np.ones(4) * 1.5}, TIGHT
    )
    figures = summary(results)
    assert figures["passed"] is False
    assert figures["max_abs_error"] == pytest.approx(0.5)
    assert [o["passed"] for o in figures["outputs"]] == [True, False]


def test_default_tolerances_are_tight_for_cpu_and_fp16_sized_for_npu():
    assert default_tolerance("CPU") == TOLERANCES["f32"]
    assert default_tolerance("NPU") == default_tolerance("NPU.0", "f32") == TOLERANCES["f16"]
    assert default_tolerance("CPU", "bf16") == TOLERANCES["bf16"]
    assert default_tolerance("CPU", "f8e4m3") == TOLERANCES["bf16"]  # not in the table: loosest
    fp16 = np.float32(1.0) + np.float32(np.finfo(np.float16).eps)
    npu = compare({"y": np.ones(8)}, {"y": np.full(8, fp16)}, default_tolerance("NPU"))[0]
    cpu = compare({"y": np.ones(8)}, {"y": np.full(8, fp16)}, default_tolerance("CPU"))[0]
    assert npu.passed and not cpu.passed


def test_percentile_is_nearest_rank():
    values = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert (percentile(values, 0.5), percentile(values, 0.9), percentile(values, 0.0)) == (3, 5, 1)
    assert math.isnan(percentile([], 0.5))


def test_a_reference_signature_binds_the_file_to_its_blob(tmp_path):
    signer = Signer.from_file(_key(tmp_path))
    trust = TrustedKeys({signer.key_id: signer.public_key})
    record = {
        "cache_key": KEY_A,
        "sha256": "c" * 64,
        "reference_sha256": "d" * 64,
        "reference_size_bytes": 100,
        "signing_key_id": signer.key_id,
        "reference_signature": signer.sign_reference(KEY_A, "c" * 64, "d" * 64, 100),
    }
    trust.verify_reference(record)
    for field, other in (
        ("reference_sha256", "e" * 64),
        ("reference_size_bytes", 101),
        ("sha256", "f" * 64),  # the same reference offered for other bytes
        ("cache_key", KEY_B),
    ):
        with pytest.raises(SignatureError):
            trust.verify_reference({**record, field: other})
    with pytest.raises(SignatureError, match="not signed"):
        trust.verify_reference({**record, "reference_signature": None})
    with pytest.raises(SignatureError, match="no reference"):
        trust.verify_reference({**record, "reference_sha256": None})
    assert reference_message(KEY_A, "c" * 64, "d" * 64, 100).startswith(b"farm-blob-reference-v1\n")


def _key(tmp_path):
    from farm.core.signing import create_key_pair

    path = tmp_path / "k.pem"
    create_key_pair(path)
    return path


def test_a_cpu_computing_in_less_than_f32_gets_its_tolerance_and_overrides_win():
    from farm.core.spec import Target
    from farm.edge.verify import _tolerance

    cpu = Target.parse("CPU")
    assert _tolerance(cpu, "f32", None) == TOLERANCES["f32"]
    assert _tolerance(cpu, None, None) == TOLERANCES["f32"]
    assert _tolerance(cpu, "bf16", None) == TOLERANCES["bf16"]
    assert _tolerance(cpu, "f16", None) == TOLERANCES["f16"]
    assert _tolerance(Target.parse("4000"), None, None) == TOLERANCES["f16"]
    loose = _tolerance(cpu, "f32", {"atol": 0.5, "rtol": None, "min_cosine": None})
    assert (loose.atol, loose.rtol) == (0.5, TOLERANCES["f32"].rtol)


def test_a_compiled_models_precision_is_read_as_an_openvino_type_not_its_string():
    """OpenVINO answers INFERENCE_PRECISION_HINT with an `ov.Type`, whose str() is
    "<Type: 'float32'>": read as a string, every f32 CPU blob got a looser tolerance."""
    import openvino as ov

    from farm.edge.verify import precision_name

    assert str(ov.Type.f32) != "f32"
    assert [precision_name(t) for t in (ov.Type.f32, ov.Type.f16, ov.Type.bf16)] == [
        "f32",
        "f16",
        "bf16",
    ]
    assert precision_name(None) is None
    assert precision_name("FP32") != "f16"


def test_an_f32_cpu_blob_is_held_to_the_f32_tolerance_never_the_fp16_one():
    """Compiles a two-node model with INFERENCE_PRECISION_HINT=f32 (milliseconds) and reads its
    precision back the way `farm verify` does: this fails if an f32 blob is compared with the
    fp16 tolerance."""
    import openvino as ov
    from openvino import opset13 as ops

    from farm.core.spec import Target
    from farm.edge.verify import _tolerance, precision_name
    from farm.toolchain import property_or_none

    x = ops.parameter([4], ov.Type.f32, name="x")
    model = ov.Model([ops.relu(x)], [x])
    compiled = ov.Core().compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    precision = precision_name(property_or_none(compiled, "INFERENCE_PRECISION_HINT"))
    tolerance = _tolerance(Target.parse("CPU"), precision, None)
    assert precision == "f32"
    assert tolerance == TOLERANCES["f32"] != TOLERANCES["f16"]


def test_the_documented_tolerance_table_is_the_code_s_table():
    """docs/architecture.md §14 has the one table of tolerances; it must say what the code does."""
    from pathlib import Path

    doc = (Path(__file__).parents[2] / "docs" / "architecture.md").read_text()
    section = doc[doc.index("<!-- tolerances -->") : doc.index("<!-- /tolerances -->")]
    rows = [
        line.strip("| ").split(" | ") for line in section.splitlines() if line.startswith("| `")
    ]
    documented = {
        row[0].strip("`"): Tolerance(float(row[1]), float(row[2]), float(row[3])) for row in rows
    }
    assert documented == TOLERANCES


def test_outputs_are_labelled_by_the_model_s_own_name():
    assert output_label({"/decoder/Conv_output_0", "speech_probs"}, 0) == "speech_probs"
    assert output_label({"Identity:0", "logits"}, 1) == "logits"
    assert output_label({"b", "a"}, 0) == "a"
    assert output_label(set(), 3) == "output3"


def test_scalar_inputs_stay_0_d_through_seeding_and_the_file():
    specs = [
        InputSpec("sr", (), "int64"),
        InputSpec("gain", (), "float32"),
        InputSpec("state", (2, 1, 128), "float32"),
    ]
    made = seeded_inputs(KEY_A, specs)
    assert [made[n].shape for n in ("sr", "gain", "state")] == [(), (), (2, 1, 128)]
    assert isinstance(made["gain"], np.ndarray) and made["gain"].dtype == np.float32
    assert made["sr"].dtype == np.int64
    outputs = {"prob": np.float32(0.5) * np.ones(()), "stateN": made["state"]}
    loaded = Reference.load(io.BytesIO(Reference(made, outputs).to_bytes()))
    for name, value in {**made, **outputs}.items():
        got = {**loaded.inputs, **loaded.outputs}[name]
        assert got.shape == np.shape(value) and got.dtype == np.asarray(value).dtype


def test_reference_inputs_meet_the_blob_s_inputs_by_name_with_their_exact_shapes():
    """A 0-d input takes a 0-d array; a (1,)-shaped one (what np.ascontiguousarray makes of a
    scalar) or a missing input is the harness's error, never the blob's failure."""
    import openvino as ov
    from openvino import opset13 as ops

    from farm.edge.verify import HarnessError, _by_port

    frames = ops.parameter([1, 4], ov.Type.f32, name="input")
    rate = ops.parameter([], ov.Type.i64, name="sr")
    mixed = ops.add(frames, ops.convert(rate, ov.Type.f32))
    compiled = ov.Core().compile_model(ov.Model([mixed], [frames, rate]), "CPU")
    audio = np.ones((1, 4), np.float32)
    ordered = _by_port(compiled, {"sr": np.asarray(np.int64(16000)), "input": audio})
    assert [a.shape for a in ordered] == [(1, 4), ()]
    with pytest.raises(HarnessError, match=r"'sr' has shape \[1\]; the blob's input takes \[\]"):
        _by_port(compiled, {"input": audio, "sr": np.array([16000], np.int64)})
    with pytest.raises(HarnessError, match="the reference has 1 inputs"):
        _by_port(compiled, {"input": audio})


def test_an_inputs_file_keeps_0_d_arrays(tmp_path):
    from farm.core.reference import load_inputs

    path = tmp_path / "inputs.npz"
    np.savez(path, sr=np.int64(16000), state=np.zeros((2, 1, 128), np.float32))
    loaded = load_inputs(path)
    assert loaded["sr"].shape == () and loaded["sr"].dtype == np.int64
    assert loaded["state"].shape == (2, 1, 128)
