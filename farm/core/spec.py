"""What a blob is compiled for: `Target`, `CompileSpec`, `Toolchain`, and their canonical form.

Pure: no I/O, no OpenVINO. Everything that changes a compiled blob is in here, validated, and
rendered in exactly one canonical form, because that form is hashed into the cache key
(docs/architecture.md §5): two spellings of one spec must give one key, and a typo must be an error
rather than a silently different key.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from farm.core.errors import SpecError

# Maximum tiles (NCE/DPU clusters) per NPU platform. NPU_TILES above this is rejected here,
# before any compiler runs, because the compiler's own error arrives minutes later on a worker.
MAX_TILES: dict[str, int] = {
    # Meteor Lake NPU 3720: 2 tiles. openvinotoolkit/npu_plugin, getPlatformDPUClusterNum():
    # NPU3720 -> 2 (src/vpux_compiler/src/utils/platform_resources.cpp).
    "3720": 2,
    # Lunar Lake NPU 4000: 6 tiles. Same function: NPU4000 -> 6; Intel's NPU 4 material
    # ("6 neural compute engines") agrees.
    "4000": 6,
    # Panther Lake NPU 5010 / 5020: 6 tiles, unconfirmed in public compiler source; Intel's
    # Panther Lake NPU 5 material describes the same 6 NCE count as NPU 4. Revisit when the
    # compiler source for NPU50XX is public.
    "5010": 6,
    "5020": 6,
}

# Compiler parameters accepted in NPU_COMPILATION_MODE_PARAMS, with their allowed values
# (OpenVINO NPU device documentation, "npu-device.rst", compilation mode params).
COMPILER_PARAMS: dict[str, frozenset[str]] = {
    "optimization-level": frozenset({"0", "1", "2"}),
    "performance-hint-override": frozenset({"efficiency", "latency"}),
}

PERFORMANCE_HINTS = ("LATENCY", "THROUGHPUT")


@dataclass(frozen=True)
class _Property:
    """One allowlisted OpenVINO property: its allowed values, or a check for integers."""

    values: frozenset[str] | None = None
    integer_min: int | None = None
    doc: str = ""

    def normalize(self, key: str, raw: str) -> str:
        value = raw.strip()
        if self.values is not None:
            by_fold = {v.casefold(): v for v in self.values}
            if value.casefold() not in by_fold:
                allowed = ", ".join(sorted(self.values))
                raise SpecError(f"{key}={raw!r} is not allowed; use one of: {allowed}")
            return by_fold[value.casefold()]
        try:
            number = int(value)
        except ValueError:
            raise SpecError(f"{key}={raw!r} must be an integer") from None
        if self.integer_min is not None and number < self.integer_min:
            raise SpecError(f"{key}={raw!r} must be at least {self.integer_min}")
        return str(number)


_YES_NO = frozenset({"YES", "NO"})
_PRECISIONS = frozenset({"f32", "f16", "bf16"})

# Extra OpenVINO properties (`--config KEY=VALUE`) that may change a blob, per device. Anything
# else is rejected: an unknown key would otherwise be silently ignored by OpenVINO while still
# changing the cache key. Properties that farm sets from its own flags are not in these lists.
EXTRA_PROPERTIES: dict[str, dict[str, _Property]] = {
    "CPU": {
        "INFERENCE_PRECISION_HINT": _Property(_PRECISIONS, doc="precision of inference"),
        "EXECUTION_MODE_HINT": _Property(frozenset({"PERFORMANCE", "ACCURACY"})),
        "KV_CACHE_PRECISION": _Property(frozenset({"f32", "f16", "bf16", "u8", "u4", "i8"})),
        "DYNAMIC_QUANTIZATION_GROUP_SIZE": _Property(integer_min=0),
        "NUM_STREAMS": _Property(integer_min=1),
        "PERFORMANCE_HINT_NUM_REQUESTS": _Property(integer_min=0),
    },
    "NPU": {
        "NPU_BATCH_MODE": _Property(frozenset({"AUTO", "COMPILER", "PLUGIN"})),
        "NPU_COMPILER_TYPE": _Property(frozenset({"DRIVER", "PLUGIN"})),
        "NPU_QDQ_OPTIMIZATION": _Property(_YES_NO),
        "NPU_TURBO": _Property(_YES_NO),
        "EXECUTION_MODE_HINT": _Property(frozenset({"PERFORMANCE", "ACCURACY"})),
        "INFERENCE_PRECISION_HINT": _Property(frozenset({"f16", "i8"})),
        "PERFORMANCE_HINT_NUM_REQUESTS": _Property(integer_min=0),
    },
}

# Properties farm derives from its own flags; `--config` may not set them behind its back.
_OWN_PROPERTIES = {
    "PERFORMANCE_HINT": "--hint",
    "NPU_TILES": "--tiles",
    "NPU_MAX_TILES": "--tiles",
    "NPU_PLATFORM": "--device",
    "NPU_COMPILATION_MODE_PARAMS": "--compiler-params",
    "CACHE_MODE": "--weightless",
    "CACHE_DIR": None,
    "CACHE_BLOB_ID": None,
    "WEIGHTS_PATH": None,
}

MAX_DIM = 2**31 - 1
MAX_ELEMENTS = 2**40
MAX_RANK = 8
MAX_BATCH = 4096
SINGLE_INPUT = ""
"""Key of a shape or layout given without an input name: it applies to the model's only input."""


