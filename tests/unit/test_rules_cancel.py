"""Cancel (docs/architecture.md §6): a queued job is cancelled at once, a running one is asked
to stop, a finished one is left as it is, and only the named job is touched."""

from __future__ import annotations

import functools
import time
from datetime import timedelta

import pytest
from sqlalchemy import select

from farm import toolchain
from farm.core.clock import now
from farm.core.errors import Forbidden, NotFound
from farm.core.spec import Toolchain
from farm.server.db.models import Blob
from farm.server.jobs import runner, sandbox, service
from farm.server.jobs.compiler import CompileResult
from farm.server.jobs.runner import RunLimits, claim, run_job
from farm.server.storage import blob_storage_key
from farm.server.storage.local import LocalStore
from tests.unit.conftest import CPU, TOOLCHAIN, add_job, add_model, columns, get_job, make_ref


@pytest.fixture
def model_id(embedded_farm) -> int:
    return add_model(embedded_farm)


def running(**fields):
    return {
        "state": "running",
        "attempts": 1,
        "worker": "w1",
        "started_at": now(),
        "lease_expires_at": now() + timedelta(minutes=2),
        **fields,
    }


def test_a_queued_job_is_cancelled_at_once(embedded_farm, model_id):
    job_id = add_job(embedded_farm, model_id, 1)
    before = now()
    with embedded_farm.session() as session:
        returned = service.cancel(session, job_id, by="operator", as_admin=True)
    assert (returned.id, returned.state) == (job_id, "cancelled")
    row = get_job(embedded_farm, job_id)
    assert row.state == "cancelled"
    assert row.cancel_requested is True
    assert row.error == "cancelled before it started" and row.cancelled_by == "operator"
    assert row.finished_at is not None and before <= row.finished_at <= now()
    assert row.attempts == 0 and row.worker is None


def test_a_cancelled_queued_job_cannot_be_claimed(embedded_farm, model_id):
    job_id = add_job(embedded_farm, model_id, 1)
    with embedded_farm.session() as session:
        service.cancel(session, job_id, by="operator", as_admin=True)
        assert claim(session, job_id, "w1", 120) is False
    assert (get_job(embedded_farm, job_id).state, get_job(embedded_farm, job_id).attempts) == (
        "cancelled",
        0,
    )


def test_a_running_job_is_asked_to_stop_and_keeps_running(embedded_farm, model_id):
    job_id = add_job(embedded_farm, model_id, 1, **running())
    before = columns(embedded_farm, job_id)
    with embedded_farm.session() as session:
        returned = service.cancel(session, job_id, by="operator", as_admin=True)
    assert (returned.state, returned.cancel_requested) == ("running", True)
    assert columns(embedded_farm, job_id) == {
        **before,
        "cancel_requested": True,
        "cancelled_by": "operator",
    }


def test_cancel_touches_only_the_named_job(embedded_farm, model_id):
    first = add_job(embedded_farm, model_id, 1, **running())
    second = add_job(embedded_farm, model_id, 2, **running(worker="w2"))
    queued = add_job(embedded_farm, model_id, 3)
    untouched = {job_id: columns(embedded_farm, job_id) for job_id in (second, queued)}
    with embedded_farm.session() as session:
        service.cancel(session, first, by="operator", as_admin=True)
    assert get_job(embedded_farm, first).cancel_requested is True
    assert {job_id: columns(embedded_farm, job_id) for job_id in (second, queued)} == untouched


@pytest.mark.parametrize(
    ("state", "error"),
    [("succeeded", None), ("failed", "compile failed"), ("cancelled", "cancelled while running")],
)
def test_cancelling_a_finished_job_changes_nothing(embedded_farm, model_id, state, error):
    job_id = add_job(
        embedded_farm, model_id, 1, state=state, error=error, attempts=1, finished_at=now()
    )
    before = columns(embedded_farm, job_id)
    with embedded_farm.session() as session:
        returned = service.cancel(session, job_id, by="operator", as_admin=True)
    assert (returned.state, returned.cancel_requested) == (state, False)
    assert columns(embedded_farm, job_id) == before


