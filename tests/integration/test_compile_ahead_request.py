"""A compile child given its job's request ahead (`sandbox.request_compile_ahead`, the embedded
`farm submit`'s, before the model is hashed or the database layer loaded): it compiles the
user's files where they are at once, hands its blob on as it ends, and the job takes it only
when the job asks for the very same compile of the very same files; anything else ends it."""

from __future__ import annotations

import errno
import hashlib
import os
import signal
import threading
import time
from functools import partial
from pathlib import Path

import pytest

from farm.core.identity import file_version
from farm.core.spec import CompileSpec, Target
from farm.server.jobs import sandbox
from farm.server.storage import BLOBS_FOLDER, local
from farm.server.storage.local import LocalStore
from tests.integration.test_compile_child_ahead import gone, waiting_child
from tests.integration.test_compile_in_place import (  # noqa: F401 (fixtures)
    STORED,
    USERS,
    stored,
    users_model,
)

CPU = Target.parse("CPU")
SPEC = CompileSpec.create(CPU)
LIMIT = 64 * 2**20
"""The blob size limit the requests below carry (the job's must be the same)."""


@pytest.fixture(autouse=True)
def _nothing_left_waiting():
    yield
    sandbox.discard_prestarted()


class Copies:
    """An `on_blob` that keeps each blob's bytes, as a store's copy would, and what the job
    then did with the copy: claimed it for the blob it took, or discarded it."""

    def __init__(self) -> None:
        self.made: list[Copy] = []
        self.killed: list[int] = []
        """The process groups killed so far (`sandbox.kill_group`, where a test watches it)."""

    def __call__(self, blob: Path, stop: threading.Event) -> Copy:
        assert not stop.is_set()
        self.made.append(Copy(blob.read_bytes(), stop, list(self.killed)))
        return self.made[-1]

    def wait(self, within: float = 60.0) -> Copy:
        deadline = time.monotonic() + within
        while not self.made and time.monotonic() < deadline:
            time.sleep(0.02)
        [copy] = self.made
        return copy


class Copy:
    def __init__(self, data: bytes, stop: threading.Event, killed_before: list[int]) -> None:
        self.data, self.stop, self.killed_before = data, stop, killed_before
        self.claimed: Path | None = None
        self.discarded = False

    def matches(self, path: Path) -> bool:
        return path.read_bytes() == self.data

    def claim(self, path: Path) -> bool:
        self.claimed = path
        return path.read_bytes() == self.data

    def discard(self) -> None:
        self.discarded = True


def compile_for_job(tmp_path, stored, in_place, max_blob_bytes=LIMIT):  # noqa: F811
    return sandbox.compile_in_child(
        stored,
        SPEC,
        tmp_path / "out",
        "k",
        timeout_seconds=120,
        max_blob_bytes=max_blob_bytes,
        in_place=in_place,
    )


def given_ahead(in_place, on_blob=None) -> sandbox._WaitingChild:
    """A compile child started ahead and given the request SPEC of the files `in_place`."""
    sandbox.prestart_compile_child(CPU)
    waiting = waiting_child()
    assert sandbox.request_compile_ahead(SPEC, in_place, None, LIMIT, on_blob=on_blob)
    return waiting


def stored_through_the_copy_ahead(tmp_path, stored, in_place):  # noqa: F811
    """A job's compile taken from the child given its request ahead, and its blob stored in
    a local store: (the compile's result, what the store answered, the stored file, the inode
    of the copy made ahead)."""
    store = LocalStore(tmp_path / "store")
    given_ahead(in_place, on_blob=partial(store.adopt_ahead, BLOBS_FOLDER))
    result, _ = compile_for_job(tmp_path, stored, in_place)
    [copy] = local._COPIED_AHEAD
    made = copy.temporary.stat().st_ino
    stored_blob = store.adopt_file("blobs/k.blob", result.blob_path)
    return result, stored_blob, store.local_path("blobs/k.blob"), made


def which_model(result, in_place) -> str:
    """Whose model the blob holds: the user's is far bigger than the store's stand-in."""
    return USERS if result.size_bytes > in_place["bin"][0].stat().st_size else STORED