@dataclass(frozen=True)
class Target:
    """A device a blob is compiled for: ``NPU.<platform>`` or ``CPU``."""

    device: str
    platform: str | None = None

    @property
    def name(self) -> str:
        return f"{self.device}.{self.platform}" if self.platform else self.device

    @property
    def is_npu(self) -> bool:
        return self.device == "NPU"

    @property
    def max_tiles(self) -> int | None:
        return MAX_TILES[self.platform] if self.platform else None

    def __str__(self) -> str:
        return self.name

    @classmethod
    def parse(cls, text: str) -> Target:
        """``4000``, ``NPU4000``, ``NPU.4000``, ``npu.4000`` → ``NPU.4000``; ``cpu`` → ``CPU``."""
        raw = text.strip().upper()
        if raw == "CPU":
            return cls("CPU")
        platform = re.sub(r"^NPU\.?", "", raw)
        if platform in MAX_TILES:
            return cls("NPU", platform)
        raise SpecError(f"unknown device {text!r}; known devices: {', '.join(KNOWN_TARGETS)}")


KNOWN_TARGETS = (*(f"NPU.{p}" for p in MAX_TILES), "CPU")


@dataclass(frozen=True)
class Toolchain:
    """What produced (or will import) a blob."""

    openvino: str
    """OpenVINO release, ``X.Y.Z``."""
    openvino_build: str | None = None
    npu_compiler: str | None = None
    runtime_requirements: str | None = None
    """CPU only: ``RUNTIME_REQUIREMENTS`` of the compiled model (OpenVINO version + ISA)."""

    def key_part(self, target: Target) -> dict[str, str]:
        """The part of the toolchain that goes into the cache key for `target`.

        NPU blobs are keyed by OpenVINO release only: an edge has no compiler whose version it
        could know. CPU blobs import only where RUNTIME_REQUIREMENTS match byte for byte.
        """
        part = {"openvino": self.openvino}
        if not target.is_npu:
            if not self.runtime_requirements:
                raise SpecError("a CPU toolchain needs its RUNTIME_REQUIREMENTS string")
            part["runtime_requirements"] = self.runtime_requirements
        return part

    @classmethod
    def from_json(cls, data: Any, for_targets: Iterable[Target] = ()) -> Toolchain:
        """The toolchain `farm toolchain --json` printed: one object, or a list of them (one
        per target; the CPU entry carries the runtime requirements). `for_targets`: the
        targets it is to compile for; a file whose entries name their targets must have one of
        each kind (NPU, CPU): an edge's CPU toolchain says nothing of what its NPU imports."""
        entries = data if isinstance(data, list) else [data]
        if not entries or not all(isinstance(e, dict) and e.get("openvino") for e in entries):
            raise SpecError("a toolchain file holds what `farm toolchain --json` prints")
        if all(isinstance(e.get("target"), str) for e in entries):
            described = {Target.parse(e["target"]).is_npu for e in entries}
            for target in for_targets:
                if target.is_npu not in described:
                    raise SpecError(
                        f"the toolchain file describes {', '.join(e['target'] for e in entries)}, "
                        f"not {target}: write it with `farm toolchain --device {target.name} "
                        "--json` on the edge that imports the blob"
                    )
        releases = {str(e["openvino"]) for e in entries}
        if len(releases) != 1:
            raise SpecError(f"a toolchain file names one OpenVINO release, not {sorted(releases)}")
        cpu = next((e for e in entries if e.get("runtime_requirements")), entries[0])
        npu: dict[str, Any] = next((e for e in entries if e.get("npu_compiler")), {})
        return cls(
            openvino=releases.pop(),
            openvino_build=cpu.get("openvino_build"),
            npu_compiler=npu.get("npu_compiler"),
            runtime_requirements=cpu.get("runtime_requirements"),
        )

    def as_dict(self) -> dict[str, str | None]:
        return {
            "openvino": self.openvino,
            "openvino_build": self.openvino_build,
            "npu_compiler": self.npu_compiler,
            "runtime_requirements": self.runtime_requirements,
        }


