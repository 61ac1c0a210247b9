"""A bundle's inputs and compiled files are checked against their sha256 as they are read from
the store. Bytes that changed on the way are read again (a retried StorageError); a stored
model file that is itself corrupt is deleted, so the next submit uploads it, as a compile's
fetch does (`condemn_model_file`)."""

from __future__ import annotations

import hashlib
from io import BytesIO
from pathlib import Path

import pytest

from farm.core.bundles import BundleFile
from farm.core.errors import IntegrityMismatch, ModelFileCorrupt, StorageError
from farm.server.bundles.builds import stage_folder
from farm.server.bundles.parts import check_parts
from farm.server.bundles.storage import file_storage_key
from farm.server.storage import model_storage_key
from farm.server.storage.local import LocalStore

GENUINE = b"tokenizer and weights" * 1000
SHA = hashlib.sha256(GENUINE).hexdigest()


class ChangedOnTheWayOnce(LocalStore):
    """A local store whose first read of each object is damaged on its way (a flipped byte);
    what it holds is genuine."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.damaged: set[str] = set()

    def get_file(self, key: str, dest: str | Path) -> None:
        super().get_file(key, dest)
        if key not in self.damaged:
            self.damaged.add(key)
            with open(dest, "r+b") as file:
                first = file.read(1)
                file.seek(0)
                file.write(bytes([first[0] ^ 1]))

    def open_read(self, key: str):
        if key in self.damaged:
            return super().open_read(key)
        self.damaged.add(key)
        stream = super().open_read(key)
        data = bytearray(stream.read())
        stream.close()
        data[0] ^= 1
        return BytesIO(bytes(data))


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "s3":
        return request.getfixturevalue("s3_store")
    return LocalStore(tmp_path / "store")


def stored(store, key: str, data: bytes, tmp_path) -> None:
    source = tmp_path / "source"
    source.write_bytes(data)
    store.put_file(key, source)  # no expected digest: the store takes what it is given


def test_a_worker_stages_genuine_bytes_and_deletes_a_corrupt_model_file(store, tmp_path):
    stored(store, model_storage_key(SHA), GENUINE, tmp_path)
    stage_folder(store, {"weights/model.bin": SHA}, tmp_path / "ok", full=True)
    assert (tmp_path / "ok" / "weights" / "model.bin").read_bytes() == GENUINE

    forged = hashlib.sha256(b"named, not held").hexdigest()
    stored(store, model_storage_key(forged), GENUINE.replace(b"weights", b"WEIGHTS"), tmp_path)
    with pytest.raises(ModelFileCorrupt, match=r"\(the folder's weights/model.bin\) was corrupt"):
        stage_folder(store, {"weights/model.bin": forged}, tmp_path / "bad", full=True)
    assert not (tmp_path / "bad" / "weights" / "model.bin").exists()
    assert not store.exists(model_storage_key(forged))  # the next submit uploads it again


def test_a_model_file_changed_on_its_way_is_retried_and_kept(tmp_path):
    store = ChangedOnTheWayOnce(tmp_path / "store")
    stored(store, model_storage_key(SHA), GENUINE, tmp_path)
    with pytest.raises(StorageError, match="changed on its way from storage; retrying"):
        stage_folder(store, {"model.bin": SHA}, tmp_path / "first", full=True)
    assert store.exists(model_storage_key(SHA))
    stage_folder(store, {"model.bin": SHA}, tmp_path / "again", full=True)  # the retry
    assert (tmp_path / "again" / "model.bin").read_bytes() == GENUINE


def test_the_assembled_check_refuses_a_compiled_file_changed_in_storage(store, tmp_path):
    forged = hashlib.sha256(b"the compiled entry").hexdigest()
    stored(store, file_storage_key(forged), b"other bytes", tmp_path)
    entry = BundleFile(f"cache/{forged[:8]}.blob", forged, len(b"the compiled entry"))
    # The files are copied, and checked, before the pipeline is opened: none is needed here.
    with pytest.raises(IntegrityMismatch, match=f"bundle file {entry.path} is corrupt"):
        check_parts(store, None, None, [entry], _never_opened)  # type: ignore[arg-type]


def _never_opened(*args: object) -> dict:
    raise AssertionError("a pipeline opened on a file that failed its check")


def test_the_assembled_check_retries_a_compiled_file_changed_on_its_way(tmp_path):
    store = ChangedOnTheWayOnce(tmp_path / "store")
    stored(store, file_storage_key(SHA), GENUINE, tmp_path)
    entry = BundleFile("cache/1.blob", SHA, len(GENUINE))
    with pytest.raises(StorageError, match="changed on its way from storage; retrying"):
        check_parts(store, None, None, [entry], _never_opened)  # type: ignore[arg-type]
