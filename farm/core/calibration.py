"""Calibration samples for `--quantize int8 --calibration DIR`: read the folder's arrays and
check them against the model's inputs, with errors that say which file and what to fix.

A file is one sample or a stack of samples:
- `.npy`, for a model with one input: an array of the input's shape (one sample), or of that
  shape with one more leading axis (a stack, split along it), or, where the input's batch is 1,
  of the input's shape with another batch (split into batch-1 samples);
- `.npz`: one array per input, named after it, each read as above; every array of a file must
  give the same number of samples.
A dimension of -1 in an input's shape (dynamic) matches any size. Floating-point arrays are
cast to the input's floating type; any other mismatch of kind is refused.

numpy only (like farm.core.reference): the worker's child reads samples with it, and a
submitter who has the model checks them before uploading anything.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from farm.core.compression import MIN_CALIBRATION_SAMPLES
from farm.core.errors import CalibrationError
from farm.core.reference import InputSpec


def load_samples(
    files: Mapping[str, Path], inputs: Sequence[InputSpec]
) -> list[dict[str, np.ndarray]]:
    """Every sample of the calibration files (in the files' sorted order), fitted to
    `inputs`; refuses a set of fewer than `MIN_CALIBRATION_SAMPLES`."""
    samples: list[dict[str, np.ndarray]] = []
    for relative, path in sorted(files.items()):
        samples.extend(_file_samples(relative, path, inputs))
    if len(samples) < MIN_CALIBRATION_SAMPLES:
        raise CalibrationError(
            f"--calibration: {len(samples)} sample(s), fewer than {MIN_CALIBRATION_SAMPLES}: "
            "statistics over so few inputs do not describe the data; add samples "
            "representative of what the model will see (NNCF collects 300 by default)"
        )
    return samples


def _file_samples(
    relative: str, path: Path, inputs: Sequence[InputSpec]
) -> list[dict[str, np.ndarray]]:
    arrays = _read(relative, path)
    names = [spec.name for spec in inputs]
    if path.suffix.lower() == ".npy":
        if len(inputs) != 1:
            raise CalibrationError(
                f"--calibration {relative}: the model has inputs {', '.join(names)}; give "
                ".npz files with one array named after each"
            )
        arrays = {names[0]: arrays[""]}
    missing = [name for name in names if name not in arrays]
    extra = [name for name in arrays if name not in names]
    if missing or extra:
        raise CalibrationError(
            f"--calibration {relative}: arrays {', '.join(sorted(arrays)) or 'none'}, but the "
            f"model's inputs are {', '.join(names)}"
            + (f" (missing {', '.join(missing)})" if missing else "")
        )
    split = {spec.name: _split(relative, arrays[spec.name], spec) for spec in inputs}
    counts = {name: len(parts) for name, parts in split.items()}
    if len(set(counts.values())) != 1:
        raise CalibrationError(
            f"--calibration {relative}: the arrays give different numbers of samples "
            f"({', '.join(f'{n}: {c}' for n, c in counts.items())})"
        )
    count = next(iter(counts.values()))
    return [{name: parts[index] for name, parts in split.items()} for index in range(count)]


def _read(relative: str, path: Path) -> dict[str, np.ndarray]:
    try:
        loaded = np.load(path, allow_pickle=False)
        if isinstance(loaded, np.lib.npyio.NpzFile):
            with loaded as archive:
                return {name: archive[name] for name in archive.files}
        return {"": np.asarray(loaded)}
    except (OSError, EOFError, ValueError, TypeError) as error:
        raise CalibrationError(
            f"--calibration {relative}: not a readable numpy array file ({error})"
        ) from None


def _split(relative: str, array: np.ndarray, spec: InputSpec) -> list[np.ndarray]:
    array = _cast(relative, array, spec)
    want = spec.shape
    if _fits(array.shape, want):
        return [array]
    if array.ndim == len(want) + 1 and _fits(array.shape[1:], want):
        return list(array)
    if want and want[0] == 1 and array.ndim == len(want) and _fits(array.shape[1:], want[1:]):
        return [array[index : index + 1] for index in range(array.shape[0])]
    shown = "x".join("?" if d < 0 else str(d) for d in want)
    raise CalibrationError(
        f"--calibration {relative}: array of shape {list(array.shape)} does not fit input "
        f"{spec.name!r} of shape [{shown}] (one sample, or samples stacked on a leading axis)"
    )


def _fits(shape: Sequence[int], want: Sequence[int]) -> bool:
    return len(shape) == len(want) and all(
        w < 0 or s == w for s, w in zip(shape, want, strict=True)
    )


def _cast(relative: str, array: np.ndarray, spec: InputSpec) -> np.ndarray:
    want = np.dtype(spec.dtype)
    if array.dtype == want:
        return array
    if np.issubdtype(array.dtype, np.floating) and np.issubdtype(want, np.floating):
        return array.astype(want)
    if np.issubdtype(array.dtype, np.integer) and np.issubdtype(want, np.integer):
        return array.astype(want)
    raise CalibrationError(
        f"--calibration {relative}: {array.dtype} values for input {spec.name!r} of type {want}"
    )
