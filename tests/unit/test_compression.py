"""The compress/quantize stages' arguments: one canonical form, the presets, the refusals, the
calibration folder's identity and the --max-drift bound (farm/core/compression.py)."""

from __future__ import annotations

import numpy as np
import pytest

from farm.core import compression
from farm.core.compression import (
    BY_SIZE,
    CHANNEL_WISE,
    COMPRESS,
    QUANTIZE,
    DriftBound,
    calibration_digest,
    calibration_files,
    calibration_identity,
    canonical_compress,
    canonical_quantize,
    check_target,
    compress_args,
    quantize_args,
    resolve_group_size,
)
from farm.core.errors import (
    CalibrationError,
    CompressionArgsError,
    DriftExceeded,
    Kind,
    SpecError,
)

DIGEST = "ab" * 32
CALIBRATION = {"b.npy": DIGEST, "a/x.npz": "cd" * 32}


def test_each_mode_has_one_canonical_form_with_nncf_defaults_written_out():
    assert compress_args("int8") == {"mode": "int8_asym"}
    assert compress_args("INT8-SYM") == {"mode": "int8_sym"}
    assert compress_args("int4-sym") == {
        "mode": "int4_sym",
        "group_size": 128,
        "ratio": 1.0,
        "all_layers": False,
    }
    # Spelling a default out, or another spelling of it, is the same dict (the same key).
    assert compress_args("int4-sym", group_size="128", ratio="1.0") == compress_args("int4-sym")
    assert compress_args("int4-asym", group_size="channel") == compress_args(
        "int4-asym", group_size=-1
    )
    assert compress_args("int4-asym", group_size="channel")["group_size"] == CHANNEL_WISE
    # The NPU guide: NF4 channel-wise.
    assert compress_args("nf4")["group_size"] == CHANNEL_WISE
    assert compress_args("int4-sym", ratio=0.8, all_layers=True)["ratio"] == 0.8
    assert canonical_compress(compress_args("int4-sym", group_size=64)) == compress_args(
        "int4-sym", group_size=64
    )


def test_the_presets_encode_the_npu_guide():
    llm = compress_args("npu-llm")
    assert llm == {"mode": "int4_sym", "group_size": {"by_size": BY_SIZE}, "ratio": 1.0}
    assert BY_SIZE == {"at_most": 4_000_000_000, "then": 128, "else": -1}
    assert resolve_group_size(llm, 1_100_000_000) == 128  # TinyLlama 1.1B: grouped
    assert resolve_group_size(llm, 4_000_000_000) == 128
    assert resolve_group_size(llm, 8_000_000_000) == CHANNEL_WISE  # Llama 3.1 8B
    assert compress_args("npu-cnn") == {"mode": "int8_sym"}
    # A preset's dict validates as itself (the API receives it from the CLI).
    assert canonical_compress({**llm, "all_layers": False}) == {**llm, "all_layers": False}


@pytest.mark.parametrize(
    ("call", "says"),
    [
        (lambda: compress_args("int3"), "unknown; choose one of int8, int8-sym"),
        (lambda: compress_args("int8", group_size=128), "--group-size apply to 4-bit modes"),
        (lambda: compress_args("int8", ratio=0.5), "--ratio apply to 4-bit modes"),
        (lambda: compress_args("int8", all_layers=True), "--all-layers apply to 4-bit"),
        (lambda: compress_args("npu-llm", group_size=64), "is a preset"),
        (lambda: compress_args("int4-sym", group_size=0), "positive number of weights"),
        (lambda: compress_args("int4-sym", group_size="big"), "positive number of weights"),
        (lambda: compress_args("int4-sym", ratio=0), "above 0 and at most 1"),
        (lambda: compress_args("int4-sym", ratio="1.5"), "above 0 and at most 1"),
        (lambda: compress_args("int4-sym", ratio="nan"), "above 0 and at most 1"),
        (lambda: canonical_compress({"mode": "int4_sym", "awq": True}), "unknown argument"),
        (lambda: canonical_compress({"mode": "int4_sym", "group_size": {"x": 1}}), "rule"),
        (lambda: canonical_compress({"mode": "int4_sym", "all_layers": "yes"}), "true or false"),
    ],
)
def test_bad_compress_arguments_are_refused_saying_what_to_give(call, says):
    with pytest.raises(CompressionArgsError, match=says) as caught:
        call()
    assert isinstance(caught.value, SpecError)
    assert caught.value.kind is Kind.BAD_INPUT


def test_int8_accepts_nncf_only_int8_form_spelled_out():
    assert canonical_compress({"mode": "int8_asym", "group_size": -1, "ratio": 1}) == {
        "mode": "int8_asym"
    }


