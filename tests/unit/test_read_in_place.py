"""When a compile child may read the user's model file where it is (`sandbox.readable_in_place`)
instead of the store's copy: a file it may read, on a path only the user and root can change."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from farm.server.jobs import sandbox
from farm.server.jobs.compile_user import ChildUser

NOBODY = ChildUser(65534, 65534)


@pytest.fixture
def open_folder():
    """A folder every user may enter (pytest's own are closed to others), 0755."""
    folder = Path(tempfile.mkdtemp(prefix="farm-in-place-"))
    folder.chmod(0o755)
    reachable = sandbox._may(folder, NOBODY.uid, NOBODY.gid, os.X_OK, every_parent=True)
    if os.geteuid() == NOBODY.uid or not reachable:
        shutil.rmtree(folder)
        pytest.skip("the temporary folder is not open to other users here")
    yield folder
    shutil.rmtree(folder)


def model_in(folder: Path, mode: int = 0o644) -> Path:
    path = folder / "model.bin"
    path.write_bytes(b"weights")
    path.chmod(mode)
    return path


def test_a_file_every_user_may_read_on_a_path_they_cannot_change_is_read_in_place(open_folder):
    assert sandbox.readable_in_place(model_in(open_folder), NOBODY)


def test_a_child_of_the_worker_s_own_user_reads_a_file_closed_to_others_in_place(open_folder):
    assert sandbox.readable_in_place(model_in(open_folder, 0o600), None)
    assert not sandbox.readable_in_place(model_in(open_folder, 0o666), None)


@pytest.mark.parametrize(
    ("mode", "why"),
    [(0o600, "it may not read it"), (0o666, "it could write it"), (0o664, "its group could")],
)
def test_a_file_the_child_may_not_read_or_may_write_is_not_read_in_place(open_folder, mode, why):
    assert not sandbox.readable_in_place(model_in(open_folder, mode), NOBODY), why


@pytest.mark.parametrize(
    ("mode", "in_place"),
    [
        (0o700, False),  # it cannot enter the folder
        (0o777, False),  # any user could put another file in the model's place
        (0o1777, True),  # sticky, as /tmp: it may move only its own entries
    ],
)
def test_each_folder_on_the_way_must_let_the_child_in_but_not_swap_the_file(
    open_folder, mode, in_place
):
    inner = open_folder / "models"
    inner.mkdir()
    model = model_in(inner)
    inner.chmod(mode)
    assert sandbox.readable_in_place(model, NOBODY) is in_place


@pytest.mark.skipif(os.geteuid() != 0, reason="gives a folder to another user")
@pytest.mark.parametrize("owner", [NOBODY.uid, 4242])
def test_a_folder_or_file_of_another_user_on_the_way_is_not_trusted(open_folder, owner):
    """Another user could swap the folder (or rewrite the file) for the compile alone: the
    model's version, checked before and after, would not show it. The compile user included."""
    inner = open_folder / "models"
    inner.mkdir(mode=0o755)
    model = model_in(inner)
    assert sandbox.readable_in_place(model, NOBODY)
    os.chown(model, owner, owner)
    assert not sandbox.readable_in_place(model, NOBODY)
    assert not sandbox.readable_in_place(model, None)
    os.chown(model, 0, 0)
    os.chown(inner, owner, owner)
    assert not sandbox.readable_in_place(model, NOBODY)
    assert not sandbox.readable_in_place(model, None)


def test_a_link_is_judged_by_the_file_it_leads_to_and_only_a_regular_file_is_read(open_folder):
    model = model_in(open_folder)
    link = open_folder / "link.bin"
    link.symlink_to(model)
    assert sandbox.readable_in_place(link, NOBODY)
    fifo = open_folder / "fifo"
    os.mkfifo(fifo, 0o644)
    assert not sandbox.readable_in_place(fifo, NOBODY)
    assert not sandbox.readable_in_place(open_folder / "missing.bin", NOBODY)


def test_a_file_on_a_network_file_system_is_not_read_in_place(open_folder, monkeypatch):
    """An NFS or CIFS client may show cached attributes while the bytes read are new: the
    version checked before and after the compile would not see a write."""
    model = model_in(open_folder)
    assert sandbox._file_system_of(model) in sandbox.LOCAL_FILE_SYSTEMS
    assert sandbox._file_system_of(Path("/proc/self")) == "proc"
    monkeypatch.setattr(sandbox, "_file_system_of", lambda path: "nfs4")
    assert not sandbox.readable_in_place(model, NOBODY)
    assert not sandbox.readable_in_place(model, None)