def test_cancelling_an_unknown_job_is_not_found(embedded_farm, model_id):
    add_job(embedded_farm, model_id, 1)
    with embedded_farm.session() as session, pytest.raises(NotFound, match=r"^no job 999$"):
        service.cancel(session, 999, by="operator", as_admin=True)


def test_a_cancelled_key_can_be_submitted_again_as_a_new_job(embedded_farm, tmp_path, stub):
    ref = make_ref(tmp_path / "model")

    def submit():
        with embedded_farm.session() as session:
            return service.submit_matrix(
                session,
                embedded_farm.store,
                embedded_farm.settings,
                stub,
                ref.identity,
                [CPU],
                TOOLCHAIN,
                describe_model=lambda: ref.info,
                upload_from=ref,
            ).results[0][1]

    first = submit()
    with embedded_farm.session() as session:
        service.cancel(session, first.job_id, by="operator", as_admin=True)
    second = submit()
    assert (second.outcome, second.cache_key) == ("queued", first.cache_key)
    assert second.job_id != first.job_id
    assert stub.sent == [(first.job_id, "embedded"), (second.job_id, "embedded")]


# --- a cancel that reaches the worker while its compile finishes ------------------------------


def fake_compile(on_compiled):
    """A stand-in for `sandbox.compile_in_child` that writes a blob, no OpenVINO involved;
    `on_compiled(should_stop)` runs when the "compile" is done."""

    def compile_in_child(files, spec, out_dir, blob_id, *, should_stop, **limits):
        out_dir.mkdir(parents=True)
        blob = out_dir / f"{blob_id}.blob"
        blob.write_bytes(b"compiled")
        on_compiled(should_stop)
        result = CompileResult(blob, 0, 8, TOOLCHAIN, 0.1, 0.01, 2**20, {"NUM_STREAMS": "1"})
        return result, ""

    return compile_in_child


def use_compile(monkeypatch, compile_in_child) -> None:
    """Replace the sandboxed compile wherever the runner looks it up, and this host's toolchain
    with the one the stand-in reports (the jobs are submitted for it)."""
    monkeypatch.setattr(sandbox, "compile_in_child", compile_in_child)
    monkeypatch.setattr(runner, "compile_in_child", compile_in_child, raising=False)
    monkeypatch.setattr(toolchain, "host_toolchain", lambda target: TOOLCHAIN)


class CancellingStore(LocalStore):
    """The farm's local store; `farm cancel` arrives while the blob uploads."""

    def __init__(self, farm, job_id: int) -> None:
        super().__init__(farm.store.root)
        self.farm, self.job_id = farm, job_id

    def adopt_file(self, key, path, expected_sha256=None):
        with self.farm.session() as session:
            service.cancel(session, self.job_id, by="operator", as_admin=True)
        return super().adopt_file(key, path, expected_sha256)


@pytest.fixture
def queued_job(embedded_farm, tmp_path, stub) -> int:
    ref = make_ref(tmp_path / "model")
    with embedded_farm.session() as session:
        submitted = service.submit_matrix(
            session,
            embedded_farm.store,
            embedded_farm.settings,
            stub,
            ref.identity,
            [CPU],
            TOOLCHAIN,
            describe_model=lambda: ref.info,
            upload_from=ref,
        )
    return submitted.results[0][1].job_id


def run(farm, store, job_id: int, tmp_path):
    (tmp_path / "work").mkdir(exist_ok=True)
    limits = RunLimits(lease_seconds=1, max_run_seconds=60)  # renews (and polls) every 1/3 s
    return run_job(
        farm.sessions, store, job_id, worker="w1", limits=limits, work_root=tmp_path / "work"
    )


def blob_rows(farm) -> list[str]:
    with farm.session() as session:
        return list(session.scalars(select(Blob.cache_key)))


