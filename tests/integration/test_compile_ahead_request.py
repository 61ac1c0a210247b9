"""A compile child given its job's request ahead (`sandbox.request_compile_ahead`, the embedded
`farm submit`'s, before the model is hashed or the database layer loaded): it compiles the
user's files where they are at once, hands its blob on as it ends, and the job takes it only
when the job asks for the very same compile of the very same files; anything else ends it."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from farm.core.identity import file_version
from farm.core.spec import CompileSpec, Target
from farm.server.jobs import sandbox
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


def handed_on(blobs: list[bytes], within: float = 60.0) -> bool:
    deadline = time.monotonic() + within
    while not blobs and time.monotonic() < deadline:
        time.sleep(0.02)
    return bool(blobs)


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


def which_model(result, in_place) -> str:
    """Whose model the blob holds: the user's is far bigger than the store's stand-in."""
    return USERS if result.size_bytes > in_place["bin"][0].stat().st_size else STORED


def test_the_job_takes_the_compile_it_was_given_ahead(tmp_path, stored, users_model):  # noqa: F811
    sandbox.prestart_compile_child(CPU)
    waiting = waiting_child()
    pid, box = waiting.child.pid, waiting.box
    blobs: list[bytes] = []

    given = sandbox.request_compile_ahead(
        SPEC, users_model, None, LIMIT, on_blob=lambda blob: blobs.append(blob.read_bytes())
    )

    assert given
    # Compiled, and its blob handed on, before any job exists.
    assert handed_on(blobs)
    result, output = compile_for_job(tmp_path, stored, users_model)
    assert output.startswith(sandbox.AHEAD_NOTE)
    assert which_model(result, users_model) == USERS
    assert result.blob_path == tmp_path / "out" / "k.blob"
    assert result.blob_path.read_bytes() == blobs[0]  # what was handed on is the job's blob
    assert result.toolchain.openvino and result.compile_seconds > 0
    assert sandbox._WAITING == [] and gone(pid) and not box.exists()
    assert (tmp_path / "k.result.json").read_text().startswith("{")


def test_a_job_asking_for_another_compile_ends_the_one_given_ahead(
    tmp_path,
    stored,  # noqa: F811
    users_model,  # noqa: F811
):
    sandbox.prestart_compile_child(CPU)
    pid = waiting_child().child.pid
    assert sandbox.request_compile_ahead(SPEC, users_model, None, LIMIT)

    # Limits are part of the request: a job with others compiles in a child of its own.
    result, output = compile_for_job(tmp_path, stored, users_model, max_blob_bytes=LIMIT * 2)

    assert not output.startswith(sandbox.AHEAD_NOTE)
    assert which_model(result, users_model) == USERS
    assert gone(pid) and sandbox._WAITING == []


def test_a_file_changed_after_the_request_ahead_is_compiled_from_the_stores_copy(
    tmp_path,
    stored,  # noqa: F811
    users_model,  # noqa: F811
):
    sandbox.prestart_compile_child(CPU)
    pid = waiting_child().child.pid
    assert sandbox.request_compile_ahead(SPEC, users_model, None, LIMIT)
    weights = users_model["bin"][0]
    weights.write_bytes(weights.read_bytes())  # the same bytes, written again: a new version
    assert file_version(weights) != users_model["bin"][1]

    # The job still names the version the store's copy was made at.
    result, output = compile_for_job(tmp_path, stored, users_model)

    assert not output.startswith(sandbox.AHEAD_NOTE)
    assert which_model(result, users_model) == STORED
    assert gone(pid)


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


def test_a_child_given_a_request_ahead_that_no_job_takes_is_ended_and_hands_nothing_on(
    users_model,  # noqa: F811
):
    sandbox.prestart_compile_child(CPU)
    waiting = waiting_child()
    pid, box = waiting.child.pid, waiting.box
    blobs: list[Path] = []
    assert sandbox.request_compile_ahead(SPEC, users_model, None, LIMIT, on_blob=blobs.append)

    sandbox.discard_prestarted()  # a hit: no job

    assert gone(pid) and not box.exists()
    assert all(not blob.exists() for blob in blobs)  # a blob handed on went with the box
