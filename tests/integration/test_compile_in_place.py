"""A compile that reads the user's model file where it is (`compile_in_child(in_place=...)`):
what an embedded `farm submit` does for a model it copied into its store around the page cache
(`LocalStore.copied_from`). The child reads the user's file while it keeps the version it was
copied at; a file changed before the compile is not read, and one changed during it is
compiled again from the store's copy."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from farm.core.hashing import model_files
from farm.core.identity import file_version
from farm.core.spec import CompileSpec
from farm.server.jobs import sandbox
from tests import models

STORED, USERS = "the store's copy", "the user's file"
USERS_CHANNELS = 256
"""The user's model is far the bigger (about 100 KB of weights against 2 KB): a blob holds its
model's weights, so its size tells which one the child compiled."""


@pytest.fixture
def users_model():
    """The user's model, in a folder every user may enter (the compile user reads it there)."""
    folder = Path(tempfile.mkdtemp(prefix="farm-user-model-"))
    folder.chmod(0o755)
    xml = models.save_ir(models.conv_net(channels=USERS_CHANNELS), folder / "model.xml")
    yield {role: (path, file_version(path)) for role, path in model_files(xml).items()}
    shutil.rmtree(folder)


@pytest.fixture
def stored(tmp_path):
    """The store's copy (here another model, to tell which one the child compiled)."""
    return model_files(models.save_ir(models.conv_net(channels=4), tmp_path / "store" / "m.xml"))


def compiled_from(tmp_path, stored, in_place, should_stop=lambda: False) -> str:
    result, _ = sandbox.compile_in_child(
        stored,
        CompileSpec.create("CPU"),
        tmp_path / "out",
        "k",
        timeout_seconds=120,
        should_stop=should_stop,
        in_place=in_place,
    )
    users_weights = in_place["bin"][0].stat().st_size
    assert stored["bin"].stat().st_size < users_weights // 20
    return USERS if result.size_bytes > users_weights else STORED


def test_the_child_reads_the_users_file_where_it_is(tmp_path, stored, users_model):
    if not sandbox.readable_in_place(users_model["bin"][0], sandbox.compile_identity()):
        pytest.skip("the temporary folder is not open to the compile user here")
    assert compiled_from(tmp_path, stored, users_model) == USERS


def test_a_file_changed_since_it_was_copied_is_not_read(tmp_path, stored, users_model):
    path, _ = users_model["bin"]
    os.utime(path)  # its ctime moves: it is not the version copied
    assert compiled_from(tmp_path, stored, users_model) == STORED


def test_a_file_changed_during_the_compile_is_compiled_again_from_the_store(
    tmp_path, stored, users_model, monkeypatch
):
    monkeypatch.setattr(sandbox, "POLL_SECONDS", 0.02)
    touched = []

    def touch_once() -> bool:  # called while the child compiles
        if not touched:
            os.utime(users_model["xml"][0])
            touched.append(True)
        return False

    assert compiled_from(tmp_path, stored, users_model, touch_once) == STORED
    assert touched
    assert not list((tmp_path / "out").glob("box-*")), "the first child's box is removed"
