"""Stages: the steps between a source and the model the compiler reads, and their keys.

A submission names a source (farm.core.sources) and a recipe: an ordered list of stages
(``convert``, then the kinds later issues register: ``compress``, ...). Each stage is
content-addressed by `stage_key`, from its input (the source's identity, or the previous
stage's key), its kind and its canonical arguments, and cached on its own: a second compile
spec of the same source converts nothing. The blob's cache key takes as its ``model`` part the
source identity when the recipe is empty (IR and ONNX, unchanged) and ``{"stage": final key}``
otherwise (`model_part`). docs/architecture.md §15.

Tool versions (torch, optimum, nncf) are not in any key: an edge without torch cannot know
them. A stage output, once recorded, is reused forever, and the reference outputs computed from
the source framework catch a conversion that drifts.

Adding a stage kind is one `register(StageKind(...))` call: its name, its canonical arguments
(two spellings -> one dict, unknown arguments refused) and the converter it needs, if any.

Pure: the standard library and farm.core only (the edge computes every key here).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from farm.core import compression
from farm.core.errors import SpecError
from farm.core.hashing import canonical_json
from farm.core.sources import (
    COMPILED_FORMATS,
    FORMATS,
    HUGGINGFACE,
    PADDLE,
    PADDLE_PIR,
    TORCH_FORMATS,
    Source,
    format_of,
    hf_task,
    safe_relative,
)

STAGE_KEY_VERSION = 1
"""In every stage key's document; golden vectors in tests/unit/test_golden.py pin it."""
MAX_STAGES = 8


@dataclass(frozen=True)
class StageKind:
    """One kind of stage: how its arguments are made canonical, and what it needs to run."""

    name: str
    canonical: Callable[[Mapping[str, Any]], dict[str, Any]]
    """Arguments as given (CLI spellings or canonical) -> the one canonical dict; SpecError
    for anything unknown or malformed."""
    needs: Callable[[Mapping[str, Any]], str | None] = lambda args: None
    """The converter a worker must have to run it (a key of CONVERTERS), given canonical
    args; None: OpenVINO alone."""


@dataclass(frozen=True)
class Converter:
    """A framework some stages need on the worker, and the extra that installs it."""

    name: str
    modules: tuple[str, ...]
    """Distributions whose versions the worker reports (importlib.metadata names)."""
    extra: str


CONVERTERS: dict[str, Converter] = {
    "torch": Converter("torch", ("torch",), "convert"),
    "optimum": Converter("optimum", ("optimum-intel", "transformers", "torch"), "convert"),
    # Paddle 3's .json (PIR) programs, which OpenVINO does not read: paddle2onnx, then ONNX.
    "paddle": Converter("paddle", ("paddle2onnx", "paddlepaddle"), "convert"),
    # GenAI pipeline bundles (§17): compiled by the releases the edge opens them with.
    "genai": Converter("genai", ("openvino-genai", "openvino-tokenizers"), "genai"),
}
"""Converters by name; other stage kinds add theirs (`register_converter`)."""

KINDS: dict[str, StageKind] = {}
"""Every stage kind farm knows, by name (`register`)."""


def register(kind: StageKind) -> StageKind:
    KINDS[kind.name] = kind
    return kind


def register_converter(converter: Converter) -> Converter:
    CONVERTERS[converter.name] = converter
    return converter


@dataclass(frozen=True)
class Stage:
    """One step of a recipe: a kind and its canonical arguments."""

    kind: str
    args: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def create(cls, kind: str, args: Mapping[str, Any] | None = None) -> Stage:
        """A stage with its arguments made canonical; SpecError for an unknown kind or arg."""
        known = KINDS.get(kind)
        if known is None:
            raise SpecError(f"unknown stage {kind!r}; known stages: {', '.join(sorted(KINDS))}")
        try:
            return cls(kind, known.canonical(dict(args or {})))
        except (TypeError, ValueError, AttributeError) as error:
            if isinstance(error, SpecError):
                raise
            raise SpecError(f"the {kind} stage's arguments are malformed: {error}") from None

    def canonical(self) -> dict[str, Any]:
        return {"stage": self.kind, "args": dict(self.args)}

    @property
    def needs(self) -> str | None:
        return KINDS[self.kind].needs(self.args)


Recipe = tuple[Stage, ...]


def recipe_from_json(data: Any) -> Recipe:
    """A recipe from its JSON form (a list of ``{"stage", "args"}``), every stage re-checked."""
    if data is None:
        return ()
    if not isinstance(data, list) or len(data) > MAX_STAGES:
        raise SpecError(f"a recipe is a list of at most {MAX_STAGES} stages")
    stages = []
    for item in data:
        if not isinstance(item, dict) or set(item) - {"stage", "args"} or "stage" not in item:
            raise SpecError('each stage of a recipe is {"stage": KIND, "args": {...}}')
        stages.append(Stage.create(str(item["stage"]), item.get("args") or {}))
    return tuple(stages)