def test_a_cancel_seen_when_the_compile_returns_stores_nothing(
    embedded_farm, queued_job, tmp_path, monkeypatch
):
    def cancel_then_wait_for_the_lease(should_stop):
        with embedded_farm.session() as session:
            service.cancel(session, queued_job, by="operator", as_admin=True)
        deadline = time.monotonic() + 5
        while not should_stop() and time.monotonic() < deadline:
            time.sleep(0.05)

    use_compile(monkeypatch, fake_compile(cancel_then_wait_for_the_lease))
    job = run(embedded_farm, embedded_farm.store, queued_job, tmp_path)
    assert (job.state, job.error, job.cancel_requested) == (
        "cancelled",
        "cancelled while running",
        True,
    )
    assert blob_rows(embedded_farm) == []
    assert not embedded_farm.store.exists(blob_storage_key(job.cache_key))


def test_a_cancel_during_the_blob_upload_still_cancels_the_job(
    embedded_farm, queued_job, tmp_path, monkeypatch
):
    use_compile(monkeypatch, fake_compile(lambda should_stop: None))
    job = run(embedded_farm, CancellingStore(embedded_farm, queued_job), queued_job, tmp_path)
    assert get_job(embedded_farm, queued_job).cancel_requested is True
    assert (job.state, blob_rows(embedded_farm)) == ("cancelled", [])


def test_only_the_submitter_or_an_admin_may_cancel(served_farm):
    model_id = add_model(served_farm)
    alice = add_job(served_farm, model_id, "alice", submitter="alice")
    operators = add_job(served_farm, model_id, "operator", submitter=None)
    before = columns(served_farm, alice)
    with served_farm.session() as session:
        with pytest.raises(Forbidden, match=r"submitted by token 'alice'.*'bob' may not"):
            service.cancel(session, alice, by="bob", as_admin=False)
        with pytest.raises(Forbidden, match="submitted by an operator"):
            service.cancel(session, operators, by="bob", as_admin=False)
    assert columns(served_farm, alice) == before  # refused: the row is untouched
    with served_farm.session() as session:
        assert service.cancel(session, alice, by="alice", as_admin=False).state == "cancelled"
        assert service.cancel(session, operators, by="root", as_admin=True).state == "cancelled"


def test_joining_a_job_by_single_flight_gives_no_right_to_cancel_it(served_farm, tmp_path, stub):
    ref = make_ref(tmp_path / "m")
    submit = functools.partial(
        service.submit_matrix,
        settings=served_farm.settings,
        dispatcher=stub,
        identity=ref.identity,
        specs=[CPU],
        toolchain=TOOLCHAIN,
        describe_model=lambda: ref.info,
        upload_from=ref,
    )
    with served_farm.session() as session:
        ((_, first),) = submit(session, served_farm.store, submitter="alice").results
        ((_, joined),) = submit(session, served_farm.store, submitter="bob").results
        assert (joined.outcome, joined.job_id) == ("existing", first.job_id)
        with pytest.raises(Forbidden):
            service.cancel(session, joined.job_id, by="bob", as_admin=False)
    assert get_job(served_farm, first.job_id).state == "queued"


def test_a_job_for_another_toolchain_fails_before_anything_is_compiled(
    embedded_farm, queued_job, tmp_path, monkeypatch
):
    compiled: list[int] = []
    use_compile(monkeypatch, fake_compile(lambda should_stop: compiled.append(1)))
    other = Toolchain("1999.1.0", runtime_requirements="elsewhere")
    monkeypatch.setattr(toolchain, "host_toolchain", lambda target: other)
    job = run(embedded_farm, embedded_farm.store, queued_job, tmp_path)
    assert job.state == "failed" and compiled == []
    assert job.error.startswith(
        "this host's toolchain {'openvino': '1999.1.0', 'runtime_requirements': 'elsewhere'} "
        "is not the job's"
    )
    assert "nothing was compiled" in job.error and blob_rows(embedded_farm) == []
