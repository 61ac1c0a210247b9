"""compiler.py with the real OpenVINO: CPU round trips, and the NPU path up to the compiler."""

from __future__ import annotations

import numpy as np
import openvino as ov
import pytest

from farm import prepare, toolchain
from farm.core import errors
from farm.core.blobformat import BlobFormatError, read_header
from farm.core.hashing import model_files
from farm.core.spec import CompileSpec, Target
from farm.edge import import_blob, infer_once
from farm.server.jobs import compiler
from tests import models


def ir(tmp_path, model: ov.Model, name: str = "model"):
    return model_files(models.save_ir(model, tmp_path / "models" / f"{name}.xml"))


def compile_cpu(tmp_path, files, **spec):
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    return compiler.compile_to_file(files, CompileSpec.create("CPU", **spec), out, "k" * 64)


@pytest.mark.parametrize(
    ("build", "spec"),
    [
        (models.conv_net, {}),
        (models.transformer_block, {"performance_hint": "latency"}),
        (models.dynamic_net, {"shapes": ["image[2,3,16,16]"]}),
        (models.dynamic_net, {"batch": 3, "layout": ["image:NCHW"]}),
    ],
    ids=["conv", "transformer", "dynamic-reshaped", "dynamic-batched"],
)
def test_cpu_compile_export_import_round_trip(tmp_path, build, spec):
    model = build()
    files = ir(tmp_path, model)
    result = compile_cpu(tmp_path, files, **spec)

    assert result.blob_path.is_file()
    assert result.size_bytes == result.blob_path.stat().st_size
    assert result.toolchain.openvino == toolchain.openvino_release()
    assert result.toolchain.runtime_requirements.startswith("meta=")
    assert result.toolchain.npu_compiler is None
    assert result.compile_seconds > 0 and result.export_seconds >= 0
    assert result.peak_rss_bytes > 10 * 2**20

    # The payload after the cache header is exactly what export_model() gives.
    payload = result.blob_path.read_bytes()[result.payload_offset :]
    assert payload[:8] == b"RR_UPCVO"  # "OVCPU_RR" as a little-endian magic

    imported = import_blob(result.blob_path, "CPU")
    reference = ov.Core().read_model(str(files["xml"]), str(files["bin"]))
    prepare.apply_shapes(reference, CompileSpec.create("CPU", **spec))
    expected_shapes = [str(port.get_partial_shape()) for port in reference.inputs]
    got_shapes = [str(port.get_partial_shape()) for port in imported.compiled.inputs]
    assert got_shapes == expected_shapes
    assert infer_once(imported)["latency_seconds"] > 0


def test_imported_blob_computes_what_the_model_computes(tmp_path):
    model = models.conv_net(seed=3)
    files = ir(tmp_path, model)
    result = compile_cpu(tmp_path, files)
    data = np.random.default_rng(1).random((1, 3, 32, 32), dtype=np.float32)
    expected = ov.Core().compile_model(model, "CPU")(data)[0]
    got = import_blob(result.blob_path, "CPU").compiled(data)[0]
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def test_the_blobs_map_lives_as_long_as_the_compiled_model_whoever_keeps_it(tmp_path):
    """OpenVINO may run weights in place from the imported map: a caller keeping only
    `.compiled` once crashed the process at its next inference (tests/integration/
    test_sources.py, on AMD EPYC). The map now goes only with the compiled model."""
    import gc
    import weakref

    model = models.conv_net(seed=4)
    result = compile_cpu(tmp_path, ir(tmp_path, model))
    data = np.random.default_rng(2).random((1, 3, 32, 32), dtype=np.float32)
    imported = import_blob(result.blob_path, "CPU")
    compiled, mapping = imported.compiled, weakref.ref(imported.mapping)
    del imported
    gc.collect()
    assert mapping() is not None  # still mapped: the compiled model may read it
    expected = ov.Core().compile_model(model, "CPU")(data)[0]
    np.testing.assert_allclose(compiled(data)[0], expected, rtol=1e-4, atol=1e-5)
    del compiled
    gc.collect()
    assert mapping() is None  # and released with it


