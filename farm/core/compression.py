"""The `compress` and `quantize` stages' arguments: their one canonical form, the presets that
encode OpenVINO's NPU advice, what a target cannot run, and the `--max-drift` bound.

The canonical args are hashed into the stage key (docs/architecture.md §15), so two spellings
of one request must give one dict and anything unknown must be an error. NNCF itself runs on
a worker (farm/server/stages/compress.py); this module is pure and standard-library only: the
CLI parses flags and an edge computes keys with it, and neither has NNCF or numpy.

Sources of the presets (docs/architecture.md §15 repeats them):
- OpenVINO, "OpenVINO GenAI on NPU" (docs/articles_en/openvino-workflow-generative/
  inference-with-genai/inference-with-genai-on-npu.rst): LLMs for NPU must have symmetric
  4-bit weights (INT4 or NF4), ratio 1.0, channel-wise (group size -1) or group size 128;
  group size 128 "is recommended for smaller models, e.g. up to 4B--5B parameters", larger
  ones "normally demonstrate a better performance with channel-wise quantization"; NF4 "is
  only supported on Intel Core Ultra Processors Series 2 NPUs (formerly codenamed Lunar Lake)
  and beyond. Use channel-wise quantization with NF4."
- NNCF, docs/compression_algorithms/CompressWeights.md: INT8 modes are per-channel for every
  layer (no group size, no ratio); in 4-bit modes embeddings, convolutions and the last linear
  layer stay INT8 unless `all_layers=True`.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from farm.core.errors import CalibrationError, CompressionArgsError, DriftExceeded
from farm.core.hashing import canonical_json, sha256_file
from farm.core.spec import Target

COMPRESS = "compress"
"""Stage kind: data-free weight compression (`nncf.compress_weights`)."""
QUANTIZE = "quantize"
"""Stage kind: post-training INT8 quantization with calibration data (`nncf.quantize`)."""

CHANNEL_WISE = -1
"""NNCF's group size for one scale per output channel."""

# NNCF modes (nncf.CompressWeightsMode values) by the `--compress` choice that names them.
MODES: dict[str, str] = {
    "int8": "int8_asym",
    "int8-sym": "int8_sym",
    "int4-sym": "int4_sym",
    "int4-asym": "int4_asym",
    "nf4": "nf4",
}
FOUR_BIT_MODES = frozenset({"int4_sym", "int4_asym", "nf4"})

DEFAULT_GROUP_SIZE: dict[str, int] = {
    "int4_sym": 128,  # NNCF's default
    "int4_asym": 128,  # NNCF's default
    "nf4": CHANNEL_WISE,  # the NPU guide: "use channel-wise quantization with NF4"
}

NPU_LLM_GROUPED_UP_TO = 4_000_000_000
"""Weights (parameters) up to which `npu-llm` uses group size 128; above it, channel-wise.
The NPU guide says group quantization "is recommended for smaller models, e.g. up to 4B--5B
parameters"; farm takes the lower end, where both forms are known to work."""

BY_SIZE: dict[str, int] = {"at_most": NPU_LLM_GROUPED_UP_TO, "then": 128, "else": CHANNEL_WISE}
"""The `npu-llm` group size rule as it is written into the stage args (and so the key): the
worker resolves it from the model's weight count; changing the rule changes the key."""

PRESETS: dict[str, dict[str, Any]] = {
    # The NPU GenAI guide's LLM export: symmetric INT4, ratio 1.0, group 128 or channel-wise.
    "npu-llm": {"mode": "int4_sym", "group_size": {"by_size": BY_SIZE}, "ratio": 1.0},
    # CNNs: INT8 per-channel symmetric weights, the weight form of NNCF's default
    # (PERFORMANCE) quantization preset; `--quantize int8` with calibration data does better.
    "npu-cnn": {"mode": "int8_sym"},
}
CHOICES = (*MODES, *PRESETS)

NF4_MIN_NPU = "4000"
"""NF4 weights need NPU 4000 (Lunar Lake, Core Ultra Series 2) or later (the NPU guide)."""
_NPU_GENERATIONS = {"3720": 3720, "4000": 4000, "5010": 5010, "5020": 5020}

QUANTIZE_PRECISIONS = ("int8",)
QUANTIZE_DEVICES = ("any", "cpu", "gpu", "npu")
"""nncf.TargetDevice values a quantization may be tuned for; NPU unless the submitter says."""

CALIBRATION_SUFFIXES = (".npy", ".npz")
MIN_CALIBRATION_SAMPLES = 10
"""Fewer samples are refused: min/max statistics over a handful of inputs do not describe the
data (NNCF collects 300 by default)."""
MAX_CALIBRATION_FILES = 1000
"""Files in a calibration folder at most: their digests are in the stage's args."""

