"""Streaming file digests and the caching hash, version 1 (docs/architecture.md §5).

Pure: imports nothing of the project, so the edge computes exactly the key the worker recorded.
Changing anything that feeds `cache_key` changes every key in every fleet: the golden vectors
in tests/unit/test_hashing.py exist to make that a deliberate act.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, BinaryIO

from farm.core.errors import ModelFileError

CACHE_KEY_VERSION = 1
CHUNK_BYTES = 1 << 20
"""Read size for streaming digests: large enough to run at hashlib's speed, small in memory."""


def sha256_file(path: str | Path, progress: Callable[[int], None] | None = None) -> str:
    """sha256 hex of a file, read in fixed chunks into one reused buffer (constant memory).

    `progress`, when given, is called with the number of bytes of each chunk read.
    """
    digest = hashlib.sha256()
    buffer = bytearray(CHUNK_BYTES)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as stream:
        while count := stream.readinto(buffer):
            digest.update(view[:count])
            if progress is not None:
                progress(count)
    return digest.hexdigest()


def sha256_stream(stream: BinaryIO) -> str:
    """sha256 hex of everything left in a readable stream (an HTTP body, say)."""
    digest = hashlib.sha256()
    while chunk := stream.read(CHUNK_BYTES):
        digest.update(chunk)
    return digest.hexdigest()


def model_files(path: str | Path) -> dict[str, Path]:
    """The files that make up a model, by role: ``{"xml", "bin"}`` for IR, ``{"onnx"}``."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".xml":
        weights = path.with_suffix(".bin")
        files = {"xml": path, "bin": weights}
    elif suffix == ".onnx":
        files = {"onnx": path}
    else:
        raise ModelFileError(f"{path}: not a model; give an OpenVINO IR .xml or an .onnx file")
    for role, file in files.items():
        if not file.is_file():
            what = "its weights file" if role == "bin" else "model file"
            raise ModelFileError(f"{file}: {what} does not exist")
    return files


def model_identity(
    files: Mapping[str, Path], progress: Callable[[int], None] | None = None
) -> dict[str, str]:
    """The ``model`` object of the cache key: sha256 of each model file, by role."""
    return {role: sha256_file(file, progress) for role, file in sorted(files.items())}


def canonical_json(value: Any) -> bytes:
    """Sorted keys, no spaces, UTF-8: one byte string per value, on every machine."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def model_digest(model: Mapping[str, str]) -> str:
    """One digest naming a model (all of its files): the `models.digest` column."""
    return hashlib.sha256(canonical_json(dict(model))).hexdigest()


def cache_key(
    model: Mapping[str, Any],
    target: str,
    spec: Mapping[str, Any],
    toolchain: Mapping[str, str],
) -> str:
    """The caching hash v1: sha256 hex of the canonical JSON of model, target, spec, toolchain.

    `spec` is `CompileSpec.canonical()` and `toolchain` is `Toolchain.key_part(target)`.
    """
    document = {
        "v": CACHE_KEY_VERSION,
        "model": dict(model),
        "target": target,
        "spec": dict(spec),
        "toolchain": dict(toolchain),
    }
    return hashlib.sha256(canonical_json(document)).hexdigest()
