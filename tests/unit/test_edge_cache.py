"""The edge's blob cache (LRU under a cap, blobs in use never evicted) and the drop-in header."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from farm.core.blobformat import read_header
from farm.core.filecache import BlobCache, CacheError
from farm.core.hashing import model_files
from farm.core.spec import CompileSpec, Toolchain
from farm.edge.agent import incompatibilities
from farm.edge.dropin import file_info
from farm.server.jobs.compiler import compile_to_file
from tests import models


def put(cache: BlobCache, key: str, size: int, tmp_path: Path, used_at: float) -> None:
    source = tmp_path / f"{key}.verified"
    source.write_bytes(b"b" * size)
    os.utime(cache.put(key, source), (used_at, used_at))


def key(char: str) -> str:
    return char * 64


def test_eviction_takes_the_least_recently_used_first(tmp_path):
    cache = BlobCache(tmp_path / "cache", max_bytes=300)
    for age, char in enumerate("abc"):
        put(cache, key(char), 100, tmp_path, used_at=1000 + age)
    assert cache.get(key("a")) is not None  # touched: now the most recent
    put(cache, key("d"), 100, tmp_path, used_at=2**31 - 10)
    remaining = {entry.cache_key[0] for entry in cache.entries()}
    assert remaining == {"a", "c", "d"}  # b was the least recently used
    assert cache.total_bytes() <= 300


def test_a_blob_in_use_is_never_evicted(tmp_path):
    cache = BlobCache(tmp_path / "cache", max_bytes=150)
    put(cache, key("a"), 100, tmp_path, used_at=1000)
    with cache.hold(key("a")):
        put(cache, key("b"), 100, tmp_path, used_at=2000)
        assert {e.cache_key[0] for e in cache.entries()} == {"a", "b"}  # over the cap, held
    assert cache.evict() == [key("a")]


def test_cached_blobs_are_read_only_and_keys_are_checked(tmp_path):
    cache = BlobCache(tmp_path / "cache")
    put(cache, key("a"), 10, tmp_path, used_at=1000)
    assert cache.path(key("a")).stat().st_mode & 0o222 == 0
    for bad in ("../../etc/passwd", "A" * 64, "a" * 63):
        with pytest.raises(CacheError):
            cache.path(bad)


def test_file_info_matches_what_openvino_wrote(tmp_path):
    xml = models.save_ir(models.conv_net(), tmp_path / "m" / "m.xml")
    result = compile_to_file(model_files(xml), CompileSpec.create("CPU"), tmp_path, "k")
    # The worker compiles an ov.Model: OpenVINO records the file info of "no file".
    assert read_header(result.blob_path).attributes["file_info"] == file_info(None)


def test_incompatibilities_name_the_openvino_version_and_cpu_requirements():
    here = Toolchain(openvino="2026.4.1", runtime_requirements="meta=1.0;ov=2026.4.1;isa=AVX2")
    blob = {
        "target": "CPU",
        "openvino": "2026.4.1-1-abc",
        "toolchain": {"openvino": "2026.4.1", "runtime_requirements": here.runtime_requirements},
    }
    assert incompatibilities(blob, here) == []
    other_isa = {**blob, "toolchain": {**blob["toolchain"], "runtime_requirements": "isa=AMX"}}
    assert "isa=AMX" in incompatibilities(other_isa, here)[0]
    npu = {"target": "NPU.4000", "toolchain": {"openvino": "2025.3.0"}}
    assert "OpenVINO 2025.3.0" in incompatibilities(npu, here)[0]