_DIGEST = re.compile(r"[0-9a-f]{64}")


# --- compress --------------------------------------------------------------------------------


def compress_args(
    choice: str,
    *,
    group_size: int | str | None = None,
    ratio: float | str | None = None,
    all_layers: bool = False,
) -> dict[str, Any]:
    """The canonical args of a `compress` stage from the CLI's flags:
    `--compress CHOICE [--group-size N|channel] [--ratio R] [--all-layers]`."""
    name = choice.strip().lower()
    if name in PRESETS:
        if group_size is not None or ratio is not None or all_layers:
            raise CompressionArgsError(
                f"--compress {name} is a preset: it sets the group size, ratio and layers "
                "itself; give a mode (int4-sym, ...) to choose them"
            )
        return dict(PRESETS[name])
    if name not in MODES:
        raise CompressionArgsError(
            f"--compress {choice!r}: unknown; choose one of {', '.join(CHOICES)}"
        )
    args: dict[str, Any] = {"mode": MODES[name]}
    if group_size is not None:
        args["group_size"] = group_size
    if ratio is not None:
        args["ratio"] = ratio
    if all_layers:
        args["all_layers"] = True
    return canonical_compress(args)


def canonical_compress(args: Mapping[str, Any]) -> dict[str, Any]:
    """Validate `compress` args (from the CLI, the API or a recipe) into their one form:
    INT8 modes `{"mode"}`; 4-bit modes `{"mode", "group_size", "ratio", "all_layers"}` with
    NNCF's defaults written out, so leaving a default out and spelling it give one key."""
    unknown = set(args) - {"mode", "group_size", "ratio", "all_layers"}
    if unknown:
        raise CompressionArgsError(f"compress: unknown argument(s) {', '.join(sorted(unknown))}")
    mode = str(args.get("mode", "")).lower().replace("-", "_")
    if mode not in MODES.values():
        raise CompressionArgsError(
            f"compress: mode {args.get('mode')!r} is not one of {', '.join(MODES.values())}"
        )
    if mode not in FOUR_BIT_MODES:
        # NNCF's only INT8 form: every layer, per channel; spelling it out is allowed.
        given = []
        if "group_size" in args and _group_size(args["group_size"]) != CHANNEL_WISE:
            given.append("--group-size")
        if "ratio" in args and _ratio(args["ratio"]) != 1.0:
            given.append("--ratio")
        if _flag(args.get("all_layers", False)):
            given.append("--all-layers")
        if given:
            raise CompressionArgsError(
                f"{', '.join(given)} apply to 4-bit modes only: INT8 compresses every layer "
                "per channel (NNCF)"
            )
        return {"mode": mode}
    return {
        "mode": mode,
        "group_size": _group_size(args.get("group_size", DEFAULT_GROUP_SIZE[mode])),
        "ratio": _ratio(args.get("ratio", 1.0)),
        "all_layers": _flag(args.get("all_layers", False)),
    }


def resolve_group_size(args: Mapping[str, Any], weight_count: int) -> int:
    """The group size NNCF gets: the args' own, or the `npu-llm` rule applied to the model's
    number of weights (counted by the worker)."""
    group = args.get("group_size", CHANNEL_WISE)
    if isinstance(group, dict):
        rule = group["by_size"]
        return int(rule["then"] if weight_count <= rule["at_most"] else rule["else"])
    return int(group)


def describe_compress(args: Mapping[str, Any]) -> str:
    """One line for people: `int4_sym group 128 ratio 1` / `int4_sym npu-llm group rule`."""
    parts = [str(args["mode"])]
    group = args.get("group_size")
    if isinstance(group, dict):
        parts.append(f"group 128 up to {group['by_size']['at_most']:,} weights, else channel")
    elif group is not None:
        parts.append("channel-wise" if group == CHANNEL_WISE else f"group {group}")
    if "ratio" in args:
        parts.append(f"ratio {args['ratio']:g}")
    if args.get("all_layers"):
        parts.append("all layers")
    return " ".join(parts)


def _group_size(value: Any) -> int | dict[str, Any]:
    if isinstance(value, dict):
        if value != {"by_size": BY_SIZE}:
            raise CompressionArgsError(f"compress: group size rule {value!r} is not farm's")
        return {"by_size": dict(BY_SIZE)}
    text = str(value).strip().lower()
    if text in ("channel", "-1"):
        return CHANNEL_WISE
    try:
        size = int(text)
    except ValueError:
        size = 0
    if size <= 0 or isinstance(value, bool):
        raise CompressionArgsError(
            f"--group-size {value!r}: give a positive number of weights (128) or 'channel'"
        )
    return size


