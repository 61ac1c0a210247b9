"""Pipeline folders, GenAI options and the bundle key (farm/core/pipelines.py): pure rules."""

from __future__ import annotations

from pathlib import Path

import pytest

from farm.core.errors import PipelineError
from farm.core.pipelines import (
    GenAIOptions,
    bundle_key,
    check_memory,
    compile_memory_bytes,
    context_length,
    detect,
    export_record,
    identity,
    part_identity,
    part_key,
    toolchain_part,
)
from farm.core.spec import Target

CPU = Target.parse("CPU")
NPU = Target.parse("4000")


def _ir(path: Path, optimum: str = "2.2.0", weights: bytes = b"w") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        '<?xml version="1.0"?>\n<net name="m" version="11"><layers/><edges/>\n<rt_info>\n'
        '<Runtime_version value="2026.4.1" />\n'
        f'<optimum><optimum_intel_version value="{optimum}" /></optimum>\n</rt_info>\n</net>\n'
    )
    path.with_suffix(".bin").write_bytes(weights)


def _llm(root: Path) -> Path:
    for name in ("openvino_model", "openvino_tokenizer", "openvino_detokenizer"):
        _ir(root / f"{name}.xml")
    (root / "config.json").write_text('{"max_position_embeddings": 512}')
    (root / "README.md").write_text("not read by GenAI")
    return root


def _whisper(root: Path) -> Path:
    for name in ("encoder_model", "decoder_model", "tokenizer", "detokenizer"):
        _ir(root / f"openvino_{name}.xml")
    return root


def _text2image(root: Path, denoiser: str = "unet") -> Path:
    (root / "model_index.json").parent.mkdir(parents=True, exist_ok=True)
    (root / "model_index.json").write_text("{}")
    for sub in ("text_encoder", denoiser, "vae_decoder"):
        _ir(root / sub / "openvino_model.xml")
    _ir(root / "tokenizer" / "openvino_tokenizer.xml")
    return root


def test_recognises_each_kind_from_its_files(tmp_path: Path) -> None:
    llm = detect(_llm(tmp_path / "llm"))
    assert llm.kind == "llm" and llm.parts == {"language": "openvino_model.xml"}
    assert "README.md" not in llm.files and "config.json" in llm.files
    whisper = detect(_whisper(tmp_path / "whisper"))
    assert whisper.kind == "whisper"
    assert whisper.parts == {
        "encoder": "openvino_encoder_model.xml",
        "decoder": "openvino_decoder_model.xml",
    }
    image = detect(_text2image(tmp_path / "sd3", denoiser="transformer"))
    assert image.kind == "text2image"
    assert image.parts["denoiser"] == "transformer/openvino_model.xml"
    assert "tokenizer/openvino_tokenizer.bin" in image.files


def test_pipeline_flag_checks_the_folder_is_that_kind(tmp_path: Path) -> None:
    folder = _llm(tmp_path / "llm")
    with pytest.raises(PipelineError, match=r"openvino_encoder_model\.xml: the whisper"):
        detect(folder, "whisper")
    with pytest.raises(PipelineError, match="--pipeline 'tts': not a pipeline kind"):
        detect(folder, "tts")


def test_refusals_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(PipelineError, match="not a GenAI pipeline folder"):
        detect(tmp_path)
    folder = _llm(tmp_path / "llm")
    (folder / "openvino_detokenizer.xml").unlink()
    with pytest.raises(PipelineError, match=r"openvino_detokenizer\.xml: the llm pipeline's det"):
        detect(folder)
    folder = _llm(tmp_path / "llm2")
    (folder / "openvino_tokenizer.xml").unlink()
    with pytest.raises(PipelineError, match=r"openvino_tokenizer\.xml: the llm pipeline's tok"):
        detect(folder)
    folder = _llm(tmp_path / "llm3")
    (folder / "openvino_model.bin").unlink()
    with pytest.raises(PipelineError, match=r"openvino_model\.bin: the weights of"):
        detect(folder)
    folder = _text2image(tmp_path / "sd")
    (folder / "vae_decoder" / "openvino_model.xml").unlink()
    with pytest.raises(PipelineError, match=r"vae_decoder/openvino_model\.xml: the text2image"):
        detect(folder)


