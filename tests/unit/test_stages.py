"""The pure rules of sources and stages (docs/architecture.md §15): format detection, canonical
stage arguments, stage keys and the key's model part, recipes checked against their source,
queue names by converter. No framework, no OpenVINO: the edge runs all of this."""

from __future__ import annotations

import json
import pickle
import zipfile
from pathlib import Path

import pytest

from farm.core import sources, stages
from farm.core.errors import ModelFileError, SpecError
from farm.core.identity import ModelRef, key_for
from farm.core.spec import CompileSpec, Toolchain
from farm.server import routing

TOOLCHAIN = Toolchain("2026.4.1", runtime_requirements="rr")


def _zip(path: Path, names: list[str]) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        for name in names:
            archive.writestr(name, b"x")
    return path


def _hf(folder: Path, config: dict | None = None, weights: str = "model.safetensors") -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps(config or {"architectures": ["GPT2LMHeadModel"]})
    )
    (folder / weights).write_bytes(b"w")
    return folder


# --- detection ----------------------------------------------------------------------------------


def test_each_format_is_detected_with_its_roles(tmp_path):
    (tmp_path / "m.tflite").write_bytes(b"t")
    (tmp_path / "m.pdmodel").write_bytes(b"p")
    (tmp_path / "m.pdiparams").write_bytes(b"w")
    (tmp_path / "g.pb").write_bytes(b"g")
    saved = tmp_path / "saved"
    (saved / "variables").mkdir(parents=True)
    (saved / "saved_model.pb").write_bytes(b"s")
    (saved / "variables" / "variables.index").write_bytes(b"i")
    pt2 = _zip(tmp_path / "m.pt2", ["m/archive_format", "m/models/model.json"])
    script = _zip(tmp_path / "m.pt", ["m/code/__torch__.py", "m/constants.pkl", "m/data.pkl"])
    hf = _hf(tmp_path / "hf")
    found = {
        path.name: (s.format, sorted(s.files))
        for path in (
            tmp_path / "m.tflite",
            tmp_path / "m.pdmodel",
            tmp_path / "g.pb",
            saved,
            pt2,
            script,
            hf,
        )
        for s in [sources.detect(path)]
    }
    assert found == {
        "m.tflite": ("tflite", ["tflite"]),
        "m.pdmodel": ("paddle", ["pdiparams", "pdmodel"]),
        "g.pb": ("pb", ["pb"]),
        "saved": ("savedmodel", ["saved_model.pb", "variables/variables.index"]),
        "m.pt2": ("pt2", ["pt2"]),
        "m.pt": ("torchscript", ["torchscript"]),
        "hf": ("huggingface", ["config.json", "model.safetensors"]),
    }
    # The weights file, saved_model.pb and config.json name their model too.
    assert sources.detect(tmp_path / "m.pdiparams").format == "paddle"
    assert sources.detect(saved / "saved_model.pb").format == "savedmodel"
    assert sources.detect(hf / "config.json").format == "huggingface"


def test_paddle3_json_program_is_a_paddle_source(tmp_path):
    (tmp_path / "model.json").write_text("{}")
    (tmp_path / "model.pdiparams").write_bytes(b"w")
    source = sources.detect(tmp_path / "model.json")
    assert (source.format, sorted(source.files)) == ("paddle", ["json", "pdiparams"])


def test_an_unknown_file_names_the_supported_formats(tmp_path):
    (tmp_path / "model.h5").write_bytes(b"h")
    with pytest.raises(ModelFileError, match=r"model\.h5.*TensorFlow Lite \(\.tflite\)"):
        sources.detect(tmp_path / "model.h5")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelFileError, match=r"neither saved_model\.pb"):
        sources.detect(tmp_path / "empty")


def test_a_missing_companion_file_is_named(tmp_path):
    (tmp_path / "m.pdmodel").write_bytes(b"p")
    with pytest.raises(ModelFileError, match=r"m\.pdiparams: its weights file does not exist"):
        sources.detect(tmp_path / "m.pdmodel")
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    with pytest.raises(ModelFileError, match="without weights"):
        sources.detect(folder)


