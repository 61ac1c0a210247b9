"""OpenVINO GenAI facts farm relies on: the releases of this host, the pipeline class of each
kind, opening a pipeline, and the fixed reference run recorded with a bundle.

`openvino_genai` is an optional import, made only inside the functions that open a pipeline:
the worker installs it with `farm[genai]`, an edge that opens pipelines installs it itself.
Imports core and toolchain only (docs/architecture.md §17); the facts are in docs/openvino.md.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from farm.core.errors import Incompatible, NotInstalled
from farm.core.pipelines import GENAI_TOOLS, toolchain_part
from farm.core.spec import Target
from farm.toolchain import host_toolchain

PIPELINE_CLASSES = {
    "llm": "LLMPipeline",
    "vlm": "VLMPipeline",
    "whisper": "WhisperPipeline",
    "text2image": "Text2ImagePipeline",
}
REFERENCE_PROMPT = "the quick brown fox"
REFERENCE_NEW_TOKENS = 16
REFERENCE_AUDIO_SECONDS = 1
SAMPLE_RATE = 16000


def versions() -> dict[str, str | None]:
    """The installed releases of openvino, openvino-genai and openvino-tokenizers (None when
    absent), as their distributions name them."""
    found: dict[str, str | None] = {}
    for tool in GENAI_TOOLS:
        try:
            found[tool] = importlib.metadata.version(tool.replace("_", "-"))
        except importlib.metadata.PackageNotFoundError:
            found[tool] = None
    return found


def toolchain(target: Target) -> dict[str, str]:
    """This host's part of a bundle key for `target` (`farm.core.pipelines.toolchain_part`).
    GenAI and tokenizers of another release than OpenVINO's are refused: their wheels are built
    against one OpenVINO release, and a bundle's entries import only into that release."""
    found: dict[str, str | None] = dict(versions())
    release = release_of(found.get("openvino"))
    for tool in ("openvino_genai", "openvino_tokenizers"):
        if found.get(tool) and release_of(found[tool]) != release:
            raise Incompatible(
                f"{tool.replace('_', '-')} {found[tool]} is not of OpenVINO {found['openvino']}'s "
                f"release; install the matching one: pip install '{tool.replace('_', '-')}"
                f"=={release}.*'"
            )
    if not target.is_npu:
        found["runtime_requirements"] = host_toolchain(target).runtime_requirements
    return toolchain_part(found, target)


def release_of(version: str | None) -> str | None:
    """``2026.4.1`` of ``2026.4.1.0`` (GenAI and tokenizers add a fourth number)."""
    return ".".join(version.split(".")[:3]) if version else None


def _module() -> Any:
    try:
        import openvino_genai
    except ImportError:
        raise NotInstalled(
            "opening a GenAI pipeline needs openvino-genai and openvino-tokenizers of the "
            "OpenVINO release installed here: pip install 'farm[genai]'"
        ) from None
    return openvino_genai


def open_pipeline(kind: str, folder: Path, device: str, properties: Mapping[str, Any]) -> Any:
    """An `openvino_genai.<kind>Pipeline` on `folder` for `device` with `properties`."""
    pipeline_class = getattr(_module(), PIPELINE_CLASSES[kind])
    return pipeline_class(str(folder), device, **dict(properties))


def reference_audio() -> list[float]:
    """A fixed second of audio (a 255 Hz tone) for Whisper's reference run."""
    import math

    return [
        0.1 * math.sin(2 * math.pi * 255 * i / SAMPLE_RATE)
        for i in range(REFERENCE_AUDIO_SECONDS * SAMPLE_RATE)
    ]


def reference_run(kind: str, pipeline: Any) -> dict[str, Any]:
    """Greedy decoding of a fixed input: the tokens (LLM) or text (Whisper) a bundle records at
    compile time and `farm verify` compares with what the edge's pipeline generates."""
    genai = _module()
    if kind == "llm":
        config = genai.GenerationConfig(max_new_tokens=REFERENCE_NEW_TOKENS, do_sample=False)
        config.ignore_eos = True
        tokens = pipeline.get_tokenizer().encode(REFERENCE_PROMPT)
        result = pipeline.generate(tokens, config)
        return {"prompt": REFERENCE_PROMPT, "tokens": [int(t) for t in result.tokens[0]]}
    if kind == "whisper":
        config = pipeline.get_generation_config()
        config.max_new_tokens = REFERENCE_NEW_TOKENS
        config.do_sample = False
        result = pipeline.generate(reference_audio(), config)
        return {"audio": f"{REFERENCE_AUDIO_SECONDS} s tone", "texts": list(result.texts)}
    return {}