def test_nf4_below_npu_4000_is_refused_naming_why():
    nf4 = compress_args("nf4")
    with pytest.raises(CompressionArgsError, match=r"NPU\.3720.*NF4 data type needs NPU 4000"):
        check_target(COMPRESS, nf4, "3720")
    for fine in ("4000", "NPU.5010", "CPU"):
        check_target(COMPRESS, nf4, fine)
    check_target(COMPRESS, compress_args("int4-sym"), "3720")
    check_target(QUANTIZE, quantize_args("int8", CALIBRATION), "3720")


def test_quantize_args_name_the_calibration_files_by_digest():
    args = quantize_args("INT8", CALIBRATION)
    assert args == {
        "precision": "int8",
        "calibration": {"a/x.npz": "cd" * 32, "b.npy": DIGEST},
        "device": "npu",
    }
    assert list(args["calibration"]) == ["a/x.npz", "b.npy"]  # one order, one key
    assert quantize_args("int8", CALIBRATION, target_device="CPU")["device"] == "cpu"
    with pytest.raises(CompressionArgsError, match="farm quantizes to int8"):
        quantize_args("int4", CALIBRATION)
    with pytest.raises(CompressionArgsError, match="needs --calibration DIR"):
        quantize_args("int8", {})
    with pytest.raises(CompressionArgsError, match="not one of any, cpu, gpu, npu"):
        quantize_args("int8", CALIBRATION, target_device="tpu")
    with pytest.raises(CompressionArgsError, match="unknown argument"):
        canonical_quantize({"precision": "int8", "calibration": CALIBRATION, "subset": 3})


@pytest.mark.parametrize(
    "entry",
    [
        {"../x.npy": DIGEST},
        {"/etc/x.npy": DIGEST},
        {"a//x.npy": DIGEST},
        {"x.txt": DIGEST},
        {"x.npy": "nope"},
        {"a\\x.npy": DIGEST},
    ],
)
def test_calibration_entries_are_relative_array_files_with_digests(entry):
    with pytest.raises(CompressionArgsError, match=r"is not a relative \.npy/\.npz path"):
        quantize_args("int8", entry)


def test_the_calibration_digest_covers_every_file_and_its_place(tmp_path):
    folder = tmp_path / "calib"
    (folder / "b").mkdir(parents=True)
    np.save(folder / "a.npy", np.zeros((1, 3), np.float32))
    np.savez(folder / "b" / "c.npz", x=np.ones((1, 3), np.float32))
    files = calibration_files(folder)
    assert list(files) == ["a.npy", "b/c.npz"]
    identity = calibration_identity(files)
    digest = calibration_digest(identity)
    assert len(digest) == 64
    assert calibration_digest(calibration_identity(calibration_files(folder))) == digest
    np.save(folder / "a.npy", np.ones((1, 3), np.float32))  # other content: another set
    assert calibration_digest(calibration_identity(calibration_files(folder))) != digest
    (folder / "b" / "c.npz").rename(folder / "d.npz")  # the same bytes elsewhere: another set
    assert calibration_digest(calibration_identity(calibration_files(folder))) != digest


def test_calibration_folders_hold_arrays_only(tmp_path):
    with pytest.raises(CalibrationError, match="not a folder"):
        calibration_files(tmp_path / "missing")
    with pytest.raises(CalibrationError, match=r"no \.npy or \.npz files"):
        calibration_files(tmp_path)
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(CalibrationError, match=r"notes\.txt is neither \.npy nor \.npz"):
        calibration_files(tmp_path)
    (tmp_path / "notes.txt").unlink()
    (tmp_path / "link.npy").symlink_to("/etc/passwd")
    with pytest.raises(CalibrationError, match="links refused"):
        calibration_files(tmp_path)


def test_max_drift_bounds_the_recorded_figures():
    metrics = {"drift": {"max_abs_diff": 0.02, "min_cosine": 0.9991, "top1_agreement": None}}
    DriftBound.parse("0.05").check(metrics)
    DriftBound.parse("max-abs=0.05, cosine=0.999, top1=0.9").check(metrics)  # top1 unmeasured
    with pytest.raises(DriftExceeded, match=r"max_abs_diff=0\.02, must be at most 0\.01") as caught:
        DriftBound.parse("0.01").check(metrics)
    assert caught.value.kind is Kind.REJECTED
    assert caught.value.details["drift"]["max_abs_diff"] == 0.02
    with pytest.raises(DriftExceeded, match=r"min_cosine=0\.9991, must be at least 0\.9999"):
        DriftBound.parse("cosine=0.9999").check(metrics)
    with pytest.raises(DriftExceeded, match=r"top1_agreement=0\.5"):
        DriftBound.parse("top1=0.99").check({"drift": {**metrics["drift"], "top1_agreement": 0.5}})
    with pytest.raises(DriftExceeded, match="max_abs_diff was not measured"):
        DriftBound.parse("0.1").check({})
    assert str(DriftBound.parse("cosine=0.99,0.1")) == "cosine=0.99,max-abs=0.1"


