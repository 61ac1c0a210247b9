"""Reference outputs: the numbers a blob must reproduce, and the rule that says it did.

A worker runs the source model on CPU in f32 when it compiles a blob, with inputs it can make
again from the cache key alone (or inputs the submitter gave), and stores inputs and outputs
beside the blob as one `.npz`. An edge that imports the blob runs the same inputs and compares
(`compare`): a blob that imports is not yet a blob that computes the right numbers, and NPU
blobs are known to be driver-sensitive per model. docs/architecture.md §14.

Pure numpy and the standard library: the edge needs every rule here, and the worker must write
exactly what the edge reads.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from farm.core.errors import IntegrityMismatch, SpecError
from farm.core.tolerance import TOLERANCES, Tolerance, default_tolerance

__all__ = [
    "TOLERANCES",
    "InputSpec",
    "OutputComparison",
    "Reference",
    "Tolerance",
    "compare",
    "default_tolerance",
    "load_inputs",
    "output_label",
    "percentile",
    "seeded_inputs",
    "summary",
]

REFERENCE_FORMAT = "farm-reference-v1"
"""Written in every reference file; a reader refuses any other."""
_META = "meta"


@dataclass(frozen=True)
class InputSpec:
    """One input of a compiled model as the reference run sees it: name, static shape, dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str


def seeded_inputs(cache_key: str, inputs: Sequence[InputSpec]) -> dict[str, np.ndarray]:
    """Deterministic inputs: each seeded from the cache key and the input's name, so the same
    key always gets the same numbers (and different inputs differ). Floats are uniform in
    [-1, 1), integers and booleans 0 or 1: valid as token ids, token type ids, attention masks
    and indices of any model (a larger value can index past a small table, or turn a mask's
    `(1 - m) * -10000` into an fp16 overflow on an NPU). A model that needs real data takes
    the submitter's `--inputs`."""
    made = {}
    for spec in inputs:
        seed = int.from_bytes(hashlib.sha256(f"{cache_key}\n{spec.name}".encode()).digest()[:8])
        rng = np.random.default_rng(seed)
        dtype = np.dtype(spec.dtype)
        # np.asarray: for a 0-d input numpy's generators return a scalar, not an array.
        if np.issubdtype(dtype, np.integer) or dtype == np.bool_:
            value = np.asarray(rng.integers(0, 2, size=spec.shape))
        else:
            value = np.asarray(rng.random(spec.shape, dtype=np.float64) * 2 - 1)
        made[spec.name] = value.astype(dtype)
    return made


def output_label(names: Iterable[str], index: int) -> str:
    """The name an output is known by: the model's own name for it. An output tensor may carry
    several names (ONNX's graph output name beside internal ones such as
    "/decoder/Conv_output_0" or "Identity:0"): a name without "/" or ":" first, then the
    shortest, then the first in order; `output<index>` for an output without any."""
    ranked = sorted(names, key=lambda name: ("/" in name or ":" in name, len(name), name))
    return ranked[0] if ranked else f"output{index}"


@dataclass(frozen=True)
class Reference:
    """Inputs by name, and the outputs the source model computed from them, by name."""

    inputs: dict[str, np.ndarray]
    outputs: dict[str, np.ndarray]

    def to_bytes(self) -> bytes:
        """An uncompressed `.npz`: arrays by position, names in a JSON member (tensor names
        may hold any character; an archive member's name may not)."""
        arrays: dict[str, Any] = {}
        for prefix, group in (("input", self.inputs), ("output", self.outputs)):
            for index, value in enumerate(group.values()):
                # Not np.ascontiguousarray: it turns a 0-d array (a scalar input) into shape (1,).
                arrays[f"{prefix}{index}"] = np.asarray(value, order="C")
        meta = {
            "format": REFERENCE_FORMAT,
            "inputs": list(self.inputs),
            "outputs": list(self.outputs),
        }
        arrays[_META] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
        buffer = io.BytesIO()
        np.savez(buffer, **arrays)
        return buffer.getvalue()

    def save(self, path: Path) -> Path:
        Path(path).write_bytes(self.to_bytes())
        return Path(path)

    @classmethod
    def load(cls, path: Path | BinaryIO) -> Reference:
        """Read a reference file, refusing anything but this format (no pickles, ever)."""
        try:
            with np.load(path, allow_pickle=False) as archive:
                meta = json.loads(bytes(archive[_META]).decode())
                if meta.get("format") != REFERENCE_FORMAT:
                    raise ValueError(f"format {meta.get('format')!r}, not {REFERENCE_FORMAT}")
                inputs = {n: archive[f"input{i}"] for i, n in enumerate(meta["inputs"])}
                outputs = {n: archive[f"output{i}"] for i, n in enumerate(meta["outputs"])}
        except (OSError, EOFError, ValueError, KeyError, TypeError) as error:
            raise IntegrityMismatch(f"{path} is not a farm reference file: {error}") from None
        return cls(inputs, outputs)