def test_a_pickled_torch_module_is_refused_with_how_to_export(tmp_path):
    plain = tmp_path / "plain.pt"
    plain.write_bytes(pickle.dumps({"weights": [1, 2]}, protocol=4))
    new_style = _zip(tmp_path / "zipped.pt", ["zipped/data.pkl", "zipped/data/0", "zipped/version"])
    for path in (plain, new_style):
        with pytest.raises(ModelFileError, match=r"pickled PyTorch object.*torch\.export\.save"):
            sources.detect(path)


def test_a_truncated_torch_archive_is_named(tmp_path):
    whole = _zip(tmp_path / "m.pt2", ["m/archive_format", "m/models/model.json"])
    cut = tmp_path / "cut.pt2"
    cut.write_bytes(whole.read_bytes()[:30])
    with pytest.raises(ModelFileError, match=r"cut\.pt2: a truncated or corrupt PyTorch archive"):
        sources.detect(cut)


def test_links_out_of_a_folder_are_refused(tmp_path):
    folder = _hf(tmp_path / "hf")
    (tmp_path / "secret").write_text("s")
    (folder / "tokenizer.json").symlink_to(tmp_path / "secret")
    with pytest.raises(ModelFileError, match="a link out of the model folder"):
        sources.detect(folder)


def test_folder_files_are_safe_relative_paths():
    assert sources.layout({"xml": 1, "a/b.json": 2}) == {"xml": "model.xml", "a/b.json": "a/b.json"}
    for bad in ("../x", "/etc/passwd", "a/../../b", "a//b", "a\\b"):
        with pytest.raises(ModelFileError):
            sources.layout({bad: 1})


def test_custom_code_and_task_of_a_hugging_face_folder(tmp_path):
    plain = sources.detect(_hf(tmp_path / "plain"))
    assert sources.hf_custom_code(plain) == []
    assert sources.hf_task(plain) == "text-generation-with-past"
    custom = _hf(tmp_path / "custom", {"auto_map": {"AutoModel": "m.MyModel"}})
    (custom / "m.py").write_text("import os")
    assert sources.hf_custom_code(sources.detect(custom)) == ["m.py", "config.json: auto_map"]
    assert sources.hf_task(sources.detect(custom)) is None


# --- stages -------------------------------------------------------------------------------------


def test_two_spellings_of_a_convert_stage_are_one_stage():
    a = stages.Stage.create(
        "convert", {"format": "torchscript", "example-input": "x[1, 3,8,8]:float32; [2]:i64"}
    )
    b = stages.Stage.create(
        "convert",
        {
            "format": "torchscript",
            "example_input": [
                {"name": "x", "shape": [1, 3, 8, 8], "dtype": "f32"},
                {"shape": [2], "dtype": "int64"},
            ],
        },
    )
    assert a == b
    assert a.args["example_input"] == [
        {"name": "x", "shape": [1, 3, 8, 8], "dtype": "f32"},
        {"name": "", "shape": [2], "dtype": "i64"},
    ]
    assert stages.stage_key({"model": {"pt": "0" * 64}}, a) == stages.stage_key(
        {"model": {"pt": "0" * 64}}, b
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"format": "tflite", "level": 3}, "not \\['level'\\]"),
        ({"format": "caffe"}, "unknown source format"),
        ({"format": "tflite", "example_input": "x[1]"}, "for PyTorch sources"),
        ({"format": "pt2", "task": "fill-mask"}, "for Hugging Face"),
        ({"format": "huggingface"}, "needs its task"),
        ({"format": "pt2", "example_input": "x[1,0]"}, "each 1.."),
        ({"format": "pt2", "example_input": "x[1]:complex"}, "unknown type"),
        ({"format": "pt2", "example_input": "x(1,2)"}, "write NAME"),
        ({"format": "pt2", "example_input": "x[1];x[2]"}, "names an input twice"),
        ({"format": "huggingface", "task": "Text Generation"}, "a task name"),
    ],
)
def test_bad_stage_arguments_are_refused(args, message):
    with pytest.raises(SpecError, match=message):
        stages.Stage.create("convert", args)


def test_an_unknown_stage_kind_names_the_known_ones():
    with pytest.raises(SpecError, match="unknown stage 'quantize'; known stages: convert"):
        stages.Stage.create("quantize", {})