def test_sub_models_of_different_exports_are_refused(tmp_path: Path) -> None:
    folder = _whisper(tmp_path / "w")
    _ir(folder / "openvino_decoder_model.xml", optimum="1.26.0")
    assert export_record(folder / "openvino_decoder_model.xml") == {
        "Runtime_version": "2026.4.1",
        "optimum_intel_version": "1.26.0",
    }
    with pytest.raises(PipelineError, match=r"mismatched sub-models: the decoder .* 1\.26\.0"):
        detect(folder)


def test_options_canonical_two_spellings_one_key() -> None:
    a = GenAIOptions.create("llm", NPU, max_prompt_len=200, generate_hint="best-perf")
    b = GenAIOptions.create("llm", NPU, max_prompt_len=256, generate_hint="BEST_PERF")
    assert (
        a.canonical()
        == b.canonical()
        == {
            "cache_mode": "OPTIMIZE_SPEED",
            "max_prompt_len": 256,
            "min_response_len": 128,
            "generate_hint": "BEST_PERF",
            "prefill_hint": "DYNAMIC",
        }
    )
    assert (
        GenAIOptions.create("llm", NPU).canonical()
        == GenAIOptions.create(
            "llm", NPU, max_prompt_len=1024, min_response_len=100, prefill_hint="dynamic"
        ).canonical()
    )
    weightless = GenAIOptions.create("whisper", NPU, weightless=True)
    assert weightless.canonical() == {"cache_mode": "OPTIMIZE_SIZE"}
    assert weightless.properties() == {"CACHE_MODE": "OPTIMIZE_SIZE", "NPU_PLATFORM": "4000"}
    cpu = GenAIOptions.create("llm", CPU)
    assert cpu.properties() == {"CACHE_MODE": "OPTIMIZE_SPEED", "ATTENTION_BACKEND": "SDPA"}


def test_option_refusals_name_the_option() -> None:
    with pytest.raises(PipelineError, match="--max-prompt-len applies to NPU targets only"):
        GenAIOptions.create("llm", CPU, max_prompt_len=128)
    with pytest.raises(PipelineError, match="--generate-hint applies to LLM and VLM pipelines"):
        GenAIOptions.create("whisper", NPU, generate_hint="BEST_PERF")
    with pytest.raises(PipelineError, match="--prefill-hint 'later': give one of DYNAMIC, STATIC"):
        GenAIOptions.create("llm", NPU, prefill_hint="later")
    with pytest.raises(PipelineError, match="--min-response-len 0: give a number of tokens"):
        GenAIOptions.create("llm", NPU, min_response_len=0)
    with pytest.raises(PipelineError, match="--weightless is --cache-mode OPTIMIZE_SIZE"):
        GenAIOptions.create("llm", CPU, cache_mode="optimize_speed", weightless=True)
    with pytest.raises(
        PipelineError,
        match=r"--max-prompt-len 512 \+ --min-response-len 128 .* "
        r"at most 512 \(config\.json\)",
    ):
        GenAIOptions.create("llm", NPU, max_prompt_len=500, context_length=512)


def test_memory_refusal_names_the_figure(tmp_path: Path) -> None:
    folder = detect(_llm(tmp_path / "llm"))
    (folder.root / "openvino_model.bin").write_bytes(bytes(1 << 20))
    needed = (512 << 20) + 9 * (1 << 20)
    assert check_memory(folder, NPU, None) == needed
    assert check_memory(folder, NPU, needed) == needed
    with pytest.raises(PipelineError, match=r"needs about 0\.5 GiB .* allows is 0\.5 GiB"):
        check_memory(folder, NPU, needed - 1)