@dataclass(frozen=True)
class CompileSpec:
    """Everything besides the model and the toolchain that decides the compiled blob.

    Build one with `CompileSpec.create` (validates and normalises); the fields then hold the
    canonical values, so equal specs compare equal however they were written.
    """

    target: Target
    tiles: int | None = None
    performance_hint: str | None = None
    compiler_params: dict[str, str] = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    batch: int | None = None
    layout: dict[str, str] = field(default_factory=dict)
    weightless: bool = False
    config: dict[str, str] = field(default_factory=dict)

    @classmethod
    def create(
        cls,
        target: Target | str,
        *,
        tiles: int | None = None,
        performance_hint: str | None = None,
        compiler_params: str | Mapping[str, str] | None = None,
        shapes: Mapping[str, Iterable[int]] | Iterable[str] | None = None,
        batch: int | None = None,
        layout: Mapping[str, str] | Iterable[str] | None = None,
        weightless: bool = False,
        config: Mapping[str, str] | Iterable[str] | None = None,
    ) -> CompileSpec:
        """Validate and normalise. String forms are the CLI's (``x[1,3,224,224]``, ``x:NCHW``,
        ``KEY=VALUE``, ``optimization-level=2 performance-hint-override=latency``)."""
        target = target if isinstance(target, Target) else Target.parse(target)
        parsed_shapes = _parse_shapes(shapes)
        parsed_layout = _parse_layouts(layout)
        if batch is not None:
            if isinstance(batch, bool) or not isinstance(batch, int) or not 1 <= batch <= MAX_BATCH:
                raise SpecError(f"batch={batch!r} must be an integer from 1 to {MAX_BATCH}")
            if parsed_shapes:
                raise SpecError("give the batch either in --shape or with --batch, not both")
            for name, text in parsed_layout.items():
                if "N" not in text:
                    raise SpecError(f"layout {_input_label(name)}{text} has no batch axis N")
        elif parsed_layout:
            raise SpecError("--layout only says where the batch axis is; it needs --batch")
        return cls(
            target=target,
            tiles=_check_tiles(target, tiles),
            performance_hint=_check_hint(performance_hint),
            compiler_params=_parse_compiler_params(target, compiler_params),
            shapes=parsed_shapes,
            batch=batch,
            layout=parsed_layout,
            weightless=bool(weightless),
            config=_parse_config(target, config),
        )

    def canonical(self) -> dict[str, Any]:
        """The ``spec`` object of the cache key (docs/architecture.md §5); JSON-ready, target
        excluded."""
        return {
            "tiles": self.tiles,
            "performance_hint": self.performance_hint,
            "compiler_params": render_compiler_params(self.compiler_params) or None,
            "shapes": {name: list(dims) for name, dims in sorted(self.shapes.items())},
            "batch": self.batch,
            "layout": dict(sorted(self.layout.items())),
            "weightless": self.weightless,
            "config": dict(sorted(self.config.items())),
        }

    @classmethod
    def from_canonical(cls, target: Target | str, canonical: Mapping[str, Any]) -> CompileSpec:
        """Inverse of `canonical` (with the target given apart), validated again."""
        known = {
            "tiles",
            "performance_hint",
            "compiler_params",
            "shapes",
            "batch",
            "layout",
            "weightless",
            "config",
        }
        unknown = set(canonical) - known
        if unknown:
            raise SpecError(f"unknown spec fields: {', '.join(sorted(unknown))}")
        return cls.create(target, **{k: v for k, v in canonical.items()})

    def cli_args(self) -> list[str]:
        """The `farm submit` flags that produce this spec (device included)."""
        args = ["--device", self.target.name]
        if self.tiles is not None:
            args += ["--tiles", str(self.tiles)]
        if self.performance_hint:
            args += ["--hint", self.performance_hint]
        if self.compiler_params:
            args += ["--compiler-params", render_compiler_params(self.compiler_params)]
        for name, dims in sorted(self.shapes.items()):
            args += ["--shape", f"{name}[{','.join(map(str, dims))}]"]
        if self.batch is not None:
            args += ["--batch", str(self.batch)]
        for name, text in sorted(self.layout.items()):
            args += ["--layout", f"{_input_label(name)}{text}"]
        if self.weightless:
            args.append("--weightless")
        for key, value in sorted(self.config.items()):
            args += ["--config", f"{key}={value}"]
        return args

    def summary(self) -> str:
        """One line for people: ``NPU.4000 --tiles 4 --hint LATENCY`` (the flags that made it)."""
        return " ".join([self.target.name, *self.cli_args()[2:]])