def test_the_job_takes_the_compile_it_was_given_ahead(
    tmp_path,
    stored,  # noqa: F811
    users_model,  # noqa: F811
    monkeypatch,
):
    copies = Copies()
    kill = sandbox.kill_group
    monkeypatch.setattr(
        sandbox,
        "kill_group",
        lambda group, *rest: (copies.killed.append(group), kill(group, *rest)),
    )
    waiting = given_ahead(users_model, on_blob=copies)
    pid, box = waiting.child.pid, waiting.box

    copy = copies.wait()  # compiled, and its blob copied, before any job exists
    assert copy.killed_before == [pid]  # once whatever the child left running was killed
    result, output = compile_for_job(tmp_path, stored, users_model)
    assert output.startswith(sandbox.AHEAD_NOTE)
    assert which_model(result, users_model) == USERS
    assert result.blob_path == tmp_path / "out" / "k.blob"
    assert result.blob_path.read_bytes() == copy.data  # the copy is of the job's blob
    assert copy.claimed == result.blob_path and not copy.discarded
    assert result.toolchain.openvino and result.compile_seconds > 0
    assert sandbox._WAITING == [] and gone(pid) and not box.exists()
    assert (tmp_path / "k.result.json").read_text().startswith("{")


def test_the_store_names_the_copy_made_as_the_compile_given_ahead_ended(
    tmp_path,
    stored,  # noqa: F811
    users_model,  # noqa: F811
):
    result, stored_blob, kept, made = stored_through_the_copy_ahead(tmp_path, stored, users_model)

    assert kept.stat().st_ino == made  # the copy, named; the blob was not copied again
    assert kept.read_bytes() == result.blob_path.read_bytes()
    assert stored_blob.sha256 == hashlib.sha256(kept.read_bytes()).hexdigest()
    assert local._COPIED_AHEAD == [] and [p.name for p in kept.parent.iterdir()] == ["k.blob"]


def test_the_copy_made_ahead_is_named_for_a_blob_copied_out_of_a_box_on_another_disk(
    tmp_path,
    stored,  # noqa: F811
    users_model,  # noqa: F811
    monkeypatch,
):
    """A child started ahead has its box in the temporary folder, which may be another file
    system than the job's (a tmpfs /tmp): the blob is copied out of the box, not moved, and
    the copy made ahead still serves it."""
    replace = os.replace

    def across_file_systems(source, dest, *args, **kwargs):
        if Path(source).name == f"{sandbox.AHEAD_BLOB_ID}.blob":
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        return replace(source, dest, *args, **kwargs)

    monkeypatch.setattr(os, "replace", across_file_systems)

    result, _, kept, made = stored_through_the_copy_ahead(tmp_path, stored, users_model)

    assert kept.stat().st_ino == made and kept.read_bytes() == result.blob_path.read_bytes()
    assert local._COPIED_AHEAD == []


def test_a_job_asking_for_another_compile_ends_the_one_given_ahead(
    tmp_path,
    stored,  # noqa: F811
    users_model,  # noqa: F811
):
    copies = Copies()
    pid = given_ahead(users_model, on_blob=copies).child.pid
    copy = copies.wait()

    # Limits are part of the request: a job with others compiles in a child of its own.
    result, output = compile_for_job(tmp_path, stored, users_model, max_blob_bytes=LIMIT * 2)

    assert not output.startswith(sandbox.AHEAD_NOTE)
    assert which_model(result, users_model) == USERS
    assert gone(pid) and sandbox._WAITING == []
    assert copy.discarded and copy.claimed is None


def test_a_file_changed_after_the_request_ahead_is_compiled_from_the_stores_copy(
    tmp_path,
    stored,  # noqa: F811
    users_model,  # noqa: F811
):
    copies = Copies()
    pid = given_ahead(users_model, on_blob=copies).child.pid
    copy = copies.wait()
    rewrite(users_model["bin"])

    # The job still names the version the store's copy was made at.
    result, output = compile_for_job(tmp_path, stored, users_model)

    assert not output.startswith(sandbox.AHEAD_NOTE)
    assert which_model(result, users_model) == STORED
    assert gone(pid) and copy.discarded and copy.claimed is None


