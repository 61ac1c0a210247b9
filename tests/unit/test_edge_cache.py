"""The edge's blob cache (LRU under a cap, blobs in use never evicted) and the drop-in header."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from farm.core import filecache
from farm.core.blobformat import read_header
from farm.core.filecache import BlobCache, CacheError
from farm.core.hashing import model_files
from farm.core.spec import CompileSpec, Toolchain
from farm.edge.agent import incompatibilities
from farm.edge.dropin import file_info, write_cache_entry
from farm.edge.importer import write_export
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


# --- a cache in a folder others may write: no planted link redirects a write -----------------


def planted(link: Path, victim: Path) -> Path:
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(victim)
    return link


def test_a_link_planted_in_the_edge_cache_never_redirects_a_write(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    os.utime(victim, (1000, 1000))
    root = tmp_path / "cache"
    (root / "partial").mkdir(parents=True)
    (root / "partial").chmod(0o777)  # was open to others: a link may wait in it
    planted(root / "partial" / key("a"), victim)
    planted(root / f"{key('a')}.blob", victim)
    planted(root / f"{key('a')}.manifest", victim)
    planted(root / f"{key('b')}.manifest", victim)
    planted(root / f"{key('b')}.blob", victim)

    cache = BlobCache(root)
    assert (root / "partial").stat().st_mode & 0o777 == 0o700
    assert not os.path.lexists(root / "partial" / key("a"))  # the link is gone
    partial = cache.partial_path(key("a"))
    partial.write_bytes(b"downloaded")  # as a source writes a download
    cache.put(key("a"), partial, {"sha256": "x"})
    cache.get(key("b"))  # marks a use: a time set on the link, not on its target

    assert victim.read_bytes() == b"precious" and victim.stat().st_mtime == 1000
    assert victim.stat().st_mode & 0o222  # not made read-only through a link either
    blob, manifest = cache.path(key("a")), cache.manifest_path(key("a"))
    assert not blob.is_symlink() and blob.read_bytes() == b"downloaded"
    assert not manifest.is_symlink() and cache.manifest(key("a")) == {"sha256": "x"}
    # A link planted at the download's name after the cache opened is removed before use.
    planted(root / "partial" / key("c"), victim)
    assert not cache.partial_path(key("c")).exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="gives the folder to another user")
def test_a_partial_folder_of_another_user_or_a_link_is_refused(tmp_path):
    other = tmp_path / "other" / "partial"
    other.mkdir(parents=True)
    os.chown(other, 65534, 65534)
    with pytest.raises(CacheError, match=r"belongs to another user.*FARM_CACHE_DIR of its own"):
        BlobCache(tmp_path / "other")
    planted(tmp_path / "linked" / "partial", tmp_path / "elsewhere")
    (tmp_path / "elsewhere").mkdir()
    with pytest.raises(CacheError, match=r"is a link"):
        BlobCache(tmp_path / "linked")


def test_the_drop_in_entry_and_an_export_never_write_through_a_planted_link(tmp_path):
    xml = models.save_ir(models.conv_net(), tmp_path / "m" / "m.xml")
    blob = compile_to_file(model_files(xml), CompileSpec.create("CPU"), tmp_path, "k").blob_path
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    shared = tmp_path / "ov-cache"  # the app's CACHE_DIR, a folder others may write
    planted(shared / f"{key('a')}.blob", victim)
    planted(shared / f".{key('a')}.blob.partial", victim)  # the name it used to write under

    entry = write_cache_entry(blob, shared, key("a"))
    export = write_export(entry, planted(tmp_path / "out" / "model.blob", victim))

    assert victim.read_bytes() == b"precious"
    assert not entry.is_symlink() and read_header(entry).payload_offset > 0
    assert entry.stat().st_mode & 0o777 == 0o644  # the app may run as another user
    assert not export.is_symlink() and export.stat().st_size > 0
    assert sorted(p.name for p in shared.iterdir()) == sorted(
        [f"{key('a')}.blob", f".{key('a')}.blob.partial"]  # the old link, left alone
    )


def test_a_blob_bound_before_the_machine_restarted_is_hashed_again(tmp_path, monkeypatch):
    """Downloads are not flushed: after a crash a blob can come back its full size, stamp
    unchanged, with ranges of zeros. A binding vouches for its file within one boot."""
    cache = BlobCache(tmp_path / "cache")
    source = tmp_path / "verified"
    source.write_bytes(b"blob")
    cache.put(key("a"), source, {"sha256": "its digest"})
    assert cache.manifest(key("a")) == {"sha256": "its digest"}
    monkeypatch.setattr(filecache, "boot_id", lambda: "a boot after a crash")
    assert cache.manifest(key("a")) is None  # not bound: the agent hashes the file again
    cache.bind(key("a"), {"sha256": "its digest"})
    assert cache.manifest(key("a")) == {"sha256": "its digest"}


def test_the_boot_is_linuxs_own_id():
    assert filecache.boot_id() == filecache.BOOT_ID.read_text().strip() != ""