def _ratio(value: Any) -> float:
    try:
        ratio = float(value)
    except (TypeError, ValueError):
        ratio = math.nan
    if isinstance(value, bool) or not (0.0 < ratio <= 1.0):
        raise CompressionArgsError(
            f"--ratio {value!r}: the share of layers in 4 bits, above 0 and at most 1"
        )
    return round(ratio, 6)


def _flag(value: Any) -> bool:
    if not isinstance(value, bool):
        raise CompressionArgsError(f"compress: all_layers must be true or false, not {value!r}")
    return value


# --- quantize --------------------------------------------------------------------------------


def quantize_args(
    precision: str, calibration: Mapping[str, str], *, target_device: str = "npu"
) -> dict[str, Any]:
    """The canonical args of a `quantize` stage: `--quantize int8 --calibration DIR`. The
    folder enters the key by its identity (`calibration_identity`: sha256 by relative path),
    which also tells the worker which stored files to fetch."""
    return canonical_quantize(
        {"precision": precision, "calibration": dict(calibration), "device": target_device}
    )


def canonical_quantize(args: Mapping[str, Any]) -> dict[str, Any]:
    unknown = set(args) - {"precision", "calibration", "device"}
    if unknown:
        raise CompressionArgsError(f"quantize: unknown argument(s) {', '.join(sorted(unknown))}")
    precision = str(args.get("precision", "")).lower()
    if precision not in QUANTIZE_PRECISIONS:
        raise CompressionArgsError(
            f"--quantize {args.get('precision')!r}: farm quantizes to "
            f"{', '.join(QUANTIZE_PRECISIONS)} (weights and activations, nncf.quantize)"
        )
    identity = args.get("calibration")
    if not isinstance(identity, Mapping) or not identity:
        raise CompressionArgsError(
            "--quantize needs --calibration DIR: a folder of .npy/.npz input samples"
        )
    if len(identity) > MAX_CALIBRATION_FILES:
        raise CompressionArgsError(
            f"quantize: {len(identity)} calibration files, more than {MAX_CALIBRATION_FILES}"
        )
    for relative, digest in identity.items():
        if not (_safe_relative(relative) and _DIGEST.fullmatch(str(digest))):
            raise CompressionArgsError(
                f"quantize: calibration entry {relative!r}: {digest!r} is not a relative "
                ".npy/.npz path and its sha256"
            )
    device = str(args.get("device", "npu")).lower()
    if device not in QUANTIZE_DEVICES:
        raise CompressionArgsError(
            f"quantize: device {device!r} is not one of {', '.join(QUANTIZE_DEVICES)}"
        )
    return {"precision": precision, "calibration": dict(sorted(identity.items())), "device": device}


CALIBRATION_ROLE = "calibration/"
"""Prefix of the roles under which a `quantize` stage's calibration files reach its child."""


def stage_inputs(kind: str, args: Mapping[str, Any]) -> dict[str, str]:
    """The files a stage reads besides its input model, by role, with their sha256: a
    `quantize` stage's calibration samples (`calibration/<relative path>`), stored and
    fetched like model files."""
    if kind != QUANTIZE:
        return {}
    return {CALIBRATION_ROLE + relative: sha for relative, sha in args["calibration"].items()}


def _safe_relative(relative: Any) -> bool:
    if not isinstance(relative, str) or relative.startswith("/") or "\\" in relative:
        return False
    parts = relative.split("/")
    return all(part not in ("", ".", "..") for part in parts) and relative.lower().endswith(
        CALIBRATION_SUFFIXES
    )


def calibration_files(folder: str | Path) -> dict[str, Path]:
    """The calibration samples of a folder, by path relative to it (`/`-separated, sorted):
    every regular file must be an `.npy` or `.npz`, and there must be some."""
    root = Path(folder)
    if not root.is_dir():
        raise CalibrationError(f"--calibration {folder}: not a folder of .npy/.npz samples")
    found: dict[str, Path] = {}
    for directory, subdirs, names in os.walk(root):
        subdirs.sort()
        for name in sorted(names):
            path = Path(directory, name)
            relative = path.relative_to(root).as_posix()
            if path.is_symlink() or not path.is_file():
                raise CalibrationError(
                    f"--calibration {folder}: {relative} is not a regular file (links refused)"
                )
            if path.suffix.lower() not in CALIBRATION_SUFFIXES:
                raise CalibrationError(
                    f"--calibration {folder}: {relative} is neither .npy nor .npz; the folder "
                    "must hold input samples only (each file is part of the stage key)"
                )
            found[relative] = path
    if not found:
        raise CalibrationError(f"--calibration {folder}: no .npy or .npz files in it")
    if len(found) > MAX_CALIBRATION_FILES:
        raise CalibrationError(
            f"--calibration {folder}: {len(found)} files, more than {MAX_CALIBRATION_FILES}; "
            "stack samples into fewer arrays"
        )
    return dict(sorted(found.items()))