def test_context_length_and_memory_estimate(tmp_path: Path) -> None:
    folder = detect(_llm(tmp_path / "llm"))
    assert context_length(folder) == 512
    weights = folder.weights_bytes()
    assert weights == 1
    assert compile_memory_bytes(folder, NPU) == (512 << 20) + 9
    assert compile_memory_bytes(folder, CPU) == (512 << 20) + 2


TOOLS = {
    "openvino": "2026.4.1",
    "openvino_genai": "2026.4.1.0",
    "openvino_tokenizers": "2026.4.1.0",
    "runtime_requirements": "meta=1.0;ov=2026.4.1;isa=Intel AVX2",
}


def test_toolchain_part_needs_genai_releases() -> None:
    assert toolchain_part(TOOLS, NPU) == {
        "openvino": "2026.4.1",
        "openvino_genai": "2026.4.1.0",
        "openvino_tokenizers": "2026.4.1.0",
    }
    assert toolchain_part(TOOLS, CPU)["runtime_requirements"] == TOOLS["runtime_requirements"]
    with pytest.raises(PipelineError, match=r"needs openvino-genai installed .*farm\[genai\]"):
        toolchain_part({**TOOLS, "openvino_genai": None}, CPU)


FILES = {
    "config.json": "1" * 64,
    "openvino_detokenizer.bin": "2" * 64,
    "openvino_detokenizer.xml": "3" * 64,
    "openvino_model.bin": "4" * 64,
    "openvino_model.xml": "5" * 64,
    "openvino_tokenizer.bin": "6" * 64,
    "openvino_tokenizer.xml": "7" * 64,
}


def test_identity_hashes_every_file_the_pipeline_reads(tmp_path: Path) -> None:
    files = identity(detect(_llm(tmp_path / "llm")))
    assert sorted(files) == sorted(FILES)
    assert files["openvino_model.bin"] == (
        "50e721e49c013f00c62cf59f2163542a9d8df02464efeb615d31051b0fddc326"  # sha256(b"w")
    )


def test_golden_bundle_and_part_keys() -> None:
    """Changing these changes every pipeline bundle's key in every fleet: deliberately only."""
    npu = GenAIOptions.create("llm", NPU, max_prompt_len=256).canonical()
    npu_tools = toolchain_part(TOOLS, NPU)
    assert bundle_key("llm", FILES, NPU, npu, npu_tools) == (
        "ea069fc00a6b6807842bf803a4cd3210e17fda3793725a6129777ff778390b0a"
    )
    cpu = GenAIOptions.create("llm", CPU).canonical()
    assert bundle_key("llm", FILES, CPU, cpu, toolchain_part(TOOLS, CPU)) == (
        "9e4097f7927ee9793f091e397f2cd4117edf2dbfd71c5382481b0182d42df048"
    )
    model = part_identity(FILES, "openvino_model.xml")
    assert model == {"xml": "5" * 64, "bin": "4" * 64}
    assert part_key("llm", "language", model, NPU, npu, npu_tools) == (
        "270685111571f4ac3ed05ecaf360f69d3b1c304405116c4f8658dff1aea7d9c5"
    )
    longer = {**npu, "max_prompt_len": 320}
    assert bundle_key("llm", FILES, NPU, longer, npu_tools) != bundle_key(
        "llm", FILES, NPU, npu, npu_tools
    )


def test_genai_of_another_release_than_openvino_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import farm.genai
    from farm.core.errors import Incompatible

    mixed = {"openvino": "2026.4.1", "openvino_genai": "2026.3.0.0", "openvino_tokenizers": None}
    monkeypatch.setattr(farm.genai, "versions", lambda: mixed)
    with pytest.raises(Incompatible, match=r"openvino-genai 2026\.3\.0\.0 is not of OpenVINO"):
        farm.genai.toolchain(NPU)
    assert farm.genai.release_of("2026.4.1.0") == "2026.4.1"


