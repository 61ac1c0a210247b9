"""The compress and quantize stages' child side with real NNCF, on models built here with the
OpenVINO API: a matmul chain for weight compression, a small CNN classifier for INT8
quantization with calibration data (farm/server/stages/compress.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import openvino as ov
import pytest
from openvino import opset13 as ops

from farm.core.calibration import load_samples
from farm.core.compression import (
    COMPRESS,
    QUANTIZE,
    calibration_files,
    compress_args,
    quantize_args,
)
from farm.core.errors import ConversionError
from farm.core.reference import InputSpec
from farm.server.stages.compress import OUTPUT_XML, run_stage, weight_count

pytest.importorskip("nncf")


def matmul_chain(layers: int = 4, width: int = 256, seed: int = 0) -> ov.Model:
    """Linear layers with ReLU between them; weights scaled so activations keep their size."""
    rng = np.random.default_rng(seed)
    x = ops.parameter([1, width], ov.Type.f32, name="x")
    value: ov.Node = x
    for index in range(layers):
        weights = (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
        value = ops.matmul(value, ops.constant(weights), False, True)
        if index < layers - 1:
            value = ops.relu(value)
    return ov.Model([value], [x], "matmul_chain")


def cnn_classifier(seed: int = 0) -> ov.Model:
    """conv → relu → conv → pool → linear → softmax over 10 classes."""
    rng = np.random.default_rng(seed)

    def weights(*shape: int, scale: float) -> ov.Node:
        return ops.constant((rng.standard_normal(shape) * scale).astype(np.float32))

    image = ops.parameter([1, 3, 16, 16], ov.Type.f32, name="image")
    value = ops.relu(
        ops.convolution(image, weights(16, 3, 3, 3, scale=0.3), [1, 1], [1, 1], [1, 1], [1, 1])
    )
    value = ops.relu(
        ops.convolution(value, weights(32, 16, 3, 3, scale=0.1), [2, 2], [1, 1], [1, 1], [1, 1])
    )
    value = ops.reduce_mean(value, ops.constant(np.array([2, 3], dtype=np.int64)), False)
    scores = ops.softmax(ops.matmul(value, weights(10, 32, scale=0.5), False, True), 1)
    return ov.Model([scores], [image], "cnn_classifier")


def save(model: ov.Model, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    ov.save_model(model, path, compress_to_fp16=False)
    return path


def _element_types(xml: Path) -> set[str]:
    model = ov.Core().read_model(xml)
    return {
        op.get_output_element_type(0).get_type_name()
        for op in model.get_ops()
        if op.get_type_name() == "Constant"
    }


def test_int8_weight_compression_quarters_the_weights_and_measures_its_drift(tmp_path):
    xml = save(matmul_chain(), tmp_path / "in" / "model.xml")
    result = run_stage(COMPRESS, compress_args("int8"), xml, tmp_path / "out", seed="k1")
    metrics = result.metrics
    assert set(result.files) == {"model.xml", "model.bin"}
    assert all(path.is_file() for path in result.files.values())
    assert metrics["size_before"] == xml.with_suffix(".bin").stat().st_size
    assert metrics["size_after"] == (tmp_path / "out" / "model.bin").stat().st_size
    assert metrics["ratio"] < 0.27
    assert "u8" in _element_types(tmp_path / "out" / OUTPUT_XML)
    assert metrics["weights"] == 4 * 256 * 256
    assert metrics["resolved"] == {"mode": "int8_asym"}
    drift = metrics["drift"]
    assert 0 < drift["max_abs_diff"] < 0.05  # compressed, so not identical; INT8, so close
    assert drift["min_cosine"] > 0.999
    assert drift["top1_agreement"] == 1.0  # [1, 256] is read as scores over 256 classes
    assert drift["samples"] == 1
    assert result.tool_versions["nncf"].startswith("3.")


def test_int4_sym_compresses_further_and_drifts_more(tmp_path):
    xml = save(matmul_chain(), tmp_path / "in" / "model.xml")
    int8 = run_stage(COMPRESS, compress_args("int8"), xml, tmp_path / "int8", seed="k")
    int4 = run_stage(COMPRESS, compress_args("int4-sym"), xml, tmp_path / "int4", seed="k")
    assert int4.metrics["ratio"] < 0.2  # the last layer stays INT8 (NNCF) unless all_layers
    assert int4.metrics["ratio"] < int8.metrics["ratio"]
    assert int4.metrics["drift"]["max_abs_diff"] > int8.metrics["drift"]["max_abs_diff"]
    assert int4.metrics["resolved"] == {
        "mode": "int4_sym",
        "group_size": 128,
        "ratio": 1.0,
        "all_layers": False,
    }
    every = run_stage(
        COMPRESS, compress_args("int4-sym", all_layers=True), xml, tmp_path / "all", seed="k"
    )
    assert every.metrics["ratio"] < int4.metrics["ratio"]


def test_the_npu_llm_preset_resolves_its_group_size_from_the_weight_count(tmp_path):
    model = matmul_chain(layers=2, width=128)
    assert weight_count(model) == 2 * 128 * 128
    xml = save(model, tmp_path / "in" / "model.xml")
    result = run_stage(COMPRESS, compress_args("npu-llm"), xml, tmp_path / "out", seed="k")
    assert result.metrics["resolved"]["group_size"] == 128  # small: grouped, not channel-wise
    assert result.metrics["resolved"]["mode"] == "int4_sym"


def test_drift_is_measured_on_the_given_reference_inputs(tmp_path):
    xml = save(matmul_chain(), tmp_path / "in" / "model.xml")
    rng = np.random.default_rng(1)
    inputs = [{"x": rng.standard_normal((1, 256)).astype(np.float32)} for _ in range(3)]
    result = run_stage(
        COMPRESS, compress_args("int8"), xml, tmp_path / "out", reference_inputs=inputs
    )
    assert result.metrics["drift"]["samples"] == 3


def test_nncf_refusing_the_arguments_fails_the_stage_with_its_reason(tmp_path):
    xml = save(matmul_chain(layers=2, width=96), tmp_path / "in" / "model.xml")
    with pytest.raises(ConversionError, match="NNCF refused"):
        run_stage(
            COMPRESS, compress_args("int4-sym", group_size=64), xml, tmp_path / "out", seed="k"
        )
    assert not (tmp_path / "out" / OUTPUT_XML).exists()


def test_int8_quantization_with_calibration_data_keeps_the_classes(tmp_path):
    xml = save(cnn_classifier(), tmp_path / "in" / "model.xml")
    calibration = tmp_path / "calibration"
    calibration.mkdir()
    rng = np.random.default_rng(2)
    np.save(calibration / "batch.npy", rng.standard_normal((24, 3, 16, 16)).astype(np.float32))
    samples = load_samples(
        calibration_files(calibration), [InputSpec("image", (1, 3, 16, 16), "float32")]
    )
    assert len(samples) == 24
    args = quantize_args("int8", {"batch.npy": "cd" * 32})
    result = run_stage(QUANTIZE, args, xml, tmp_path / "out", calibration=samples, seed="q")
    out_xml = tmp_path / "out" / OUTPUT_XML
    ops_out = {op.get_type_name() for op in ov.Core().read_model(out_xml).get_ops()}
    assert "FakeQuantize" in ops_out
    metrics = result.metrics
    assert metrics["resolved"] == {"precision": "int8", "device": "NPU", "calibration_samples": 24}
    drift = metrics["drift"]
    assert drift["samples"] == 25  # the seeded reference input, then the calibration samples
    assert drift["top1_agreement"] >= 0.8
    assert drift["min_cosine"] > 0.99
    assert 0 < drift["max_abs_diff"] < 0.1


def test_quantize_without_samples_is_refused(tmp_path):
    xml = save(cnn_classifier(), tmp_path / "in" / "model.xml")
    with pytest.raises(ConversionError, match="no calibration samples"):
        run_stage(QUANTIZE, quantize_args("int8", {"a.npy": "cd" * 32}), xml, tmp_path / "out")


def test_a_model_too_large_to_run_within_the_memory_limit_is_compressed_without_drift(tmp_path):
    xml = save(matmul_chain(), tmp_path / "in" / "model.xml")
    result = run_stage(
        COMPRESS, compress_args("int8"), xml, tmp_path / "out", seed="k", memory_bytes=1 << 20
    )
    assert result.metrics["drift"] is None
    assert result.metrics["drift_note"].startswith("drift not measured: a CPU run of this")
    assert result.metrics["ratio"] < 0.27


CHILD_WITHOUT_TORCH = """
import json, sys
from pathlib import Path
import numpy as np
from farm.core.compression import COMPRESS, QUANTIZE, compress_args, quantize_args
from farm.server.stages import compress
folder = Path(sys.argv[1])
compress.prepare({}, switching_user=True)  # as the stage child does: NNCF and its warm-up
samples = [{"image": np.full((1, 3, 16, 16), i / 10, np.float32)} for i in range(10)]
int4 = compress.run_stage(
    COMPRESS, compress_args("int4-sym", group_size=32), folder / "chain.xml", folder / "int4"
)
int8 = compress.run_stage(
    QUANTIZE, quantize_args("int8", {"a.npy": "cd" * 32}), folder / "cnn.xml", folder / "q",
    calibration=samples,
)
torch = sys.modules.get("torch", "absent")
print(json.dumps({"torch": repr(torch), "ratio": int4.metrics["ratio"],
                  "drift": [int4.metrics["drift"], int8.metrics["drift"]]}))
"""


def test_the_stage_child_compresses_and_quantizes_without_importing_torch(tmp_path):
    # NNCF imports torch when it is installed; the stage child keeps it out (time, memory)
    # and NNCF's OpenVINO backend must work all the same, warm-up included.
    import json
    import subprocess
    import sys

    save(matmul_chain(), tmp_path / "chain.xml")
    save(cnn_classifier(), tmp_path / "cnn.xml")
    done = subprocess.run(
        [sys.executable, "-c", CHILD_WITHOUT_TORCH, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["torch"] in ("None", "'absent'")
    assert result["ratio"] < 0.2
    for drift in result["drift"]:
        assert 0 < drift["max_abs_diff"] < 0.5 and drift["min_cosine"] > 0.95