def test_stage_keys_chain_and_the_model_part(tmp_path):
    identity = {"tflite": "a" * 64}
    convert = stages.convert_stage("tflite")
    first = stages.stage_key({"model": identity}, convert)
    assert stages.stage_keys(identity, [convert, convert]) == [
        first,
        stages.stage_key({"stage": first}, convert),
    ]
    assert stages.model_part(identity, ()) == identity
    assert stages.model_part(identity, [convert]) == {"stage": first}
    spec = CompileSpec.create("CPU")
    assert key_for(identity, spec, TOOLCHAIN) != key_for(identity, spec, TOOLCHAIN, (convert,))
    # The input is part of the key: the same stage on another source is another stage.
    assert first != stages.stage_key({"model": {"tflite": "b" * 64}}, convert)


def test_the_recipe_a_source_needs(tmp_path):
    (tmp_path / "m.xml").write_text("<net/>")
    (tmp_path / "m.bin").write_bytes(b"")
    (tmp_path / "m.tflite").write_bytes(b"t")
    ir = sources.detect(tmp_path / "m.xml")
    assert stages.recipe_for(ir) == ()
    with pytest.raises(SpecError, match="for sources to convert"):
        stages.recipe_for(ir, ["x[1]"])
    assert stages.recipe_for(sources.detect(tmp_path / "m.tflite")) == (
        stages.Stage("convert", {"format": "tflite"}),
    )
    hf = sources.detect(_hf(tmp_path / "hf", {"architectures": ["Mystery"]}))
    with pytest.raises(SpecError, match="give --task"):
        stages.recipe_for(hf)
    assert stages.recipe_for(hf, task="fill-mask")[0].args["task"] == "fill-mask"


def test_a_submitted_recipe_must_fit_its_files():
    tflite = {"tflite": "a" * 64}
    convert = [{"stage": "convert", "args": {"format": "tflite"}}]
    assert stages.source_recipe(tflite, convert)[0].kind == "convert"
    with pytest.raises(SpecError, match="needs one convert stage"):
        stages.source_recipe(tflite, [])
    with pytest.raises(SpecError, match="is for pt2, but the files are tflite"):
        stages.source_recipe(tflite, [{"stage": "convert", "args": {"format": "pt2"}}])
    with pytest.raises(SpecError, match="compiled as it is"):
        stages.source_recipe({"onnx": "a" * 64}, convert)
    with pytest.raises(ModelFileError):
        stages.source_recipe({"mystery": "a" * 64}, convert)
    with pytest.raises(ModelFileError):
        stages.source_recipe(
            {"config.json": "a" * 64, "../escape.bin": "b" * 64},
            [{"stage": "convert", "args": {"format": "huggingface", "task": "fill-mask"}}],
        )


def test_model_ref_carries_its_recipe_into_its_key(tmp_path):
    (tmp_path / "m.tflite").write_bytes(b"t")
    ref = ModelRef.from_source(tmp_path / "m.tflite")
    converted = ref.with_recipe(stages.recipe_for(sources.detect(tmp_path / "m.tflite")))
    assert ref.key_model == ref.identity
    assert converted.key_model == {"stage": stages.stage_keys(ref.identity, converted.recipe)[0]}
    assert converted.info.recipe == converted.recipe


# --- routing by converter -----------------------------------------------------------------------


def test_jobs_that_need_a_converter_go_to_workers_that_have_it():
    part = {"openvino": "2026.4.1", "runtime_requirements": "rr"}
    torch_queue = routing.queue_name("CPU", part, needs=["torch"])
    assert torch_queue.endswith(".with-torch")
    assert routing.needs_of(torch_queue) == ["torch"]
    assert routing.needs_of(routing.queue_name("CPU", part)) == []
    plain = routing.worker_queues({"CPU": part}, 2**30, 2**40)
    assert torch_queue not in plain
    serving = routing.worker_queues({"CPU": part}, 2**30, 2**40, ["torch", "optimum"])
    assert torch_queue in serving
    assert routing.queue_name("CPU", part, needs=["torch", "optimum"]) in serving
    assert routing.queue_name("CPU", part) in serving


def test_a_job_no_worker_can_convert_names_the_converter_and_the_extra():
    part = {"openvino": "2026.4.1", "runtime_requirements": "rr"}

    class QueuedJob:
        queue = routing.queue_name("CPU", part, needs=["torch"])
        toolchain, target = part, "CPU"

    note = routing.note_for(QueuedJob, {routing.queue_name("CPU", part)})
    assert note is not None
    assert "no converter torch" in note
    assert "pip install 'farm[convert]'" in note