def calibration_identity(files: Mapping[str, Path]) -> dict[str, str]:
    """sha256 of each calibration file, by relative path."""
    return {relative: sha256_file(path) for relative, path in sorted(files.items())}


def calibration_digest(identity: Mapping[str, str]) -> str:
    """One digest naming a calibration set, for people and listings."""
    document = {"calibration": dict(sorted(identity.items()))}
    return hashlib.sha256(canonical_json(document)).hexdigest()


# --- targets ---------------------------------------------------------------------------------


def check_target(kind: str, args: Mapping[str, Any], target: Target | str) -> None:
    """Refuse a compression the target cannot run, naming why (before anything runs)."""
    device = target if isinstance(target, Target) else Target.parse(target)
    if kind != COMPRESS or args.get("mode") != "nf4" or not device.is_npu:
        return
    generation = _NPU_GENERATIONS.get(device.platform or "", 0)
    if generation < _NPU_GENERATIONS[NF4_MIN_NPU]:
        raise CompressionArgsError(
            f"--compress nf4 cannot run on {device}: the NF4 data type needs NPU "
            f"{NF4_MIN_NPU} (Lunar Lake, Core Ultra Series 2) or later; use int4-sym "
            "(or the npu-llm preset) for this NPU"
        )


# --- drift -----------------------------------------------------------------------------------

DRIFT_MEASURES = {
    "max-abs": ("max_abs_diff", "at most"),
    "cosine": ("min_cosine", "at least"),
    "top1": ("top1_agreement", "at least"),
}
"""`--max-drift` measures: the recorded metric each bounds, and the way it bounds it."""


@dataclass(frozen=True)
class DriftBound:
    """`--max-drift`: `0.05` (largest absolute difference) or `max-abs=0.05,cosine=0.999,
    top1=0.98`; every bound given must hold."""

    limits: tuple[tuple[str, float], ...]

    @classmethod
    def parse(cls, text: str) -> DriftBound:
        limits = []
        for part in text.split(","):
            name, _, value = part.strip().rpartition("=")
            name = name.strip().lower() or "max-abs"
            if name not in DRIFT_MEASURES:
                raise CompressionArgsError(
                    f"--max-drift {text!r}: {name!r} is not one of {', '.join(DRIFT_MEASURES)}"
                )
            try:
                number = float(value)
            except ValueError:
                number = math.nan
            if not math.isfinite(number) or number < 0 or (name != "max-abs" and number > 1):
                raise CompressionArgsError(
                    f"--max-drift {text!r}: {name} needs a number"
                    + (" from 0 to 1" if name != "max-abs" else " of at least 0")
                )
            limits.append((name, number))
        return cls(tuple(limits))

    def __str__(self) -> str:
        return ",".join(f"{name}={value:g}" for name, value in self.limits)

    def violations(self, metrics: Mapping[str, Any]) -> list[str]:
        """What in the recorded drift is outside the bound (empty when it holds)."""
        drift = metrics.get("drift") or {}
        broken = []
        for name, limit in self.limits:
            key, way = DRIFT_MEASURES[name]
            figure = drift.get(key)
            if figure is None:
                if name == "top1":
                    continue  # no output is class scores: nothing to agree on
                broken.append(f"{key} was not measured")
            elif (figure > limit) if way == "at most" else (figure < limit):
                broken.append(f"{key}={figure:.6g}, must be {way} {limit:g}")
        return broken

    def check(self, metrics: Mapping[str, Any]) -> None:
        """Raise `DriftExceeded` with the figures when the recorded drift is outside."""
        broken = self.violations(metrics)
        if broken:
            raise DriftExceeded(
                f"the compressed model drifts past --max-drift {self}: {'; '.join(broken)}",
                details={"drift": dict(metrics.get("drift") or {}), "bound": str(self)},
            )


def size_summary(metrics: Mapping[str, Any]) -> str:
    """`44.0 MB -> 6.1 MB (0.14x)`; empty when the stage recorded no sizes."""
    before, after = metrics.get("size_before"), metrics.get("size_after")
    if not before or after is None:
        return ""
    return f"{before / 1e6:.1f} MB -> {after / 1e6:.1f} MB ({after / before:.3g}x)"


def drift_summary(metrics: Mapping[str, Any]) -> str:
    """`max-abs 0.012 cosine 0.9998 top1 1` from a stage's recorded drift."""
    drift = metrics.get("drift") or {}
    parts = []
    for name, (key, _) in DRIFT_MEASURES.items():
        if drift.get(key) is not None:
            parts.append(f"{name} {drift[key]:.4g}")
    return " ".join(parts)
