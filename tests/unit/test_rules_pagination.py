"""Keyset pagination of the job, blob, worker and token lists: every row once, in order,
however the pages fall, including rows that share a timestamp; a cursor this server did not
hand out is bad input; a page's shared reads (model names, live workers) are one query each."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import event

from farm.server import routing
from farm.server.blobs.service import list_blobs, page_cursor
from farm.server.db.models import Worker
from farm.server.jobs.service import list_jobs
from farm.server.pagination import (
    InvalidCursor,
    after_worker,
    blob_cursor,
    encode,
    job_cursor,
    worker_cursor,
)
from farm.server.tokens import create_token, list_tokens
from farm.server.views import job_views, workers_view
from tests.unit.conftest import add_blob, add_job, add_model, key

T0 = datetime(2026, 11, 1, tzinfo=UTC)


def _blob_pages(farm, size: int, target: str | None = None) -> list[list[str]]:
    pages, cursor = [], None
    while True:
        with farm.session() as session:
            rows = list_blobs(session, target, size, cursor)
            pages.append([blob.cache_key for blob in rows])
            cursor = page_cursor(rows, size)
        if cursor is None:
            return pages


def test_blob_pages_hold_every_blob_once_newest_first_across_equal_timestamps(embedded_farm):
    model = add_model(embedded_farm)
    # Five blobs, three sharing one created_at: the cursor must break ties by id.
    times = [T0, T0 + timedelta(seconds=1), T0 + timedelta(seconds=1), T0 + timedelta(seconds=1)]
    times.append(T0 + timedelta(seconds=2))
    made = [add_blob(embedded_farm, model, key(n), created_at=at) for n, at in enumerate(times)]
    newest_first = [b.cache_key for b in sorted(made, key=lambda b: (b.created_at, b.id))][::-1]

    assert _blob_pages(embedded_farm, 2) == [newest_first[0:2], newest_first[2:4], newest_first[4:]]
    assert _blob_pages(embedded_farm, 5) == [newest_first, []]  # a full last page: one empty
    assert _blob_pages(embedded_farm, 10) == [newest_first]


def test_blobs_are_listed_for_one_target_newest_first(embedded_farm):
    """`farm blobs --target`: only that target's blobs, however it is spelled, newest first."""
    model = add_model(embedded_farm)
    targets = ["NPU.4000", "CPU", "NPU.4000", "NPU.3720", "NPU.4000", "CPU"]
    for n, target in enumerate(targets):
        add_blob(embedded_farm, model, key(n), created_at=T0 + timedelta(minutes=n), target=target)
    with embedded_farm.session() as session:
        for spelling in ("4000", "npu.4000", "NPU4000"):
            assert [b.cache_key for b in list_blobs(session, spelling)] == [key(4), key(2), key(0)]
        assert [b.cache_key for b in list_blobs(session, "cpu")] == [key(5), key(1)]
        assert [b.cache_key for b in list_blobs(session, "5020")] == []
        assert [b.cache_key for b in list_blobs(session)] == [key(n) for n in range(5, -1, -1)]


def test_a_page_asks_for_no_more_rows_than_its_limit(embedded_farm):
    model = add_model(embedded_farm)
    for n in range(7):
        add_blob(embedded_farm, model, key(n), created_at=T0 + timedelta(minutes=n))
    with embedded_farm.session() as session:
        first = list_blobs(session, None, 3)
        assert len(first) == 3
        assert page_cursor(first, 3) == blob_cursor(first[-1].created_at, first[-1].id)
        assert page_cursor(first, 4) is None  # a short page is the last


def test_job_pages_continue_after_the_cursor_job(served_farm):
    model = add_model(served_farm)
    ids = [add_job(served_farm, model, n, state="succeeded") for n in range(5)]
    with served_farm.session() as session:
        first = list_jobs(session, limit=2)
        after = list_jobs(session, limit=2, cursor=job_cursor(first[-1].id))
        last = list_jobs(session, limit=2, cursor=job_cursor(after[-1].id))
    assert [job.id for job in first + after + last] == ids[::-1]
    assert len(last) == 1


@pytest.mark.parametrize(
    "cursor",
    [
        "not base64 at all!",
        encode("job", "12"),  # a job cursor for the blob list
        encode("blob", "yesterday", "3"),
        encode("blob", T0.isoformat()),
        encode("blob", "0001-01-01T00:00:00+14:00", "1"),  # no UTC equivalent
        encode("blob", "2026-01-01T00:00:00", "1"),  # no zone: never handed out
        encode("blob", T0.isoformat(), "²"),  # a digit to str.isdigit(), not to int()
        encode("blob", T0.isoformat(), "1" * 60),  # past any integer column
        encode("blob", T0.isoformat(), "1\x00"),
        encode("blob", T0.isoformat(), "1") + "!",  # not base64 past its end
        "",
    ],
)
def test_a_blob_cursor_the_server_did_not_hand_out_is_bad_input(embedded_farm, cursor):
    with embedded_farm.session() as session:
        if cursor == "":
            assert list_blobs(session, None, 5, cursor) == []  # empty: the first page
            return
        with pytest.raises(InvalidCursor, match="is not"):
            list_blobs(session, None, 5, cursor)


