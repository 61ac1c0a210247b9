"""OpenVINO GenAI pipeline folders: what a folder is, what it is compiled with, and its bundle key.

Pure and edge-safe (standard library only): an edge holding the folder computes the key of the
bundle the farm compiled for it, offline. The facts behind the rules are in docs/openvino.md
("GenAI pipelines"); the bundle itself in docs/architecture.md §17.

A pipeline folder is what optimum-intel's exporter writes (`optimum-cli export openvino`): one
or more OpenVINO IR sub-models (the *parts* compiled on a device), the tokenizer and detokenizer
IR from openvino-tokenizers, and JSON configs. The bundle key names one compiled form of one
folder: every file the pipeline reads, the target, the GenAI options baked into the compiled
form, and the OpenVINO / GenAI / tokenizers releases (a cache entry imports only into the
release that wrote it).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from farm.core.errors import PipelineError
from farm.core.hashing import canonical_json, sha256_file
from farm.core.spec import Target

BUNDLE_KEY_VERSION = 1
KINDS = ("llm", "vlm", "whisper", "text2image")

TOKENIZER = "openvino_tokenizer.xml"
DETOKENIZER = "openvino_detokenizer.xml"
READ_SUFFIXES = (".xml", ".bin", ".json")
"""What GenAI reads from a folder: IR (graph + weights) and JSON configs. Other files (a
README, the Hugging Face tokenizer's merges.txt) do not change what an edge opens."""


@dataclass(frozen=True)
class _Layout:
    """The sub-models of one pipeline kind: required parts by name -> IR path (any one of a
    tuple of alternatives), optional parts, and where its tokenizer IR lives."""

    parts: Mapping[str, tuple[str, ...]]
    optional: Mapping[str, str] = field(default_factory=dict)
    tokenizer: str = TOKENIZER
    detokenizer: str | None = DETOKENIZER
    marker: str | None = None
    """A file only this kind has (text-to-image's model_index.json)."""


LAYOUTS: dict[str, _Layout] = {
    "llm": _Layout(parts={"language": ("openvino_model.xml",)}),
    "vlm": _Layout(
        parts={
            "language": ("openvino_language_model.xml",),
            "text_embeddings": ("openvino_text_embeddings_model.xml",),
            "vision_embeddings": ("openvino_vision_embeddings_model.xml",),
        },
        optional={
            "vision_embeddings_merger": "openvino_vision_embeddings_merger_model.xml",
            "resampler": "openvino_resampler_model.xml",
        },
    ),
    "whisper": _Layout(
        parts={
            "encoder": ("openvino_encoder_model.xml",),
            "decoder": ("openvino_decoder_model.xml",),
        },
        optional={"decoder_with_past": "openvino_decoder_with_past_model.xml"},
    ),
    "text2image": _Layout(
        parts={
            "text_encoder": ("text_encoder/openvino_model.xml",),
            "denoiser": ("unet/openvino_model.xml", "transformer/openvino_model.xml"),
            "vae_decoder": ("vae_decoder/openvino_model.xml",),
        },
        optional={
            "text_encoder_2": "text_encoder_2/openvino_model.xml",
            "text_encoder_3": "text_encoder_3/openvino_model.xml",
            "vae_encoder": "vae_encoder/openvino_model.xml",
        },
        tokenizer="tokenizer/openvino_tokenizer.xml",
        detokenizer=None,
        marker="model_index.json",
    ),
}


@dataclass(frozen=True)
class PipelineFolder:
    """A recognised pipeline folder."""

    kind: str
    root: Path
    parts: dict[str, str]
    """Sub-model name -> its IR's path relative to the folder (its .bin beside it)."""
    files: dict[str, Path]
    """Every file the pipeline reads, by path relative to the folder (POSIX separators); for a
    Hugging Face folder, every file of it (what the conversion reads)."""
    convert_task: str | None = None
    """A Hugging Face folder's optimum task: the worker exports it to a pipeline folder first
    (`hf_pipeline`); None: already an OpenVINO pipeline folder."""

    def weights_bytes(self) -> int:
        """Total size of the sub-models' weights: what compile memory scales with."""
        if self.convert_task is not None:
            return sum(
                path.stat().st_size
                for name, path in self.files.items()
                if name.endswith((".safetensors", ".bin"))
            )
        return sum(self.files[_bin_of(xml)].stat().st_size for xml in self.parts.values())

    def canonical_convert(self) -> dict[str, Any] | None:
        """What the key holds of the conversion (the exporter's versions are recorded with the
        bundle, not keyed: docs/architecture.md §15 and §17)."""
        if self.convert_task is None:
            return None
        return {"from": "huggingface", "exporter": "optimum", "task": self.convert_task}


def detect(folder: str | Path, kind: str | None = None) -> PipelineFolder:
    """Recognise `folder` as a GenAI pipeline (or check it is a `kind` one, `--pipeline`).

    Refused with the file named: a folder that is no pipeline, a missing sub-model, weights,
    tokenizer or detokenizer, and sub-models exported by different tool versions.
    """
    root = Path(folder)
    if not root.is_dir():
        raise PipelineError(f"{root}: not a folder; a GenAI pipeline is a folder of IR files")
    if kind is not None and kind not in LAYOUTS:
        raise PipelineError(f"--pipeline {kind!r}: not a pipeline kind; known: {', '.join(KINDS)}")
    kind = kind or _guess_kind(root)
    layout = LAYOUTS[kind]
    parts = {name: _find_part(root, kind, name, paths) for name, paths in layout.parts.items()}
    parts |= {name: path for name, path in layout.optional.items() if (root / path).is_file()}
    needed = [layout.tokenizer] + ([layout.detokenizer] if layout.detokenizer else [])
    for ir in needed:
        if not (root / ir).is_file():
            role = "tokenizer" if ir.endswith(TOKENIZER) else "detokenizer"
            raise PipelineError(
                f"{root / ir}: the {kind} pipeline's {role} IR is missing; convert it with "
                "openvino-tokenizers (`convert_tokenizer(..., with_detokenizer=True)`) or export "
                "the folder with optimum-cli export openvino, which writes it"
            )
    for ir in [*parts.values(), *needed]:
        if not (root / _bin_of(ir)).is_file():
            raise PipelineError(f"{root / _bin_of(ir)}: the weights of {ir} are missing")
    _check_same_export(root, parts)
    if kind == "text2image":
        _check_denoiser_fits(root, parts)
    files = {
        path.relative_to(root).as_posix(): path
        for path in sorted(root.rglob("*"))
        if path.is_file()
        and path.suffix in READ_SUFFIXES
        and not any(piece.startswith(".") for piece in path.relative_to(root).parts)
    }
    return PipelineFolder(kind=kind, root=root, parts=parts, files=files)


HF_PIPELINE_TASKS = {
    "llm": "text-generation-with-past",
    "whisper": "automatic-speech-recognition-with-past",
}
"""The optimum task that exports a Hugging Face folder into each kind's pipeline folder."""
_HF_KINDS = (
    ("WhisperForConditionalGeneration", "whisper"),
    ("ForCausalLM", "llm"),
    ("LMHeadModel", "llm"),
)


def hf_pipeline(folder: str | Path, kind: str | None = None) -> PipelineFolder:
    """A Hugging Face folder (config.json + weights) to export into a `kind` pipeline folder on
    the worker (`--pipeline`, or recognised from config.json's architectures)."""
    root = Path(folder)
    config_path = root / "config.json"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise PipelineError(f"{config_path}: not a readable config.json: {error}") from None
    if kind is None:
        names = config.get("architectures") or [] if isinstance(config, dict) else []
        kind = next((k for name in names for end, k in _HF_KINDS if str(name).endswith(end)), None)
        if kind is None:
            raise PipelineError(
                f"{config_path}: its architectures {names} name no pipeline farm exports; "
                f"give --pipeline {'|'.join(HF_PIPELINE_TASKS)}"
            )
    if kind not in HF_PIPELINE_TASKS:
        raise PipelineError(
            f"--pipeline {kind}: farm exports only {', '.join(HF_PIPELINE_TASKS)} pipelines "
            "from a Hugging Face folder; export it with optimum-cli export openvino first"
        )
    files = {
        path.relative_to(root).as_posix(): path
        for path in sorted(root.rglob("*"))
        if path.is_file()
        and not any(piece.startswith(".") for piece in path.relative_to(root).parts)
    }
    if not any(name.endswith((".safetensors", ".bin")) for name in files):
        raise PipelineError(f"{root}: a Hugging Face folder without weights (*.safetensors)")
    if any(name.endswith(".py") for name in files) or "auto_map" in config:
        raise PipelineError(
            f"{root}: this Hugging Face folder has its own code, which farm does not run for "
            "a pipeline; export it with optimum-cli export openvino yourself"
        )
    return PipelineFolder(
        kind=kind, root=root, parts={}, files=files, convert_task=HF_PIPELINE_TASKS[kind]
    )


def is_huggingface_folder(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file() and not looks_like_pipeline(path)


def looks_like_pipeline(path: Path) -> bool:
    """Whether `path` is a folder with a GenAI pipeline's marker file (not a Hugging Face or
    TensorFlow folder, which are sources to convert first)."""
    return path.is_dir() and any(
        (path / (layout.marker or next(iter(layout.parts.values()))[0])).is_file()
        for layout in LAYOUTS.values()
    )


def _guess_kind(root: Path) -> str:
    for kind in ("text2image", "whisper", "vlm", "llm"):
        layout = LAYOUTS[kind]
        marker = layout.marker or next(iter(layout.parts.values()))[0]
        if (root / marker).is_file():
            return kind
    raise PipelineError(
        f"{root}: not a GenAI pipeline folder: found none of openvino_model.xml (llm), "
        "openvino_language_model.xml (vlm), openvino_encoder_model.xml (whisper), "
        "model_index.json (text2image); export it with optimum-cli export openvino, or name "
        f"the kind with --pipeline {'|'.join(KINDS)}"
    )


def _find_part(root: Path, kind: str, name: str, paths: tuple[str, ...]) -> str:
    for path in paths:
        if (root / path).is_file():
            return path
    raise PipelineError(
        f"{root / paths[0]}: the {kind} pipeline's {name} sub-model is missing"
        + (f" (or {', '.join(paths[1:])})" if len(paths) > 1 else "")
    )


def _bin_of(xml: str) -> str:
    return xml[: -len(".xml")] + ".bin"


_EXPORT_TAIL_BYTES = 64 * 1024
_EXPORT_FIELD = re.compile(rb'<(\w+_version) value="([^"]*)"')


def export_record(xml: Path) -> dict[str, str]:
    """The tool versions an IR's rt_info records (OpenVINO, optimum, transformers, torch):
    read from the file's tail, where OpenVINO writes rt_info, without parsing the graph."""
    with open(xml, "rb") as stream:
        stream.seek(max(0, xml.stat().st_size - _EXPORT_TAIL_BYTES))
        tail = stream.read()
    start = tail.rfind(b"<rt_info>")
    return {
        name.decode(): value.decode()
        for name, value in _EXPORT_FIELD.findall(tail[start:] if start >= 0 else b"")
    }


def _check_same_export(root: Path, parts: Mapping[str, str]) -> None:
    """Sub-models exported by different tool versions come from different exports (a decoder
    from one run beside an encoder from another): refused, naming both files."""
    first_name, first = next(iter(parts.items()))
    expected = export_record(root / first)
    for name, path in parts.items():
        record = export_record(root / path)
        for tool in sorted(expected.keys() & record.keys()):
            if record[tool] != expected[tool]:
                raise PipelineError(
                    f"{root / path}: mismatched sub-models: the {name} was exported with "
                    f"{tool} {record[tool]}, the {first_name} ({first}) with {expected[tool]}; "
                    "export the whole folder again in one run"
                )


def _config(root: Path, part: str) -> dict[str, Any] | None:
    path = root / Path(part).parent / "config.json"
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise PipelineError(f"{path}: not readable JSON: {error}") from None
    return data if isinstance(data, dict) else None


def _check_denoiser_fits(root: Path, parts: Mapping[str, str]) -> None:
    """A UNet takes the VAE's latents and the text encoders' hidden states: sub-models of two
    different models (a VAE of 16 latent channels beside a UNet of 4) are refused naming both
    config files. Checked where the configs say (a transformer's layout differs: not checked)."""
    denoiser = parts["denoiser"]
    unet = _config(root, denoiser) if denoiser.startswith("unet/") else None
    if unet is None:
        return
    where = f"{root / Path(denoiser).parent / 'config.json'}"
    vae = _config(root, parts["vae_decoder"])
    latents, channels = (vae or {}).get("latent_channels"), unet.get("in_channels")
    if isinstance(latents, int) and isinstance(channels, int) and latents != channels:
        raise PipelineError(
            f"{where}: mismatched sub-models: the UNet takes {channels} latent channels, the "
            f"VAE decoder ({root / 'vae_decoder' / 'config.json'}) makes {latents}; export the "
            "whole folder again from one model"
        )
    encoders = [n for n in ("text_encoder", "text_encoder_2", "text_encoder_3") if n in parts]
    sizes = [(_config(root, parts[n]) or {}).get("hidden_size") for n in encoders]
    width = unet.get("cross_attention_dim")
    if isinstance(width, int) and sizes and all(isinstance(n, int) for n in sizes):
        total = sum(int(n) for n in sizes if isinstance(n, int))
        if total != width:
            named = ", ".join(
                f"{n}/config.json hidden_size {h}" for n, h in zip(encoders, sizes, strict=True)
            )
            raise PipelineError(
                f"{where}: mismatched sub-models: the UNet attends to {width}-wide text "
                f"states, its text encoders give {total} ({named}); export the whole folder "
                "again from one model"
            )


def identity(
    folder: PipelineFolder, progress: Callable[[int], None] | None = None
) -> dict[str, str]:
    """``{relative path: sha256}`` of every file the pipeline reads."""
    return {name: sha256_file(path, progress) for name, path in sorted(folder.files.items())}


# --- GenAI options ---------------------------------------------------------------------------

CACHE_MODES = ("OPTIMIZE_SPEED", "OPTIMIZE_SIZE")
GENERATE_HINTS = ("FAST_COMPILE", "BEST_PERF")
PREFILL_HINTS = ("DYNAMIC", "STATIC")
NPU_TOKEN_ALIGNMENT = 64
"""NPUW rounds MAX_PROMPT_LEN and MIN_RESPONSE_LEN up to a multiple of 64 before compiling
(openvino `src/plugins/intel_npu/src/plugin/npuw/llm_compiled_model.cpp`, ``align_to(..., 64u)``),
so 200 and 256 compile the same blob: the key holds the rounded value."""
NPU_DEFAULTS: dict[str, Any] = {
    "max_prompt_len": 1024,
    "min_response_len": 128,
    "generate_hint": "FAST_COMPILE",
    "prefill_hint": "DYNAMIC",
}
NPU_LLM_OPTIONS = tuple(NPU_DEFAULTS)
MAX_TOKENS = 1 << 20
CPU_ATTENTION_BACKEND = "SDPA"
"""CPU LLMs and VLMs are compiled and opened with ATTENTION_BACKEND=SDPA: with GenAI's default (PA)
the language model's cache entry is named from the folder's path and rewritten at every start
(docs/openvino.md)."""

_FLAGS = {
    "max_prompt_len": "--max-prompt-len",
    "min_response_len": "--min-response-len",
    "generate_hint": "--generate-hint",
    "prefill_hint": "--prefill-hint",
    "cache_mode": "--cache-mode",
}


@dataclass(frozen=True)
class GenAIOptions:
    """What a pipeline bakes into its compiled form, canonical for one (kind, target)."""

    kind: str
    target: Target
    values: dict[str, Any]

    @classmethod
    def create(
        cls,
        kind: str,
        target: Target,
        *,
        max_prompt_len: int | None = None,
        min_response_len: int | None = None,
        generate_hint: str | None = None,
        prefill_hint: str | None = None,
        cache_mode: str | None = None,
        weightless: bool = False,
        context_length: int | None = None,
    ) -> GenAIOptions:
        """Check and canonicalize the options; `context_length` is the model's (config.json),
        when known, to refuse a prompt the model cannot take."""
        if kind not in LAYOUTS:
            raise PipelineError(f"unknown pipeline kind {kind!r}; known: {', '.join(KINDS)}")
        given = {
            "max_prompt_len": max_prompt_len,
            "min_response_len": min_response_len,
            "generate_hint": generate_hint,
            "prefill_hint": prefill_hint,
        }
        npu_llm = target.is_npu and kind in ("llm", "vlm")
        for name, value in given.items():
            if value is not None and not npu_llm:
                where = "LLM and VLM pipelines on NPU" if target.is_npu else "NPU targets"
                raise PipelineError(
                    f"{_FLAGS[name]} applies to {where} only; drop it for a {kind} pipeline "
                    f"on {target}"
                )
        mode = _choice("cache_mode", cache_mode, CACHE_MODES)
        if weightless:
            if mode == "OPTIMIZE_SPEED":
                raise PipelineError(
                    "--weightless is --cache-mode OPTIMIZE_SIZE; it contradicts "
                    "--cache-mode OPTIMIZE_SPEED"
                )
            mode = "OPTIMIZE_SIZE"
        values: dict[str, Any] = {"cache_mode": mode or "OPTIMIZE_SPEED"}
        if npu_llm:
            prompt = _tokens("max_prompt_len", max_prompt_len)
            response = _tokens("min_response_len", min_response_len)
            values |= {
                "max_prompt_len": prompt,
                "min_response_len": response,
                "generate_hint": _choice("generate_hint", generate_hint, GENERATE_HINTS)
                or NPU_DEFAULTS["generate_hint"],
                "prefill_hint": _choice("prefill_hint", prefill_hint, PREFILL_HINTS)
                or NPU_DEFAULTS["prefill_hint"],
            }
            if context_length is not None and prompt + response > context_length:
                raise PipelineError(
                    f"--max-prompt-len {prompt} + --min-response-len {response} (rounded up to "
                    f"multiples of {NPU_TOKEN_ALIGNMENT}) is {prompt + response} tokens; the "
                    f"model takes at most {context_length} (config.json); lower them"
                )
        elif kind in ("llm", "vlm") and not target.is_npu:
            values["attention_backend"] = CPU_ATTENTION_BACKEND
        return cls(kind=kind, target=target, values=values)

    def canonical(self) -> dict[str, Any]:
        return dict(self.values)

    def properties(self) -> dict[str, Any]:
        """The GenAI/OpenVINO properties a pipeline is built with (worker and edge alike)."""
        props: dict[str, Any] = {"CACHE_MODE": self.values["cache_mode"]}
        if "attention_backend" in self.values:
            props["ATTENTION_BACKEND"] = self.values["attention_backend"]
        for name in NPU_LLM_OPTIONS:
            if name in self.values:
                props[name.upper()] = self.values[name]
        if self.target.is_npu:
            props["NPU_PLATFORM"] = self.target.platform
        return props


def _tokens(name: str, value: int | None) -> int:
    if value is None:
        return int(NPU_DEFAULTS[name])
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_TOKENS:
        raise PipelineError(f"{_FLAGS[name]} {value!r}: give a number of tokens, 1..{MAX_TOKENS}")
    return -(-value // NPU_TOKEN_ALIGNMENT) * NPU_TOKEN_ALIGNMENT


def _choice(name: str, value: str | None, allowed: tuple[str, ...]) -> str | None:
    if value is None:
        return None
    spelled = value.strip().upper().replace("-", "_")
    if spelled not in allowed:
        raise PipelineError(f"{_FLAGS[name]} {value!r}: give one of {', '.join(allowed)}")
    return spelled


def context_length(folder: PipelineFolder) -> int | None:
    """The longest sequence the model takes, from config.json, when it says."""
    config = folder.root / "config.json"
    if not config.is_file():
        return None
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise PipelineError(f"{config}: not readable JSON: {error}") from None
    sources = [data, data.get("text_config") or {}] if isinstance(data, dict) else []
    for source in sources:
        for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
            value = source.get(name) if isinstance(source, dict) else None
            if isinstance(value, int) and value > 0:
                return value
    return None


# --- memory and keys -------------------------------------------------------------------------

COMPILE_MEMORY_FACTOR = {"npu_llm": 9.0, "npu": 4.0, "cpu": 2.0}
"""Peak host memory of a compile per byte of weights. NPU LLM compiles were reported at 6 to 9
times the weight size (docs/openvino.md, GENAI facts); the upper figure is used so a job never
lands on a worker that runs out. CPU compiles hold the weights and the compiled copy."""
COMPILE_MEMORY_BASE_BYTES = 512 << 20
"""OpenVINO and Python themselves, before any weights."""


def compile_memory_bytes(folder: PipelineFolder, target: Target) -> int:
    """The memory a worker needs to compile `folder` for `target` (an estimate from weights)."""
    return memory_for_weights(folder.kind, folder.weights_bytes(), target)


def memory_for_weights(kind: str, weights_bytes: int, target: Target) -> int:
    """The compile-memory estimate of `weights_bytes` of a `kind` pipeline (or of one of its
    parts) for `target`."""
    if target.is_npu:
        factor = COMPILE_MEMORY_FACTOR["npu_llm" if kind in ("llm", "vlm") else "npu"]
    else:
        factor = COMPILE_MEMORY_FACTOR["cpu"]
    return COMPILE_MEMORY_BASE_BYTES + int(weights_bytes * factor)


def check_memory(folder: PipelineFolder, target: Target, largest_bytes: int | None) -> int:
    """The compile-memory estimate of `folder` for `target`; `PipelineError` naming it when the
    largest compile any worker allows (`largest_bytes`, None: unbounded) is smaller."""
    needed = compile_memory_bytes(folder, target)
    if largest_bytes is not None and needed > largest_bytes:
        gib = 1 << 30
        raise PipelineError(
            f"compiling this {folder.kind} pipeline for {target} needs about "
            f"{needed / gib:.1f} GiB ({folder.weights_bytes() / gib:.2f} GiB of weights); the "
            f"largest compile this farm allows is {largest_bytes / gib:.1f} GiB "
            "(FARM_COMPILE_MEMORY_BYTES): add a worker with more memory"
        )
    return needed


def bundle_key(
    kind: str,
    files: Mapping[str, str],
    target: Target,
    options: Mapping[str, Any],
    toolchain: Mapping[str, str],
) -> str:
    """The bundle key v1: sha256 hex of the canonical JSON of the pipeline's kind, its files
    (`identity`), the target, the canonical options and the toolchain part
    (`toolchain_part`)."""
    document = {
        "v": BUNDLE_KEY_VERSION,
        "pipeline": kind,
        "files": dict(files),
        "target": target.name,
        "options": dict(options),
        "toolchain": dict(toolchain),
    }
    return hashlib.sha256(canonical_json(document)).hexdigest()


def folder_key(
    folder: PipelineFolder,
    options: GenAIOptions,
    toolchain: Mapping[str, str],
    progress: Callable[[int], None] | None = None,
) -> str:
    """The bundle key of `folder` compiled with `options`: `bundle_key` of its files, with the
    conversion (a Hugging Face folder's task) among the options."""
    return bundle_key(
        folder.kind,
        identity(folder, progress),
        options.target,
        key_options(folder, options),
        toolchain,
    )


def key_options(folder: PipelineFolder, options: GenAIOptions) -> dict[str, Any]:
    """The options part of the bundle key: the canonical options, plus the conversion."""
    canonical = options.canonical()
    convert = folder.canonical_convert()
    if convert is not None:
        canonical["convert"] = convert
    return canonical


def part_key(
    kind: str,
    part: str,
    model: Mapping[str, str],
    target: Target,
    options: Mapping[str, Any],
    toolchain: Mapping[str, str],
) -> str:
    """One part's compiled form: the same VAE in two pipelines has one part key, so it compiles
    once. `model` is the part's files by sha256 (`part_model`; ``{"xml": sha256, "bin": sha256}``
    in the golden vector)."""
    document = {
        "v": BUNDLE_KEY_VERSION,
        "pipeline": kind,
        "part": part,
        "model": dict(model),
        "target": target.name,
        "options": dict(options),
        "toolchain": dict(toolchain),
    }
    return hashlib.sha256(canonical_json(document)).hexdigest()


def part_identity(folder_identity: Mapping[str, str], xml: str) -> dict[str, str]:
    return {"xml": folder_identity[xml], "bin": folder_identity[_bin_of(xml)]}


WHOLE_PIPELINE = "pipeline"
"""The part that is the whole pipeline as GenAI compiles it."""
SEPARATE_SUB_MODELS = {
    "text2image": ("text_encoder", "unet", "vae_decoder"),
}
"""The sub-models that compile apart, each a part whose cache entry the pipeline then loads
(measured: docs/openvino.md, "Parts"). Only a Stable Diffusion layout (one CLIP text encoder, a
UNet, the VAE decoder) on CPU: SDXL/SD3/Flux layouts, LLMs, VLMs and Whisper (GenAI transforms
the language model and the Whisper decoder before compiling) and every NPU export compile as
one part."""
SUB_MODEL_FILES = ("openvino_model.xml", "openvino_model.bin", "config.json")
"""What a sub-model part compiles, in its folder: the IR and the config GenAI reads with it
(the VAE's scaling factor is compiled into the model)."""


def part_files(kind: str, files: Iterable[str], target: Target) -> dict[str, list[str]]:
    """The parts of a pipeline with `files` (relative paths) for `target`: part name -> the
    relative paths it compiles. Either the sub-models that compile apart (`SEPARATE_SUB_MODELS`)
    or the whole pipeline (`WHOLE_PIPELINE`: every file). Pure: the farm plans from digests."""
    every = sorted(files)
    subs = SEPARATE_SUB_MODELS.get(kind)
    if subs is None or target.is_npu:
        return {WHOLE_PIPELINE: every}
    models = {path.split("/")[0] for path in every if path.endswith("/openvino_model.xml")}
    optional = {"vae_encoder"}  # present in an export, not loaded by Text2ImagePipeline
    if models - optional != set(subs):  # another layout (SDXL, SD3, Flux, ...): one part
        return {WHOLE_PIPELINE: every}
    parts = {sub: [f"{sub}/{name}" for name in SUB_MODEL_FILES] for sub in subs}
    if any(path not in every for paths in parts.values() for path in paths):
        return {WHOLE_PIPELINE: every}
    return parts


def part_model(files: Mapping[str, str], name: str) -> dict[str, str]:
    """The ``model`` of a part's key: a sub-model's files by their name in its own folder (the
    same VAE in two pipelines has one key); the whole pipeline's files as they are."""
    if name == WHOLE_PIPELINE:
        return dict(files)
    prefix = f"{name}/"
    return {path[len(prefix) :]: sha for path, sha in files.items() if path.startswith(prefix)}


GENAI_TOOLS = ("openvino", "openvino_genai", "openvino_tokenizers")


def toolchain_part(versions: Mapping[str, str | None], target: Target) -> dict[str, str]:
    """The part of a GenAI toolchain in the bundle key: the OpenVINO, GenAI and tokenizers
    releases (a worker compiles only with the releases the edge runs), plus the CPU's
    RUNTIME_REQUIREMENTS (a CPU cache entry imports only where it matches byte for byte)."""
    part: dict[str, str] = {}
    for tool in GENAI_TOOLS:
        value = versions.get(tool)
        if not value:
            raise PipelineError(
                f"a GenAI pipeline needs {tool.replace('_', '-')} installed on this host "
                "(pip install 'farm[genai]'); its release is part of the bundle key"
            )
        part[tool] = str(value)
    if not target.is_npu:
        requirements = versions.get("runtime_requirements")
        if not requirements:
            raise PipelineError("a CPU bundle key needs the CPU's RUNTIME_REQUIREMENTS string")
        part["runtime_requirements"] = str(requirements)
    return part
