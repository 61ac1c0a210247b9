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
from farm.core.pipelines import GENAI_TOOLS, LAYOUTS, toolchain_part
from farm.core.spec import Target
from farm.toolchain import host_toolchain

PIPELINE_CLASSES = {
    "llm": "LLMPipeline",
    "vlm": "VLMPipeline",
    "whisper": "WhisperPipeline",
    "text2image": "Text2ImagePipeline",
}
SUB_MODEL_CLASSES = {
    "text_encoder": "CLIPTextModel",
    "unet": "UNet2DConditionModel",
    "vae_decoder": "AutoencoderKL",
}
"""The GenAI class that compiles each sub-model part (`farm.core.pipelines.SEPARATE_SUB_MODELS`)
exactly as Text2ImagePipeline does: its cache entry is the one the pipeline then loads."""
REFERENCE_PROMPT = "the quick brown fox"
REFERENCE_PICTURE_SIZE = 64
"""VLM's reference run: a fixed 64x64 gradient picture with the reference prompt."""
REFERENCE_IMAGE = {"width": 64, "height": 64, "num_inference_steps": 2, "rng_seed": 42}
"""Text-to-image's reference run: a small image in two steps from a fixed seed."""
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
    genai = _module()
    if kind == "vlm":
        return _open_vlm(genai, folder, device, properties)
    pipeline_class = getattr(genai, PIPELINE_CLASSES[kind])
    return pipeline_class(str(folder), device, **dict(properties))


def _open_vlm(genai: Any, folder: Path, device: str, properties: Mapping[str, Any]) -> Any:
    """A VLM opened from its models in memory, not from its folder's path: GenAI 2026.4 compiles
    the vision embeddings model from its file path, and OpenVINO names a path-compiled cache
    entry from the absolute path, so a bundle's entry would miss at any other path. Given the
    model itself, the entry is named from its content (docs/openvino.md, "Parts")."""
    import numpy as np
    import openvino as ov

    layout = LAYOUTS["vlm"]
    models = {}
    for name, xml in [
        *((n, paths[0]) for n, paths in layout.parts.items()),
        *layout.optional.items(),
    ]:
        path = folder / xml
        if path.is_file():
            weights = np.fromfile(path.with_suffix(".bin"), dtype=np.uint8)
            models[name] = (path.read_text(encoding="utf-8"), ov.Tensor(weights))
    tokenizer = genai.Tokenizer(str(folder))
    return genai.VLMPipeline(models, tokenizer, str(folder), device, **dict(properties))


def compile_sub_model(name: str, folder: Path, device: str, properties: Mapping[str, Any]) -> Any:
    """Compile one sub-model folder (``unet/``) with the GenAI class its pipeline uses."""
    model_class = getattr(_module(), SUB_MODEL_CLASSES[name])
    return model_class(str(folder), device, **dict(properties))


def reference_picture() -> Any:
    """A fixed 64x64 RGB gradient (an `openvino.Tensor`, NHWC u8) for the VLM's reference run."""
    import numpy as np
    import openvino as ov

    ramp = np.arange(REFERENCE_PICTURE_SIZE, dtype=np.uint16) * 4
    red = np.broadcast_to(ramp[None, :], (REFERENCE_PICTURE_SIZE, REFERENCE_PICTURE_SIZE))
    green = red.T
    blue = np.full_like(red, 128)
    picture = np.stack([red, green, blue], axis=-1).astype(np.uint8)[None]
    return ov.Tensor(np.ascontiguousarray(picture))


def reference_audio() -> list[float]:
    """A fixed second of audio (a 255 Hz tone) for Whisper's reference run."""
    import math

    return [
        0.1 * math.sin(2 * math.pi * 255 * i / SAMPLE_RATE)
        for i in range(REFERENCE_AUDIO_SECONDS * SAMPLE_RATE)
    ]


def reference_run(kind: str, pipeline: Any) -> dict[str, Any]:
    """Greedy decoding of a fixed input: the tokens (LLM) or text (Whisper), or the sha256 of
    the image of a fixed seed (text-to-image), that a bundle records at compile time and `farm
    verify` compares with what the edge's pipeline generates."""
    genai = _module()
    if kind == "llm":
        config = genai.GenerationConfig(max_new_tokens=REFERENCE_NEW_TOKENS, do_sample=False)
        config.ignore_eos = True
        tokens = pipeline.get_tokenizer().encode(REFERENCE_PROMPT)
        result = pipeline.generate(tokens, config)
        return {"prompt": REFERENCE_PROMPT, "tokens": [int(t) for t in result.tokens[0]]}
    if kind == "vlm":
        config = genai.GenerationConfig(max_new_tokens=REFERENCE_NEW_TOKENS, do_sample=False)
        config.ignore_eos = True
        result = pipeline.generate(
            REFERENCE_PROMPT, images=[reference_picture()], generation_config=config
        )
        return {
            "prompt": REFERENCE_PROMPT,
            "picture": "64x64 gradient",
            "texts": list(result.texts),
        }
    if kind == "whisper":
        config = pipeline.get_generation_config()
        config.max_new_tokens = REFERENCE_NEW_TOKENS
        config.do_sample = False
        result = pipeline.generate(reference_audio(), config)
        return {"audio": f"{REFERENCE_AUDIO_SECONDS} s tone", "texts": list(result.texts)}
    if kind == "text2image":
        import hashlib

        image = pipeline.generate(REFERENCE_PROMPT, **REFERENCE_IMAGE)
        return {
            "prompt": REFERENCE_PROMPT,
            **REFERENCE_IMAGE,
            "shape": [int(n) for n in image.shape],
            "image_sha256": hashlib.sha256(bytes(image.data)).hexdigest(),
        }
    return {}