def test_weightless_blob_is_small_and_imports_with_the_models_bin(tmp_path):
    files = ir(tmp_path, models.transformer_block(width=64))
    full = compile_cpu(tmp_path, files)
    (tmp_path / "out2").mkdir()
    light = compiler.compile_to_file(
        files, CompileSpec.create("CPU", weightless=True), tmp_path / "out2", "w" * 64
    )
    assert light.properties["CACHE_MODE"] == "OPTIMIZE_SIZE"
    assert light.size_bytes < full.size_bytes / 2
    data = np.random.default_rng(0).random((1, 16, 32 * 2), dtype=np.float32)
    expected = import_blob(full.blob_path, "CPU").compiled(data)[0]
    got = import_blob(light.blob_path, "CPU", weights_path=files["bin"]).compiled(data)[0]
    np.testing.assert_allclose(got, expected, rtol=1e-5)


def test_compile_refuses_a_folder_that_already_holds_the_blob(tmp_path):
    files = ir(tmp_path, models.conv_net())
    compile_cpu(tmp_path, files)
    with pytest.raises(FileExistsError):
        compile_cpu(tmp_path, files)


def test_onnx_is_read(tmp_path):
    import onnx
    from onnx import TensorProto, helper

    node = helper.make_node("Relu", ["x"], ["y"])
    graph = helper.make_graph(
        [node],
        "relu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
    )
    path = tmp_path / "relu.onnx"
    onnx.save(helper.make_model(graph), path)
    result = compile_cpu(tmp_path, model_files(path))
    assert import_blob(result.blob_path, "CPU").compiled.inputs[0].get_any_name() == "x"


# --- bad input: each is a ModelError with a message a person can act on -------------------


