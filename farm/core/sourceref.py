"""A source as submitted or pulled: its files' digests and the recipe it needs (docs §15).

The one function that turns a source on disk (IR, ONNX, `.tflite`, Paddle, SavedModel, `.pt2`,
TorchScript, a Hugging Face folder) and the arguments its conversion takes into the `ModelRef`
whose key a blob has: `farm submit`, `farm pull`, `farm verify`, `farm.edge.compile_model` and
`farm agent sync` all call it, so a submitter and an edge compute one key. Pure: standard
library only (an edge with `farm[edge]` has no framework to ask).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from farm.core import hashing, sources, stages
from farm.core.identity import Digest, ModelRef


def source_ref(
    model: str | Path,
    example_inputs: str | Sequence[Any] = (),
    task: str | None = None,
    extra: Sequence[stages.Stage] = (),
    *,
    progress: Callable[[int], None] | None = None,
    digests: Digest = hashing.sha256_file,
) -> tuple[ModelRef, sources.Source]:
    """The model at `model` (any format `sources.detect` knows), with the recipe it needs
    (`stages.recipe_for`: a convert stage with `example_inputs` and `task` where the format
    needs one) followed by the `extra` stages (compression). `example_inputs`:
    ``"x[1,3,224,224]:f32"`` strings (one string may hold several, separated by ``;``) or
    ``{"name", "shape", "dtype"}`` dicts."""
    if isinstance(example_inputs, str):
        example_inputs = (example_inputs,)
    source = sources.detect(model)
    recipe = (*stages.recipe_for(source, tuple(example_inputs), task), *extra)
    ref = ModelRef.from_source(model, progress, digests=digests).with_recipe(recipe)
    return ref, source
