"""The local folder store: all-or-nothing writes, verified digests, keys that cannot escape."""

from __future__ import annotations

import hashlib

import pytest

from farm.server.storage import ChecksumMismatch, InvalidKey, StorageError, open_store
from farm.server.storage.local import LocalStore


@pytest.fixture
def store(tmp_path) -> LocalStore:
    return LocalStore(tmp_path / "store")


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "source.bin"
    path.write_bytes(b"weights" * 300_000)  # ~2 MB: more than one copy chunk
    return path


def leftovers(store: LocalStore) -> list[str]:
    return [p.name for p in store.root.rglob("*") if p.is_file()]


def test_round_trip_records_size_and_sha256(store, source, tmp_path):
    digest = hashlib.sha256(source.read_bytes()).hexdigest()
    stored = store.put_file(f"models/{digest}", source, expected_sha256=digest)
    assert (stored.size, stored.sha256) == (source.stat().st_size, digest)
    assert store.exists(f"models/{digest}")
    assert store.stat(f"models/{digest}") == stored
    store.get_file(f"models/{digest}", tmp_path / "back.bin")
    assert (tmp_path / "back.bin").read_bytes() == source.read_bytes()
    assert store.local_path(f"models/{digest}").read_bytes() == source.read_bytes()
    store.delete(f"models/{digest}")
    assert not store.exists(f"models/{digest}") and store.stat(f"models/{digest}") is None


def test_sha256_mismatch_stores_nothing(store, source):
    with pytest.raises(ChecksumMismatch):
        store.put_file("models/x", source, expected_sha256="0" * 64)
    assert leftovers(store) == []


def test_a_failed_write_leaves_no_partial_file(store, tmp_path):
    with pytest.raises(FileNotFoundError):
        store.put_file("blobs/a.blob", tmp_path / "missing")
    assert leftovers(store) == []


@pytest.mark.parametrize(
    "key",
    ["../x", "models/../../x", "/etc/passwd", "models//x", "a\\b", "a\x00b", "", "models/.", "é"],
)
def test_keys_that_could_escape_are_rejected(store, source, key):
    with pytest.raises(InvalidKey):
        store.put_file(key, source)
    with pytest.raises(InvalidKey):
        store.exists(key)


def test_open_store_picks_the_class_by_scheme(tmp_path):
    assert isinstance(open_store(str(tmp_path)), LocalStore)
    assert isinstance(open_store(f"file://{tmp_path}"), LocalStore)
    with pytest.raises(StorageError, match="known: file"):
        open_store("ftp://host/x")
