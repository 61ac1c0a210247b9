"""Write a farm blob as an entry of OpenVINO's own model cache, so that an unmodified app that
sets ``CACHE_DIR=<dir>`` and ``CACHE_BLOB_ID=<cache_key>`` imports it instead of compiling.

A farm blob already is an OpenVINO cache entry (`farm.blobformat`). One field of its header,
``file_info``, must match what OpenVINO computes for the model the app passes:
- ``compile_model(ov.Model, ...)``: a fixed value (no file), the one workers record, so the
  blob works as it is;
- ``compile_model("model.xml", ...)``: a hash of the absolute path, mtime and size of that
  file (`ModelCache::calculate_file_info`, src/inference/src/dev/compilation_context.cpp).
  `write_cache_entry(..., for_model=path)` rewrites the header for that file.
Otherwise OpenVINO treats the entry as stale, deletes it and compiles (docs/openvino.md).

Note: the path hash is libstdc++'s ``std::hash<std::string>`` (Linux builds of OpenVINO);
Windows builds hash differently and need the app to pass an ``ov.Model``.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from farm.core.blobformat import read_header
from farm.core.filecache import write_atomically

_MASK = (1 << 64) - 1
_MURMUR_MUL = 0xC6A4A7935BD1E995
_STD_HASH_SEED = 0xC70F6907
_FILE_INFO = re.compile(rb'file_info="[^"]*"')


def write_cache_entry(
    blob: Path, cache_dir: Path, cache_key: str, for_model: Path | None = None
) -> Path:
    """Copy `blob` to ``cache_dir/<cache_key>.blob`` with the header OpenVINO expects for an
    app that compiles `for_model` (a path) or an in-memory model (None). Written atomically,
    under a fresh name then renamed: a link planted in `cache_dir` (a folder others may write)
    is replaced, never written through."""
    header = read_header(blob)
    with open(blob, "rb") as source:
        line = source.readline()
        new_line = _FILE_INFO.sub(f'file_info="{file_info(for_model)}"'.encode(), line, count=1)
        alignment = int(header.attributes.get("header_size_alignment", "0") or 0)
        padding = (-len(new_line) % alignment) if alignment > 0 else 0
        cache_dir.mkdir(parents=True, exist_ok=True)
        target = cache_dir / f"{cache_key}.blob"
        with write_atomically(target, mode=0o644) as sink:  # for the app, whoever runs it
            sink.write(new_line + b"\0" * padding)
            source.seek(header.payload_offset)
            shutil.copyfileobj(source, sink, 1 << 20)
    return target


def file_info(model_path: Path | None) -> str:
    """OpenVINO's ``ModelCache::calculate_file_info`` for `model_path` (None: no file)."""
    if model_path is None:
        return str(_combine(0, _std_hash(b"")))
    absolute = os.path.abspath(model_path)
    stat = os.stat(absolute)
    seed = _combine(0, _std_hash(absolute.encode()))
    seed = _combine(seed, int(stat.st_mtime))  # std::hash of an integer is the integer
    return str(_combine(seed, stat.st_size))


def _combine(seed: int, value: int) -> int:
    """boost's hash_combine, as OpenVINO writes it, on 64-bit size_t."""
    return (seed ^ ((value + 0x9E3779B9 + (seed << 6) + (seed >> 2)) & _MASK)) & _MASK


def _std_hash(data: bytes) -> int:
    """libstdc++ ``std::_Hash_bytes`` (64-bit MurmurHash2 variant) with std::hash's seed."""

    def shift_mix(value: int) -> int:
        return value ^ (value >> 47)

    length = len(data)
    whole = length & ~7
    result = (_STD_HASH_SEED ^ (length * _MURMUR_MUL)) & _MASK
    for start in range(0, whole, 8):
        word = int.from_bytes(data[start : start + 8], "little")
        word = (shift_mix((word * _MURMUR_MUL) & _MASK) * _MURMUR_MUL) & _MASK
        result = ((result ^ word) * _MURMUR_MUL) & _MASK
    if length & 7:
        result = ((result ^ int.from_bytes(data[whole:], "little")) * _MURMUR_MUL) & _MASK
    result = (shift_mix(result) * _MURMUR_MUL) & _MASK
    return shift_mix(result)
