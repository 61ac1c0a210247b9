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
    try:
        folder.chmod(0o755)
        xml = models.save_ir(models.conv_net(channels=USERS_CHANNELS), folder / "model.xml")
        files = model_files(xml)
        if not sandbox.readable_in_place(files["bin"], sandbox.compile_identity()):
            pytest.skip("the temporary folder is not open to the compile user here")
        yield {role: (path, file_version(path)) for role, path in files.items()}
    finally:
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
    assert compiled_from(tmp_path, stored, users_model) == USERS


def test_the_child_reads_the_real_file_a_link_led_to_when_it_was_checked(
    tmp_path, stored, users_model
):
    """A link on the user's path is followed once: the check, the child's link and the
    version taken after the compile all name the real file (another user's folder holding the
    link could point it elsewhere between two looks)."""
    real, version = users_model["bin"]
    link = tmp_path / "latest.bin"
    link.symlink_to(real)
    resolved = sandbox._readable_as_copied(
        {"bin": (link, version), "xml": users_model["xml"]}, sandbox.compile_identity()
    )
    assert resolved["bin"] == (real.resolve(), version)


def test_a_file_changed_since_it_was_copied_is_not_read(tmp_path, stored, users_model):
    path, _ = users_model["bin"]
    os.utime(path)  # its ctime moves: it is not the version copied
    assert compiled_from(tmp_path, stored, users_model) == STORED


def test_a_file_changed_during_the_compile_is_compiled_again_from_the_store(
    tmp_path, stored, users_model, monkeypatch, caplog
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
    assert "changed while it was compiled: compiling the stored copy again" in caplog.text


@pytest.mark.skipif(os.geteuid() != 0, reason="needs a compile user other than the test's")
def test_a_file_the_child_turns_out_unable_to_read_is_compiled_from_the_store(
    tmp_path, stored, users_model, monkeypatch, caplog
):
    """The mode bits said yes; an ACL or a security module said no: the compile is not failed
    for it, it reads the store's copy."""
    for path, _ in users_model.values():
        path.chmod(0o600)  # closed to the compile user, whatever the check below says
    in_place = {role: (path, file_version(path)) for role, (path, _) in users_model.items()}
    monkeypatch.setattr(sandbox, "readable_in_place", lambda path, identity: True)
    assert compiled_from(tmp_path, stored, in_place) == STORED
    assert "could not read" in caplog.text