def render_compiler_params(params: Mapping[str, str]) -> str:
    return " ".join(f"{key}={value}" for key, value in sorted(params.items()))


def _input_label(name: str) -> str:
    return f"{name}:" if name else ""


def _check_tiles(target: Target, tiles: int | None) -> int | None:
    if tiles is None:
        return None
    if not target.is_npu:
        raise SpecError(f"tiles apply to NPU targets only, not {target}")
    if isinstance(tiles, bool) or not isinstance(tiles, int):
        raise SpecError(f"tiles={tiles!r} must be an integer")
    maximum = target.max_tiles
    assert maximum is not None  # an NPU target has its platform's maximum
    if not 1 <= tiles <= maximum:
        raise SpecError(
            f"tiles={tiles} is outside what {target} supports (1 to {target.max_tiles})"
        )
    return tiles


def _check_hint(hint: str | None) -> str | None:
    if hint is None:
        return None
    upper = str(hint).strip().upper()
    if upper not in PERFORMANCE_HINTS:
        raise SpecError(f"performance hint {hint!r} is not one of {', '.join(PERFORMANCE_HINTS)}")
    return upper


def _parse_compiler_params(
    target: Target, params: str | Mapping[str, str] | None
) -> dict[str, str]:
    if not params:
        return {}
    if not target.is_npu:
        raise SpecError(f"compiler parameters apply to NPU targets only, not {target}")
    if isinstance(params, str):
        pairs = []
        for item in params.split():
            key, sep, value = item.partition("=")
            if not sep:
                raise SpecError(f"compiler parameter {item!r} is not KEY=VALUE")
            pairs.append((key, value))
    else:
        pairs = list(params.items())
    parsed: dict[str, str] = {}
    for key, value in pairs:
        key, value = str(key).strip().lower(), str(value).strip().lower()
        if key not in COMPILER_PARAMS:
            raise SpecError(
                f"unknown compiler parameter {key!r}; known: {', '.join(sorted(COMPILER_PARAMS))}"
            )
        if value not in COMPILER_PARAMS[key]:
            allowed = ", ".join(sorted(COMPILER_PARAMS[key]))
            raise SpecError(f"compiler parameter {key}={value!r} is not one of: {allowed}")
        if key in parsed and parsed[key] != value:
            raise SpecError(f"compiler parameter {key} given twice with different values")
        parsed[key] = value
    return parsed


_SHAPE = re.compile(r"^(?P<name>[^\[\]]*)\[(?P<dims>[^\[\]]*)\]$")


def parse_shape(text: str) -> tuple[str, tuple[int, ...]]:
    """``x[1,3,224,224]`` → ``("x", (1, 3, 224, 224))``; ``[1,3]`` → ``("", (1, 3))``."""
    match = _SHAPE.match(text.strip())
    if not match:
        raise SpecError(f"shape {text!r} is not NAME[d1,d2,...] or [d1,d2,...]")
    name = match["name"].strip()
    dims_text = match["dims"].strip()
    parts = [p.strip() for p in dims_text.split(",")] if dims_text else []
    dims = []
    for part in parts:
        if not re.fullmatch(r"\d+", part):
            raise SpecError(
                f"shape {text!r}: dimension {part!r} must be a positive integer "
                "(NPU blobs need static shapes)"
            )
        dims.append(int(part))
    return name, _check_dims(text, name, dims)


def _check_dims(text: str, name: str, dims: Iterable[Any]) -> tuple[int, ...]:
    dims = tuple(dims)
    if not dims or len(dims) > MAX_RANK:
        raise SpecError(f"shape {text!r} must have 1 to {MAX_RANK} dimensions")
    elements = 1
    for dim in dims:
        if isinstance(dim, bool) or not isinstance(dim, int) or not 1 <= dim <= MAX_DIM:
            raise SpecError(f"shape {text!r}: dimension {dim!r} must be from 1 to {MAX_DIM}")
        elements *= dim
    if elements > MAX_ELEMENTS:
        raise SpecError(f"shape {text!r} has {elements} elements, more than {MAX_ELEMENTS}")
    _check_input_name(name)
    return dims