def _hf(root: Path, architecture: str = "LlamaForCausalLM") -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text(
        f'{{"architectures": ["{architecture}"], "max_position_embeddings": 256}}'
    )
    (root / "model.safetensors").write_bytes(b"weights")
    (root / "tokenizer.json").write_text("{}")
    return root


def test_a_hugging_face_folder_is_a_pipeline_to_export(tmp_path: Path) -> None:
    from farm.core.pipelines import folder_key, hf_pipeline, is_huggingface_folder, key_options

    llm = hf_pipeline(_hf(tmp_path / "llama"))
    assert (llm.kind, llm.convert_task) == ("llm", "text-generation-with-past")
    assert is_huggingface_folder(llm.root) and not is_huggingface_folder(_llm(tmp_path / "ov"))
    assert sorted(llm.files) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert llm.weights_bytes() == len(b"weights")
    whisper = hf_pipeline(_hf(tmp_path / "w", "WhisperForConditionalGeneration"))
    assert whisper.convert_task == "automatic-speech-recognition-with-past"
    options = GenAIOptions.create("llm", CPU)
    assert key_options(llm, options)["convert"] == {
        "from": "huggingface",
        "exporter": "optimum",
        "task": "text-generation-with-past",
    }
    tools = toolchain_part(TOOLS, CPU)
    converted = folder_key(llm, options, tools)
    assert converted != bundle_key("llm", identity(llm), CPU, options.canonical(), tools)


def test_hugging_face_refusals_name_the_file_or_option(tmp_path: Path) -> None:
    from farm.core.pipelines import hf_pipeline

    with pytest.raises(PipelineError, match=r"name no pipeline farm exports; give --pipeline"):
        hf_pipeline(_hf(tmp_path / "bert", "BertForMaskedLM"))
    with pytest.raises(PipelineError, match="--pipeline text2image: farm exports only llm"):
        hf_pipeline(_hf(tmp_path / "sd"), "text2image")
    custom = _hf(tmp_path / "custom")
    (custom / "modeling_custom.py").write_text("import os")
    with pytest.raises(PipelineError, match="has its own code"):
        hf_pipeline(custom)
    bare = _hf(tmp_path / "bare")
    (bare / "model.safetensors").unlink()
    with pytest.raises(PipelineError, match="without weights"):
        hf_pipeline(bare)


def test_sub_models_of_two_text_to_image_models_are_refused_naming_the_configs(
    tmp_path: Path,
) -> None:
    import json

    root = _text2image(tmp_path / "sd")
    configs = {
        "unet": {"in_channels": 4, "cross_attention_dim": 768},
        "vae_decoder": {"latent_channels": 4},
        "text_encoder": {"hidden_size": 768},
    }
    for sub, config in configs.items():
        (root / sub / "config.json").write_text(json.dumps(config))
    assert detect(root).kind == "text2image"
    (root / "vae_decoder" / "config.json").write_text('{"latent_channels": 16}')
    with pytest.raises(PipelineError, match=r"unet/config\.json: mismatched sub-models: .* 4 "):
        detect(root)
    (root / "vae_decoder" / "config.json").write_text('{"latent_channels": 4}')
    (root / "text_encoder" / "config.json").write_text('{"hidden_size": 1024}')
    with pytest.raises(PipelineError, match=r"text_encoder/config\.json hidden_size 1024"):
        detect(root)


def test_a_text_to_image_folder_without_its_tokenizer_is_refused_naming_it(
    tmp_path: Path,
) -> None:
    root = _text2image(tmp_path / "sd")
    (root / "tokenizer" / "openvino_tokenizer.xml").unlink()
    with pytest.raises(
        PipelineError, match=r"tokenizer/openvino_tokenizer\.xml: the text2image pipeline's tok"
    ):
        detect(root)