def load_inputs(path: Path) -> dict[str, np.ndarray]:
    """The submitter's `--inputs` file: an `.npz` of arrays named after the model's inputs."""
    try:
        loaded = np.load(path, allow_pickle=False)
        if not isinstance(loaded, np.lib.npyio.NpzFile):
            raise ValueError("one array (.npy), not an .npz of arrays named after the inputs")
        with loaded as archive:
            return {name: archive[name] for name in archive.files}
    except (OSError, EOFError, ValueError, TypeError) as error:
        raise SpecError(f"--inputs {path}: not a readable .npz of input arrays ({error})") from None


@dataclass(frozen=True)
class OutputComparison:
    name: str
    max_abs_error: float
    mean_abs_error: float
    cosine: float
    passed: bool


def compare(
    expected: Mapping[str, np.ndarray],
    actual: Mapping[str, np.ndarray],
    tolerance: Tolerance,
) -> list[OutputComparison]:
    """Each expected output against the one of the same name, else (a compiled blob may rename
    its outputs) the one at the same position, if that one's name matches no expected output:
    a missing output or another shape fails."""
    positions = list(actual)
    results = []
    for index, (name, want) in enumerate(expected.items()):
        got = actual.get(name)
        if got is None and index < len(positions) and positions[index] not in expected:
            got = actual[positions[index]]
        if got is None or np.shape(got) != np.shape(want):
            results.append(OutputComparison(name, math.inf, math.inf, 0.0, False))
            continue
        results.append(_compare_one(name, np.asarray(want), np.asarray(got), tolerance))
    return results


def _compare_one(
    name: str, want: np.ndarray, got: np.ndarray, tolerance: Tolerance
) -> OutputComparison:
    want64, got64 = want.astype(np.float64).ravel(), got.astype(np.float64).ravel()
    if want64.size == 0:
        return OutputComparison(name, 0.0, 0.0, 1.0, True)
    if not (np.isfinite(want64).all() and np.isfinite(got64).all()):
        same = bool(np.array_equal(want64, got64, equal_nan=True))
        error = 0.0 if same else math.inf
        return OutputComparison(name, error, error, 1.0 if same else 0.0, same)
    difference = np.abs(got64 - want64)
    max_abs, mean_abs = float(difference.max()), float(difference.mean())
    norms = float(np.linalg.norm(want64) * np.linalg.norm(got64))
    if norms == 0.0:  # both zero is a match; one zero is not
        cosine = 1.0 if not want64.any() and not got64.any() else 0.0
    else:
        cosine = float(np.clip(np.dot(want64, got64) / norms, -1.0, 1.0))  # rounding: 1 + 1e-16
    bound = tolerance.atol + tolerance.rtol * float(np.abs(want64).max())
    passed = max_abs <= bound and cosine >= tolerance.min_cosine
    return OutputComparison(name, max_abs, mean_abs, cosine, passed)


def summary(results: Sequence[OutputComparison]) -> dict[str, Any]:
    """The worst figures over all outputs, as the farm records them."""
    return {
        "passed": all(r.passed for r in results),
        "max_abs_error": max((r.max_abs_error for r in results), default=0.0),
        "mean_abs_error": max((r.mean_abs_error for r in results), default=0.0),
        "min_cosine": min((r.cosine for r in results), default=1.0),
        "outputs": [asdict(r) for r in results],
    }


def percentile(values: Sequence[float], fraction: float) -> float:
    """The `fraction` percentile of `values` (nearest rank): latency p50 and p90."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    rank = max(1, math.ceil(fraction * len(ordered)))
    return ordered[rank - 1]