def source_recipe(identity: Mapping[str, str], data: Any) -> Recipe:
    """The recipe of a submission, checked against its source: a source that needs converting
    starts with ``convert`` of its own format; IR and ONNX are never converted. Raises
    ModelFileError for files of no known format, SpecError for a recipe that does not fit."""
    fmt = format_of(identity)
    for role in identity:
        if "/" in role or "." in role:
            safe_relative(role)
    recipe = recipe_from_json(data)
    converts = [stage for stage in recipe if stage.kind == "convert"]
    if fmt in COMPILED_FORMATS:
        if converts:
            raise SpecError(f"a {fmt} model is compiled as it is: no convert stage")
        return recipe
    if not recipe or recipe[0].kind != "convert" or len(converts) != 1:
        raise SpecError(f"a {fmt} source needs one convert stage, first in its recipe")
    if recipe[0].args["format"] != fmt:
        raise SpecError(
            f"the convert stage is for {recipe[0].args['format']}, but the files are {fmt}"
        )
    if fmt == PADDLE and (recipe[0].args.get("program") == PADDLE_PIR) != ("json" in identity):
        raise SpecError("a Paddle 3 .json program converts with program pir, a .pdmodel without")
    return recipe


def recipe_json(recipe: Sequence[Stage]) -> list[dict[str, Any]]:
    return [stage.canonical() for stage in recipe]


def stage_key(input_: Mapping[str, Any], stage: Stage) -> str:
    """sha256 hex of the canonical JSON of the stage's input (``{"model": identity}`` or
    ``{"stage": previous key}``), kind and canonical arguments."""
    document = {
        "v": STAGE_KEY_VERSION,
        "input": dict(input_),
        "stage": stage.kind,
        "args": dict(stage.args),
    }
    return hashlib.sha256(canonical_json(document)).hexdigest()


def stage_keys(identity: Mapping[str, str], recipe: Sequence[Stage]) -> list[str]:
    """The key of each stage of `recipe` applied to the source `identity`, in order."""
    keys: list[str] = []
    input_: dict[str, Any] = {"model": dict(identity)}
    for stage in recipe:
        keys.append(stage_key(input_, stage))
        input_ = {"stage": keys[-1]}
    return keys


def model_part(identity: Mapping[str, str], recipe: Sequence[Stage]) -> dict[str, Any]:
    """The ``model`` object of the blob's cache key: the source identity for an empty recipe
    (every IR and ONNX key as it always was), else ``{"stage": final stage key}``."""
    if not recipe:
        return dict(identity)
    return {"stage": stage_keys(identity, recipe)[-1]}


def converters_needed(recipe: Sequence[Stage]) -> list[str]:
    """The converters a worker needs for `recipe`, sorted, without repeats."""
    return sorted({need for stage in recipe if (need := stage.needs)})


# --- the convert stage --------------------------------------------------------------------------

DTYPES = {
    "f32": "f32",
    "float32": "f32",
    "f16": "f16",
    "float16": "f16",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "i64": "i64",
    "int64": "i64",
    "i32": "i32",
    "int32": "i32",
    "i8": "i8",
    "int8": "i8",
    "u8": "u8",
    "uint8": "u8",
    "bool": "boolean",
    "boolean": "boolean",
}
"""Element types an example input may name, to OpenVINO's short names."""
NUMPY_DTYPES = {
    "f32": "float32",
    "f16": "float16",
    "bf16": "float32",
    "i64": "int64",
    "i32": "int32",
    "i8": "int8",
    "u8": "uint8",
    "boolean": "bool",
}
_EXAMPLE = re.compile(
    r"^\s*(?P<name>[^\[\]:;]*?)\s*\[(?P<dims>[^\]]*)\]\s*(?::\s*(?P<dtype>\w+))?\s*$"
)
_TASK = re.compile(r"^[a-z0-9][a-z0-9-]{0,63}$")
MAX_EXAMPLE_INPUTS = 64
MAX_EXAMPLE_DIM = 2**20


def parse_example_inputs(values: Sequence[Any]) -> list[dict[str, Any]]:
    """``name[1,3,224,224]:f32`` (name optional, dtype default f32), several separated by
    ``;`` or given as a list, or their canonical ``{"name", "shape", "dtype"}`` dicts ->
    canonical dicts in the order given (the model's positional arguments)."""
    entries: list[Any] = []
    for value in values:
        if isinstance(value, str):
            entries += [part for part in value.split(";") if part.strip()]
        else:
            entries.append(value)
    if len(entries) > MAX_EXAMPLE_INPUTS:
        raise SpecError(f"at most {MAX_EXAMPLE_INPUTS} example inputs")
    parsed = [_example(entry) for entry in entries]
    names = [p["name"] for p in parsed if p["name"]]
    if len(names) != len(set(names)):
        raise SpecError(f"--example-input names an input twice: {names}")
    return parsed