def test_truncated_weights_are_a_model_error(tmp_path):
    files = ir(tmp_path, models.conv_net())
    data = files["bin"].read_bytes()
    files["bin"].write_bytes(data[: len(data) // 2])
    with pytest.raises(errors.ModelError, match="Incorrect weights in bin file"):
        prepare.check_model(files, CompileSpec.create("CPU"))


@pytest.mark.parametrize(
    "content", [b"<net><layers>", b"", b"\x00\xff garbage"], ids=["malformed", "empty", "binary"]
)
def test_unreadable_xml_is_a_model_error(tmp_path, content):
    files = ir(tmp_path, models.conv_net())
    files["xml"].write_bytes(content)
    with pytest.raises(errors.ModelError, match="cannot read model"):
        prepare.check_model(files, CompileSpec.create("CPU"))


def test_shape_for_a_missing_input_names_the_real_inputs(tmp_path):
    files = ir(tmp_path, models.conv_net())
    spec = CompileSpec.create("CPU", shapes=["nope[1,3,32,32]"])
    with pytest.raises(errors.ModelError, match=r"no input 'nope'.*its inputs are: x"):
        prepare.check_model(files, spec)


def test_bare_shape_needs_a_single_input_model(tmp_path):
    files = ir(tmp_path, models.two_input_net())
    with pytest.raises(errors.ModelError, match="2 inputs"):
        prepare.check_model(files, CompileSpec.create("CPU", shapes=["[1,8]"]))


def test_shape_of_the_wrong_rank_is_a_model_error(tmp_path):
    files = ir(tmp_path, models.conv_net())
    with pytest.raises(errors.ModelError, match="cannot reshape"):
        prepare.check_model(files, CompileSpec.create("CPU", shapes=["x[1,3]"]))


def test_batch_without_a_known_layout_asks_for_layout(tmp_path):
    files = ir(tmp_path, models.dynamic_net())
    with pytest.raises(errors.ModelError, match="--layout"):
        prepare.check_model(files, CompileSpec.create("CPU", batch=2))


def test_batch_goes_on_the_layouts_axis_not_axis_zero(tmp_path):
    model = models.dynamic_net()
    files = ir(tmp_path, model)
    # Declare the batch on axis 2: the layout, not a convention, decides.
    spec = CompileSpec.create("CPU", batch=5, layout=["image:CHN?"])
    assert prepare.check_model(files, spec) == ["image[?,3,5,?]"]


# --- NPU: everything up to the compiler call ----------------------------------------------


def test_npu_properties_are_built_from_the_spec():
    spec = CompileSpec.create(
        "4000",
        tiles=4,
        performance_hint="throughput",
        compiler_params="performance-hint-override=latency optimization-level=2",
        weightless=True,
        config=["NPU_BATCH_MODE=plugin"],
    )
    assert toolchain.compile_properties(spec) == {
        "NPU_PLATFORM": "4000",
        "NPU_MAX_TILES": "6",
        "NPU_TILES": "4",
        "NPU_COMPILATION_MODE_PARAMS": "optimization-level=2 performance-hint-override=latency",
        "PERFORMANCE_HINT": "THROUGHPUT",
        "CACHE_MODE": "OPTIMIZE_SIZE",
        "NPU_BATCH_MODE": "PLUGIN",
    }


def test_a_batched_npu_spec_is_compiled_at_its_batch_unless_told_otherwise():
    batched = CompileSpec.create("3720", batch=4, layout=["x:NCHW"])
    assert toolchain.compile_properties(batched)["NPU_BATCH_MODE"] == "COMPILER"
    plugin = CompileSpec.create(
        "3720", batch=4, layout=["x:NCHW"], config=["NPU_BATCH_MODE=PLUGIN"]
    )
    assert toolchain.compile_properties(plugin)["NPU_BATCH_MODE"] == "PLUGIN"
    assert "NPU_BATCH_MODE" not in toolchain.compile_properties(CompileSpec.create("3720"))


def test_cpu_properties_carry_no_npu_keys():
    spec = CompileSpec.create("CPU", performance_hint="latency")
    assert toolchain.compile_properties(spec) == {"PERFORMANCE_HINT": "LATENCY"}


def test_npu_rejects_a_dynamic_model_naming_each_dynamic_dimension(tmp_path):
    files = ir(tmp_path, models.dynamic_net())
    with pytest.raises(errors.ModelError) as caught:
        prepare.check_model(files, CompileSpec.create("NPU.4000"))
    message = str(caught.value)
    assert "NPU.4000 needs static shapes" in message
    assert "image[?,3,?,?] (dimension 0, 2, 3)" in message
    assert "for example --shape image[1,3,1,1]" in message


def test_the_static_shape_hint_of_a_partly_dynamic_model_names_its_dynamic_input(tmp_path):
    static = ov.opset13.parameter([1, 8], ov.Type.f32, name="a")
    dynamic = ov.opset13.parameter(ov.PartialShape([1, -1]), ov.Type.f32, name="state")
    model = ov.Model([ov.opset13.concat([static, dynamic], 1)], [static, dynamic], "partly")
    files = ir(tmp_path, model)
    with pytest.raises(errors.ModelError) as caught:
        prepare.check_model(files, CompileSpec.create("NPU.4000"))
    message = str(caught.value)
    assert "these inputs are dynamic: state[1,?] (dimension 1)." in message
    assert message.endswith("for example --shape state[1,1]")


def test_npu_compile_without_the_compiler_names_the_missing_library(tmp_path):
    files = ir(tmp_path, models.conv_net())
    (tmp_path / "out").mkdir()
    spec = CompileSpec.create("NPU.4000", tiles=2)
    assert prepare.check_model(files, spec) == ["x[1,3,32,32]"]
    with pytest.raises(errors.CompilerUnavailable, match=toolchain.NPU_COMPILER_LIBRARY):
        compiler.compile_to_file(files, spec, tmp_path / "out", "n" * 64)
    assert list((tmp_path / "out").iterdir()) == []  # no blob, and certainly no CPU blob


def test_npu_driver_compiler_without_a_device_says_so(tmp_path):
    files = ir(tmp_path, models.conv_net())
    (tmp_path / "out").mkdir()
    spec = CompileSpec.create("NPU.3720", config=["NPU_COMPILER_TYPE=DRIVER"])
    with pytest.raises(errors.CompilerUnavailable, match="no NPU device"):
        compiler.compile_to_file(files, spec, tmp_path / "out", "d" * 64)


def test_probe_compiles_cpu_and_reports_why_npu_cannot():
    probe = toolchain.probe_targets()
    assert probe["CPU"] is None
    for name in ("NPU.3720", "NPU.4000", "NPU.5010", "NPU.5020"):
        assert toolchain.NPU_COMPILER_LIBRARY in probe[name]


def test_host_toolchain_for_cpu_matches_what_a_compile_records(tmp_path):
    files = ir(tmp_path, models.conv_net())
    result = compile_cpu(tmp_path, files)
    assert toolchain.host_toolchain(Target.parse("CPU")) == result.toolchain


def test_a_file_that_is_not_a_blob_is_refused(tmp_path):
    path = tmp_path / "x.blob"
    path.write_bytes(b"not a blob at all")
    with pytest.raises(BlobFormatError):
        read_header(path)


def test_a_cpu_blob_is_imported_with_the_properties_of_its_signed_spec(tmp_path):
    """The CPU plugin takes the inference precision and execution mode from the import's
    config, not from the blob: a blob is imported with its spec's properties again (on an AMX
    CPU, an f32 blob imported without them ran parts of its graph in bf16), and only with a
    spec its signed cache key was computed from."""
    import dataclasses

    from farm.core.hashing import cache_key
    from farm.edge.importer import import_config
    from farm.edge.verify import run_precision

    files = ir(tmp_path, models.conv_net(seed=3))
    model = {"xml": "1" * 64, "bin": "2" * 64}

    def record(spec: CompileSpec, toolchain) -> dict:
        key = cache_key(model, "CPU", spec.canonical(), toolchain.key_part(spec.target))
        return {
            "cache_key": key,
            "target": "CPU",
            "spec": spec.canonical(),
            "toolchain": dataclasses.asdict(toolchain),
            "model": model,
        }

    for config, precision in (
        ("INFERENCE_PRECISION_HINT=f32", "f32"),
        ("EXECUTION_MODE_HINT=ACCURACY", "f32"),
    ):
        name, value = config.split("=")
        spec = CompileSpec.create("CPU", config=[config], performance_hint="throughput")
        (tmp_path / name).mkdir()
        result = compile_cpu(
            tmp_path / name, files, config=spec.config, performance_hint="throughput"
        )
        signed = record(spec, result.toolchain)
        assert import_config(signed) == {name: value, "PERFORMANCE_HINT": "THROUGHPUT"}
        imported = import_blob(result.blob_path, "CPU", config=import_config(signed))
        got = imported.compiled.get_property(name)
        assert (got.get_type_name() if isinstance(got, ov.Type) else got.name) == value
        assert run_precision(imported.compiled) == precision  # the tolerance row it is judged by
        # A spec the key was not computed from (the record's spec is not signed): nothing.
        altered = {**signed, "spec": {**signed["spec"], "config": {name: "bf16"}}}
        assert import_config(altered) == {}
        assert import_config({**signed, "spec": "f32"}) == {}
        assert import_config({**signed, "spec": None}) == {}
        # A recipe's key holds its last stage, not the record's model digests: only the spec
        # the caller computed the key from itself (`farm.edge.compile_model`, channels) counts.
        staged = {**signed, "cache_key": "3" * 64}
        assert import_config(staged) == {}
        assert import_config(staged, spec) == {name: value, "PERFORMANCE_HINT": "THROUGHPUT"}
