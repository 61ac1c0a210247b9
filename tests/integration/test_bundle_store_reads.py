"""A bundle's inputs and compiled files are checked against their sha256 as they are read from
the store: bytes that changed there are refused, never compiled or checked as if genuine."""

from __future__ import annotations

import hashlib

import pytest

from farm.core.bundles import BundleFile
from farm.core.errors import IntegrityMismatch
from farm.server.bundles.builds import stage_folder
from farm.server.bundles.parts import check_parts
from farm.server.bundles.storage import file_storage_key
from farm.server.storage import model_storage_key
from farm.server.storage.local import LocalStore

GENUINE = b"tokenizer and weights" * 1000
SHA = hashlib.sha256(GENUINE).hexdigest()


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "s3":
        return request.getfixturevalue("s3_store")
    return LocalStore(tmp_path / "store")


def stored(store, key: str, data: bytes, tmp_path) -> None:
    source = tmp_path / "source"
    source.write_bytes(data)
    store.put_file(key, source)  # no expected digest: the store takes what it is given


def test_a_worker_stages_a_bundle_folder_only_from_genuine_bytes(store, tmp_path):
    stored(store, model_storage_key(SHA), GENUINE, tmp_path)
    stage_folder(store, {"weights/model.bin": SHA}, tmp_path / "ok", full=True)
    assert (tmp_path / "ok" / "weights" / "model.bin").read_bytes() == GENUINE

    changed = GENUINE.replace(b"weights", b"WEIGHTS", 1)
    forged = hashlib.sha256(b"named, not held").hexdigest()
    stored(store, model_storage_key(forged), changed, tmp_path)
    with pytest.raises(IntegrityMismatch, match=f"model file {forged} is corrupt in storage"):
        stage_folder(store, {"weights/model.bin": forged}, tmp_path / "bad", full=True)
    assert not (tmp_path / "bad" / "weights" / "model.bin").exists()


def test_the_assembled_check_refuses_a_compiled_file_changed_in_storage(store, tmp_path):
    forged = hashlib.sha256(b"the compiled entry").hexdigest()
    stored(store, file_storage_key(forged), b"other bytes", tmp_path)
    entry = BundleFile(f"cache/{forged[:8]}.blob", forged, len(b"the compiled entry"))
    # The files are copied, and checked, before the pipeline is opened: none is needed here.
    with pytest.raises(IntegrityMismatch, match=f"bundle file {entry.path} is corrupt"):
        check_parts(store, None, None, [entry])  # type: ignore[arg-type]