def _example(entry: Any) -> dict[str, Any]:
    if isinstance(entry, Mapping):
        if set(entry) - {"name", "shape", "dtype"}:
            raise SpecError(f"an example input has name, shape and dtype, not {sorted(entry)}")
        text = f"{entry.get('name', '')}{list(entry.get('shape', []))}:{entry.get('dtype', 'f32')}"
        return _example(text.replace(" ", ""))
    match = _EXAMPLE.match(str(entry))
    if not match:
        raise SpecError(
            f"--example-input {entry!r}: write NAME[d1,d2,...]:TYPE, for example "
            "input[1,3,224,224]:f32 (NAME and :TYPE optional)"
        )
    try:
        dims = [int(d) for d in match["dims"].split(",") if d.strip()]
    except ValueError:
        raise SpecError(f"--example-input {entry!r}: dimensions are integers") from None
    if any(d < 1 or d > MAX_EXAMPLE_DIM for d in dims) or len(dims) > 8:
        raise SpecError(f"--example-input {entry!r}: up to 8 dimensions, each 1..{MAX_EXAMPLE_DIM}")
    dtype = (match["dtype"] or "f32").lower()
    if dtype not in DTYPES:
        raise SpecError(
            f"--example-input {entry!r}: unknown type {dtype!r}; use one of "
            f"{', '.join(sorted(set(DTYPES.values())))}"
        )
    return {"name": match["name"].strip(), "shape": dims, "dtype": DTYPES[dtype]}


def _convert_args(args: Mapping[str, Any]) -> dict[str, Any]:
    spellings = {"example-input": "example_input", "example_inputs": "example_input"}
    args = {spellings.get(k, k): v for k, v in args.items()}
    unknown = set(args) - {"format", "example_input", "task", "program"}
    if unknown:
        raise SpecError(
            f"convert takes format, example_input, task and program, not {sorted(unknown)}"
        )
    fmt = str(args.get("format") or "")
    if fmt not in FORMATS:
        raise SpecError(f"convert: unknown source format {fmt!r}; known: {', '.join(FORMATS)}")
    canonical: dict[str, Any] = {"format": fmt}
    program = args.get("program")
    if program:
        if fmt != PADDLE or program != PADDLE_PIR:
            raise SpecError(f"convert: program {program!r} is for Paddle 3 (.json) sources: pir")
        canonical["program"] = PADDLE_PIR
    examples = args.get("example_input") or []
    if examples:
        if fmt not in TORCH_FORMATS:
            raise SpecError(f"--example-input is for PyTorch sources, not {fmt}")
        values = examples if isinstance(examples, list | tuple) else [examples]
        canonical["example_input"] = parse_example_inputs(values)
    task = args.get("task")
    if task:
        if fmt != HUGGINGFACE:
            raise SpecError(f"--task is for Hugging Face folders, not {fmt}")
        if not _TASK.match(str(task)):
            raise SpecError(f"--task {task!r}: a task name such as text-generation")
        canonical["task"] = str(task)
    elif fmt == HUGGINGFACE:
        raise SpecError("a Hugging Face folder needs its task: give --task (text-generation, ...)")
    return canonical


def _convert_needs(args: Mapping[str, Any]) -> str | None:
    if args["format"] in TORCH_FORMATS:
        return "torch"
    if args["format"] == HUGGINGFACE:
        return "optimum"
    if args.get("program") == PADDLE_PIR:
        return "paddle"
    return None


CONVERT = register(StageKind("convert", _convert_args, _convert_needs))


def convert_stage(
    fmt: str, example_input: Sequence[Any] = (), task: str | None = None, program: str = ""
) -> Stage:
    args: dict[str, Any] = {"format": fmt}
    if program:
        args["program"] = program
    if example_input:
        args["example_input"] = list(example_input)
    if task:
        args["task"] = task
    return Stage.create("convert", args)


def recipe_for(
    source: Source, example_input: Sequence[Any] = (), task: str | None = None
) -> Recipe:
    """The recipe a source needs: none for IR and ONNX, else one convert stage (a Hugging Face
    folder's task read from its config.json when not given). The edge calls this too, to
    compute the same key offline."""
    if not source.needs_conversion:
        if example_input or task:
            raise SpecError(
                f"--example-input and --task are for sources to convert, not {source.format}"
            )
        return ()
    if source.format == HUGGINGFACE and not task:
        task = hf_task(source)
        if task is None:
            raise SpecError(
                f"{source.path}: config.json names no architecture farm knows the task of: "
                "give --task (text-generation-with-past, text-classification, "
                "feature-extraction, ...)"
            )
    program = PADDLE_PIR if source.format == PADDLE and "json" in source.files else ""
    return (convert_stage(source.format, example_input, task, program),)


# --- the compress and quantize stages (farm/core/compression.py, §15) ---------------------------

NNCF = register_converter(Converter("nncf", ("nncf",), "compress"))
COMPRESS = register(
    StageKind(compression.COMPRESS, compression.canonical_compress, lambda args: NNCF.name)
)
QUANTIZE = register(
    StageKind(compression.QUANTIZE, compression.canonical_quantize, lambda args: NNCF.name)
)