@pytest.mark.parametrize("text", ["l2=0.1", "-1", "cosine=2", "top1=x", "nan"])
def test_a_max_drift_that_is_not_a_bound_is_refused(text):
    with pytest.raises(CompressionArgsError, match="--max-drift"):
        DriftBound.parse(text)


def test_summaries_for_listings():
    metrics = {
        "size_before": 44_000_000,
        "size_after": 6_100_000,
        "drift": {"max_abs_diff": 0.0123, "min_cosine": 0.99981, "top1_agreement": 1.0},
    }
    assert compression.size_summary(metrics) == "44.0 MB -> 6.1 MB (0.139x)"
    assert compression.drift_summary(metrics) == "max-abs 0.0123 cosine 0.9998 top1 1"
    assert compression.size_summary({}) == compression.drift_summary({}) == ""
    assert compression.describe_compress(compress_args("npu-llm")).startswith(
        "int4_sym group 128 up to 4,000,000,000 weights, else channel ratio 1"
    )
    assert compression.describe_compress(compress_args("int4-asym", group_size="channel")) == (
        "int4_asym channel-wise ratio 1"
    )


def _flags(**given):
    from farm.cli.compression import compression_request

    options = {
        "compress": None,
        "group_size": None,
        "ratio": None,
        "all_layers": False,
        "quantize": None,
        "calibration": None,
        "max_drift": None,
        "device": "CPU",
    }
    options.update(given)
    request = compression_request(options)
    assert options == {"device": "CPU"}  # the spec's flags are left for the spec
    return request


def test_the_cli_flags_make_one_stage_or_none(tmp_path):
    assert _flags().stage is None
    request = _flags(compress="int4-sym", group_size="channel", max_drift="cosine=0.99")
    assert request.stage == {"stage": "compress", "args": compress_args("int4-sym", group_size=-1)}
    assert str(request.max_drift) == "cosine=0.99"
    for index in range(2):
        np.save(tmp_path / f"{index}.npy", np.full((1, 3), index, np.float32))
    quantized = _flags(quantize="int8", calibration=tmp_path)
    assert quantized.stage is not None
    assert quantized.stage["args"]["calibration"] == quantized.calibration_identity
    assert sorted(quantized.calibration_identity) == ["0.npy", "1.npy"]
    with pytest.raises(CompressionArgsError, match="NF4 data type needs NPU 4000"):
        _flags(compress="nf4").check_targets(["CPU", "3720"])


@pytest.mark.parametrize(
    ("given", "says"),
    [
        ({"compress": "int8", "quantize": "int8"}, "give one"),
        ({"ratio": "0.5"}, "go with --compress"),
        ({"calibration": "x"}, "goes with --quantize"),
        ({"quantize": "int8"}, "needs --calibration DIR"),
        ({"max_drift": "0.1"}, "bounds a compressed model"),
    ],
)
def test_cli_flags_that_do_not_go_together_are_refused(given, says):
    with pytest.raises(CompressionArgsError, match=says):
        _flags(**given)


def test_golden_stage_keys_of_compression():
    """Changing a compression's canonical args changes every compressed model's key in every
    fleet: these vectors make that a deliberate act."""
    from farm.core import stages

    identity = {"xml": "a" * 64, "bin": "b" * 64}
    cases = [
        ("compress", compress_args("npu-llm"), "1c9a3a060f13057a704d8a3f990f0639"),
        ("compress", compress_args("int8"), "bb5049e20a49e2c4a4b80874c00e23f5"),
        (
            "quantize",
            quantize_args("int8", {"s/0.npy": "c" * 64}),
            "6fb767b85286ceabfc1a0a4b0c418ea8",
        ),
    ]
    for kind, args, prefix in cases:
        key = stages.stage_keys(identity, (stages.Stage.create(kind, args),))[-1]
        assert key.startswith(prefix), (kind, args, key)
    # the CLI spellings reach the same stage
    assert stages.Stage.create("compress", {"mode": "INT4-SYM", "group_size": "128"}) == (
        stages.Stage.create("compress", compress_args("int4-sym"))
    )


def test_a_compressed_blob_is_judged_against_the_compressed_models_outputs():
    """Its reference outputs are not the source framework's (those are the uncompressed
    numbers, the compression's recorded drift away): `farm verify` would quarantine it."""
    from types import SimpleNamespace

    from farm.server.jobs.runner import _reference_source

    convert = {"stage": "convert", "args": {"format": "tflite"}}
    for kind, args in (
        ("compress", compress_args("int8")),
        ("quantize", quantize_args("int8", CALIBRATION)),
    ):
        job = SimpleNamespace(recipe=[convert, {"stage": kind, "args": args}])
        assert _reference_source(None, job, None, None, None) is None
    plain = SimpleNamespace(recipe=[{"stage": "compress", "args": compress_args("int8")}])
    assert _reference_source(None, plain, None, None, None) is None  # an IR: its own outputs