def _check_input_name(name: str) -> None:
    # Printable: no control characters, and no lone surrogates (a name that was not UTF-8),
    # which the canonical JSON of the cache key could not encode.
    if len(name) > 256 or not name.isprintable():
        raise SpecError(f"input name {name[:40]!r} is not a usable input name")


def _single_or_named(kind: str, entries: dict[str, Any]) -> dict[str, Any]:
    if SINGLE_INPUT in entries and len(entries) > 1:
        raise SpecError(f"a {kind} without an input name is only allowed for a single input")
    return entries


def _parse_shapes(shapes: Mapping[str, Iterable[int]] | Iterable[str] | None) -> dict:
    result: dict[str, tuple[int, ...]] = {}
    if not shapes:
        return result
    if isinstance(shapes, Mapping):
        items = [(str(n), _check_dims(f"{n}{list(d)}", str(n), d)) for n, d in shapes.items()]
    else:
        items = [parse_shape(text) for text in shapes]
    for name, dims in items:
        if name in result and result[name] != dims:
            raise SpecError(f"two different shapes for input {name or '(single input)'}")
        result[name] = dims
    return _single_or_named("shape", result)


_LAYOUT = re.compile(r"^(?:[A-Z?]|\.\.\.)+$")


def _parse_layouts(layout: Mapping[str, str] | Iterable[str] | None) -> dict[str, str]:
    result: dict[str, str] = {}
    if not layout:
        return result
    if isinstance(layout, Mapping):
        items = [(str(k), str(v)) for k, v in layout.items()]
    else:
        items = []
        for text in layout:
            name, sep, value = str(text).rpartition(":")
            items.append((name.strip() if sep else SINGLE_INPUT, value))
    for name, value in items:
        _check_input_name(name)
        text = value.strip().upper().replace("[", "").replace("]", "").replace(",", "")
        if not _LAYOUT.match(text) or len(set(text.replace("?", "").replace("...", ""))) != len(
            text.replace("?", "").replace("...", "")
        ):
            raise SpecError(f"layout {value!r} is not a layout like NCHW or N...C")
        result[name] = text
    return _single_or_named("layout", result)


def _parse_config(target: Target, config: Mapping[str, str] | Iterable[str] | None) -> dict:
    if not config:
        return {}
    if isinstance(config, Mapping):
        items = [(str(k), str(v)) for k, v in config.items()]
    else:
        items = []
        for text in config:
            key, sep, value = str(text).partition("=")
            if not sep:
                raise SpecError(f"--config {text!r} is not KEY=VALUE")
            items.append((key, value))
    allowed = EXTRA_PROPERTIES[target.device]
    result: dict[str, str] = {}
    for raw_key, raw_value in items:
        key = raw_key.strip().upper()
        if key in _OWN_PROPERTIES:
            flag = _OWN_PROPERTIES[key]
            hint = f"; use {flag}" if flag else ""
            raise SpecError(f"{key} is set by farm itself, not through --config{hint}")
        if key not in allowed:
            raise SpecError(
                f"property {raw_key!r} is not allowed for {target.device} targets; "
                f"allowed: {', '.join(sorted(allowed))}"
            )
        result[key] = allowed[key].normalize(key, raw_value)
    return result


def compile_properties(spec: CompileSpec) -> dict[str, str]:
    """OpenVINO properties for `spec`, as strings (they are logged and stored with the job)."""
    target = spec.target
    props: dict[str, str] = {}
    if target.is_npu:
        assert target.platform is not None  # every NPU target names its platform
        props["NPU_PLATFORM"] = target.platform
        # Without a device the plugin cannot learn the tile count; it needs the platform's.
        props["NPU_MAX_TILES"] = str(target.max_tiles)
        if spec.tiles is not None:
            props["NPU_TILES"] = str(spec.tiles)
        if spec.compiler_params:
            props["NPU_COMPILATION_MODE_PARAMS"] = spec.canonical()["compiler_params"]
        if spec.batch is not None:
            # The model is reshaped to this batch: compile it at that batch, rather than let
            # AUTO decide by what the host's driver supports (--config NPU_BATCH_MODE wins).
            props["NPU_BATCH_MODE"] = "COMPILER"
    if spec.performance_hint:
        props["PERFORMANCE_HINT"] = spec.performance_hint
    if spec.weightless:
        # ENABLE_WEIGHTLESS alone does nothing on export; OPTIMIZE_SIZE drops the weights.
        props["CACHE_MODE"] = "OPTIMIZE_SIZE"
    props.update(spec.config)
    return props