def test_a_file_changed_while_the_job_waited_for_the_compile_ahead_voids_it(
    tmp_path,
    stored,  # noqa: F811
    users_model,  # noqa: F811
    monkeypatch,
):
    """Taken, but a file changed before its end was seen: compiled again from the store's copy,
    and the copy of the void blob discarded."""
    run = sandbox._WaitingChild.run

    def run_then_edit(self, *args, **kwargs):
        ended = run(self, *args, **kwargs)
        rewrite(users_model["bin"])
        return ended

    monkeypatch.setattr(sandbox._WaitingChild, "run", run_then_edit)
    copies = Copies()
    given_ahead(users_model, on_blob=copies)
    copy = copies.wait()

    result, _ = compile_for_job(tmp_path, stored, users_model)

    assert which_model(result, users_model) == STORED
    assert copy.discarded and copy.claimed is None


def rewrite(file: tuple[Path, object]) -> None:
    """The same bytes written again: a new version of the file."""
    path, version = file
    path.write_bytes(path.read_bytes())
    os.utime(path, ns=(0, 10**18))
    assert file_version(path) != version


def test_a_request_ahead_is_given_only_to_a_child_that_may_read_every_file_in_place(
    tmp_path,
    users_model,  # noqa: F811
):
    assert not sandbox.request_compile_ahead(SPEC, users_model, None, LIMIT)  # none waiting

    sandbox.prestart_compile_child(Target.parse("NPU.4000"))
    assert not sandbox.request_compile_ahead(SPEC, users_model, None, LIMIT)  # another target
    sandbox.discard_prestarted()

    sandbox.prestart_compile_child(CPU)
    waiting = waiting_child()
    writable = Path(users_model["xml"][0])
    writable.chmod(0o666)  # others may write it: never read where it is
    shaky = {**users_model, "xml": (writable, file_version(writable))}
    assert not sandbox.request_compile_ahead(SPEC, shaky, None, LIMIT)
    assert waiting.ahead is None and sandbox._WAITING[:] == [waiting]  # waits for a job still

    writable.chmod(0o644)
    fine = {**users_model, "xml": (writable, file_version(writable))}
    assert sandbox.request_compile_ahead(SPEC, fine, None, LIMIT)
    assert not sandbox.request_compile_ahead(SPEC, fine, None, LIMIT)  # one request per child


def test_a_compile_ahead_that_no_job_takes_is_ended_and_its_blobs_copy_discarded(
    users_model,  # noqa: F811
):
    copies = Copies()
    waiting = given_ahead(users_model, on_blob=copies)
    pid, box = waiting.child.pid, waiting.box
    copy = copies.wait()  # it ended, and its blob was copied

    sandbox.discard_prestarted()  # a hit: no job

    assert gone(pid) and not box.exists()
    assert copy.discarded and copy.claimed is None
    assert copy.stop.is_set()  # a copy still being made would stop


class Interrupted(BaseException):
    """A Ctrl-C, say, while the job waits for the child."""


def test_a_job_interrupted_as_it_waits_for_the_compile_ahead_discards_its_copy(
    tmp_path,
    stored,  # noqa: F811
    users_model,  # noqa: F811
    monkeypatch,
):
    run = sandbox._WaitingChild.run

    def run_then_interrupt(self, *args, **kwargs):
        run(self, *args, **kwargs)
        raise Interrupted

    monkeypatch.setattr(sandbox._WaitingChild, "run", run_then_interrupt)
    copies = Copies()
    given_ahead(users_model, on_blob=copies)
    copy = copies.wait()

    with pytest.raises(Interrupted):
        compile_for_job(tmp_path, stored, users_model)

    assert copy.discarded and copy.claimed is None


def test_a_compile_ahead_that_died_without_a_result_is_not_taken(
    tmp_path,
    stored,  # noqa: F811
    users_model,  # noqa: F811
):
    sandbox.prestart_compile_child(CPU)
    waiting = waiting_child()
    os.kill(waiting.child.pid, signal.SIGKILL)  # the kernel's OOM killer, say
    assert gone(waiting.child.pid)
    assert sandbox.request_compile_ahead(SPEC, users_model, None, LIMIT)  # it reads none

    result, output = compile_for_job(tmp_path, stored, users_model)

    assert not output.startswith(sandbox.AHEAD_NOTE)  # a child of its own compiled it
    assert which_model(result, users_model) == USERS