@pytest.mark.parametrize(
    "job_id", ["²", "9223372036854775808", "1" * 60, "12\x00", "-1", " 1", "1_000"]
)
def test_a_tampered_job_cursor_is_bad_input(served_farm, job_id):
    with served_farm.session() as session, pytest.raises(InvalidCursor, match="is not"):
        list_jobs(session, cursor=encode("job", job_id))


def test_a_worker_cursor_with_a_control_character_is_bad_input():
    with pytest.raises(InvalidCursor):
        after_worker(encode("worker", "w\x00"))
    assert after_worker(encode("worker", "w|1")) == "w|1"


def test_a_job_cursor_for_another_list_is_bad_input(served_farm):
    with served_farm.session() as session, pytest.raises(InvalidCursor, match="is not"):
        list_jobs(session, cursor=blob_cursor(T0, 3))


def _register(
    farm, name: str, queues: list[str], heartbeat_at=None, toolchains: dict | None = None
) -> None:
    with farm.session() as session:
        routing.register_worker(
            session,
            name=name,
            host="h",
            pid=1,
            targets={"CPU": None},
            toolchains=toolchains or {"CPU": {"openvino": "2026.4.1"}},
            queues=queues,
            openvino_version="2026.4.1",
            memory_bytes=2**33,
        )
        if heartbeat_at is not None:
            row = session.get(Worker, name)
            row.heartbeat_at = heartbeat_at
            session.commit()


def test_worker_pages_hold_every_worker_once_by_name(served_farm):
    names = [f"w{n}@host|{n}" for n in (3, 1, 4, 0, 2)]  # a '|' in a name survives the cursor
    for name in names:
        _register(served_farm, name, ["compile.cpu"])
    pages, after = [], None
    while True:
        with served_farm.session() as session:
            rows = workers_view(session, 60, 2, after)
        pages.append([row["name"] for row in rows])
        if len(rows) < 2:
            break
        after = after_worker(worker_cursor(rows[-1]["name"]))
    assert pages == [sorted(names)[0:2], sorted(names)[2:4], sorted(names)[4:]]


def test_tokens_are_read_a_page_at_a_time(served_farm):
    with served_farm.session() as session:
        for n in range(5):
            create_token(session, f"t{n}", "pull")
        first = list_tokens(session, 2)
        rest = list_tokens(session, 10, first[-1].id)
    assert [t.name for t in first + rest] == [f"t{n}" for n in range(5)]


def test_a_page_of_jobs_reads_names_and_notes_in_a_fixed_number_of_queries(served_farm):
    """Waiting notes and model names for a page: the same queries for 2 jobs as for 30."""
    model = add_model(served_farm, "resnet.xml")
    _register(served_farm, "live@host", ["compile.cpu"])
    _register(served_farm, "gone@host", ["compile.npu"], heartbeat_at=T0)
    sent = {"sent_at": T0}
    served = [add_job(served_farm, model, n, **sent) for n in range(15)]
    waiting = [add_job(served_farm, model, 100 + n, queue="compile.npu", **sent) for n in range(15)]

    def page(limit: int) -> tuple[list[dict], int]:
        statements: list[str] = []
        engine = served_farm.sessions.kw["bind"]

        def record(conn, cursor, statement, *args) -> None:
            statements.append(statement)

        with served_farm.session() as session:
            jobs = list_jobs(session, limit=limit)
            event.listen(engine, "before_cursor_execute", record)
            try:
                views = job_views(session, jobs, 60)
            finally:
                event.remove(engine, "before_cursor_execute", record)
        return views, len(statements)

    _, few_queries = page(2)
    every, every_queries = page(30)
    assert few_queries == every_queries == 2  # model names, live workers
    notes = {view["id"]: view["note"] for view in every}
    assert {view["model_name"] for view in every} == {"resnet.xml"}
    assert [job for job in served if notes[job]] == []
    assert all("queue compile.npu" in notes[job] for job in waiting)


def test_a_queued_job_says_what_keeps_it_waiting(served_farm):
    """Not sent (the broker did not take it), no live worker with an NPU compiler, no live
    worker with its toolchain: each in its own words, both when both hold."""
    model = add_model(served_farm, "m.xml")
    _register(served_farm, "cpu@host", ["compile.cpu"])
    npu = {"target": "NPU.4000", "queue": "compile.npu.4000.x", "sent_at": T0}
    unsent = add_job(served_farm, model, 1)
    npu_job = add_job(served_farm, model, 2, **npu)
    both = add_job(served_farm, model, 3, **{**npu, "sent_at": None})

    def notes() -> dict[int, str | None]:
        with served_farm.session() as session:
            return {view["id"]: view["note"] for view in job_views(session, list_jobs(session), 60)}

    first = notes()
    assert first[unsent] == routing.unsent_note(unsent)
    assert first[unsent].startswith(f"job {unsent} is recorded, but the broker")
    assert "will be sent when the broker is back" in first[unsent]
    assert first[npu_job].startswith("no live worker has an NPU compiler, so none can compile")
    assert first[both] == f"{routing.unsent_note(both)}; {first[npu_job]}"

    # A live worker with an NPU compiler, of another toolchain: the toolchain is what is missing.
    _register(served_farm, "npu@host", ["compile.npu.4000.y"], toolchains={"NPU.4000": {}})
    assert notes()[npu_job].startswith('no live worker has the toolchain {"openvino": ')
