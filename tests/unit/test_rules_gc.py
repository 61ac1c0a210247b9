"""`farm gc` (docs/architecture.md §7): blobs whose last pull (or, never pulled, whose creation)
is N days old or more lose their row, then their object, with a `blob_deletions` record."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest
from sqlalchemy import event, select, text, update

from farm.core.clock import now
from farm.core.errors import StorageError
from farm.server.blobs import gc
from farm.server.blobs.service import record_pull
from farm.server.db.models import Blob, BlobDeletion, Pull
from farm.server.storage import blob_storage_key
from tests.unit.conftest import add_blob, add_job, add_model, key

DAYS = 7


@pytest.fixture
def model_id(embedded_farm) -> int:
    return add_model(embedded_farm)


def days_ago(days: float):
    return now() - timedelta(days=days)


def pull(farm, cache_key: str, days: float, ok: bool = True) -> datetime:
    """An edge's pull report, `days` ago; returns when exactly."""
    at = days_ago(days)
    with farm.session() as session:
        pull_id = record_pull(session, cache_key, "edge-1", ok, error=None if ok else "no")
        session.execute(update(Pull).where(Pull.id == pull_id).values(created_at=at))
        session.commit()
    return at


def blob_keys(farm) -> set[str]:
    with farm.session() as session:
        return set(session.scalars(select(Blob.cache_key)))


def object_keys(farm) -> set[str]:
    root = farm.store.root / "blobs"
    return {path.name.removesuffix(".blob") for path in root.glob("*.blob")}


def deletions(farm) -> list[BlobDeletion]:
    with farm.session() as session:
        return list(session.scalars(select(BlobDeletion).order_by(BlobDeletion.id)))


def pull_count(farm) -> int:
    with farm.session() as session:
        return len(list(session.scalars(select(Pull.id))))


def test_candidates_are_blobs_unused_for_n_days_in_blob_order(embedded_farm, model_id):
    at = now()
    never_old = add_blob(
        embedded_farm, model_id, key("never-old"), created_at=at - timedelta(days=10)
    )
    add_blob(embedded_farm, model_id, key("never-new"), created_at=at - timedelta(days=3))
    pulled_old = add_blob(
        embedded_farm, model_id, key("pulled-old"), created_at=at - timedelta(days=30)
    )
    pull(embedded_farm, pulled_old.cache_key, 20, ok=False)
    last = pull(embedded_farm, pulled_old.cache_key, 8)
    pulled_new = add_blob(
        embedded_farm, model_id, key("pulled-new"), created_at=at - timedelta(days=30)
    )
    pull(embedded_farm, pulled_new.cache_key, 2)
    with embedded_farm.session() as session:
        found = list(gc.candidates(session, DAYS, at))
    assert [(c.cache_key, c.pulls) for c in found] == [
        (never_old.cache_key, 0),  # last used 10 days ago (created)
        (pulled_old.cache_key, 2),  # last used 8 days ago (pulled; a failed pull counts)
    ]
    assert found[0].last_pulled_at is None
    assert found[1].last_pulled_at == last


def test_a_blob_exactly_n_days_unused_is_a_candidate(embedded_farm, model_id):
    at = now()
    exact = add_blob(embedded_farm, model_id, key(1), created_at=at - timedelta(days=DAYS))
    add_blob(embedded_farm, model_id, key(2), created_at=at - timedelta(days=DAYS, seconds=-1))
    with embedded_farm.session() as session:
        found = [c.cache_key for c in gc.candidates(session, DAYS, at)]
    assert found == [exact.cache_key]


def test_a_dry_run_changes_nothing(embedded_farm, model_id):
    old = add_blob(embedded_farm, model_id, key("old"), created_at=days_ago(10))
    pull(embedded_farm, old.cache_key, 9)
    new = add_blob(embedded_farm, model_id, key("new"))
    with embedded_farm.session() as session:
        report = gc.collect(session, embedded_farm.store, DAYS, dry_run=True)
    assert [c.cache_key for c in report.blobs] == [old.cache_key]
    assert (report.dry_run, report.objects_deleted, report.pending) == (True, 0, [])
    assert report.bytes == old.size_bytes
    assert blob_keys(embedded_farm) == object_keys(embedded_farm) == {old.cache_key, new.cache_key}
    assert deletions(embedded_farm) == [] and pull_count(embedded_farm) == 1


def test_a_run_deletes_the_row_its_pulls_and_its_object_and_records_it(embedded_farm, model_id):
    old = add_blob(embedded_farm, model_id, key("old"), created_at=days_ago(30))
    pull(embedded_farm, old.cache_key, 20, ok=False)
    last = pull(embedded_farm, old.cache_key, 10)
    kept = add_blob(embedded_farm, model_id, key("kept"), created_at=days_ago(30))
    pull(embedded_farm, kept.cache_key, 1)
    with embedded_farm.session() as session:
        report = gc.collect(session, embedded_farm.store, DAYS)
    assert [c.cache_key for c in report.blobs] == [old.cache_key]
    assert (report.objects_deleted, report.objects_kept, report.pending, report.errors) == (
        1,
        0,
        [],
        [],
    )
    assert blob_keys(embedded_farm) == object_keys(embedded_farm) == {kept.cache_key}
    assert pull_count(embedded_farm) == 1  # the kept blob's
    [record] = deletions(embedded_farm)
    assert (record.cache_key, record.storage_key, record.state) == (
        old.cache_key,
        blob_storage_key(old.cache_key),
        "deleted",
    )
    assert (record.sha256, record.size_bytes, record.pulls, record.failed_pulls) == (
        old.sha256,
        old.size_bytes,
        2,
        1,
    )
    assert record.reason == "unpulled for 7 days"
    assert record.last_pulled_at == last
    assert record.object_deleted_at is not None


def test_a_blob_whose_key_has_an_active_job_loses_its_row_but_keeps_its_object(
    embedded_farm, model_id
):
    old = add_blob(embedded_farm, model_id, key("old"), created_at=days_ago(10))
    add_job(embedded_farm, model_id, "old", state="running", attempts=1, lease_expires_at=now())
    with embedded_farm.session() as session:
        report = gc.collect(session, embedded_farm.store, DAYS)
    assert [c.cache_key for c in report.blobs] == [old.cache_key]
    assert (report.objects_deleted, report.objects_kept) == (0, 1)
    assert blob_keys(embedded_farm) == set()
    assert object_keys(embedded_farm) == {old.cache_key}
    assert [(d.cache_key, d.state) for d in deletions(embedded_farm)] == [(old.cache_key, "kept")]


class FailingDeletes:
    """The local store, except that deleting an object fails (an unreachable S3, say)."""

    def __init__(self, store) -> None:
        self.store = store

    def delete(self, key: str) -> None:
        raise StorageError(f"cannot delete {key}: store unreachable")


def test_a_failed_object_delete_stays_pending_and_the_next_run_finishes_it(embedded_farm, model_id):
    old = add_blob(embedded_farm, model_id, key("old"), created_at=days_ago(10))
    with embedded_farm.session() as session:
        failed = gc.collect(session, FailingDeletes(embedded_farm.store), DAYS)
    storage_key = blob_storage_key(old.cache_key)
    assert [c.cache_key for c in failed.blobs] == [old.cache_key]
    assert (failed.objects_deleted, failed.pending) == (0, [old.cache_key])
    assert failed.errors == [f"cannot delete {storage_key}: store unreachable"]
    assert blob_keys(embedded_farm) == set()  # no reader sees a row whose object is gone
    assert object_keys(embedded_farm) == {old.cache_key}
    assert [(d.cache_key, d.state) for d in deletions(embedded_farm)] == [
        (old.cache_key, "pending")
    ]
    with embedded_farm.session() as session:
        dry = gc.collect(session, embedded_farm.store, DAYS, dry_run=True)
    assert (dry.blobs, dry.pending) == ([], [old.cache_key])

    with embedded_farm.session() as session:
        retried = gc.collect(session, embedded_farm.store, DAYS)
    assert (retried.blobs, retried.objects_deleted, retried.pending) == ([], 1, [])
    assert object_keys(embedded_farm) == set()
    assert [(d.cache_key, d.state) for d in deletions(embedded_farm)] == [
        (old.cache_key, "deleted")
    ]


def test_a_pending_object_whose_key_came_back_is_kept(embedded_farm, model_id):
    old = add_blob(embedded_farm, model_id, key("old"), created_at=days_ago(10))
    with embedded_farm.session() as session:
        gc.collect(session, FailingDeletes(embedded_farm.store), DAYS)
    add_blob(embedded_farm, model_id, old.cache_key)  # compiled again meanwhile
    with embedded_farm.session() as session:
        report = gc.collect(session, embedded_farm.store, DAYS)
    assert (report.blobs, report.objects_deleted, report.objects_kept) == ([], 0, 1)
    assert blob_keys(embedded_farm) == object_keys(embedded_farm) == {old.cache_key}
    assert [(d.cache_key, d.state) for d in deletions(embedded_farm)] == [(old.cache_key, "kept")]


def _count_selects_of_blobs(farm) -> list[str]:
    """Record each statement that reads the candidates (FROM blobs ... LIMIT)."""
    seen: list[str] = []

    def record(conn, cursor, statement, parameters, context, executemany) -> None:
        reads = statement.lstrip().upper().startswith("SELECT") and "FROM blobs" in statement
        if reads and "LIMIT" in statement.upper():
            seen.append(statement)

    event.listen(farm.sessions.kw["bind"], "before_cursor_execute", record)
    return seen


def test_candidates_are_read_a_batch_at_a_time(embedded_farm, model_id):
    old = [add_blob(embedded_farm, model_id, key(n), created_at=days_ago(10)) for n in range(7)]
    add_blob(embedded_farm, model_id, key("fresh"))
    reads = _count_selects_of_blobs(embedded_farm)
    with embedded_farm.session() as session:
        found = gc.candidates(session, DAYS, batch_size=3)
        first = next(found)
        assert (first.cache_key, len(reads)) == (old[0].cache_key, 1)  # one batch read so far
        rest = list(found)
    assert [c.cache_key for c in [first, *rest]] == [b.cache_key for b in old]
    assert len(reads) == 3  # 3 + 3 + 1: no query reads more than a batch


def test_a_run_in_batches_smaller_than_the_candidates_deletes_them_all(embedded_farm, model_id):
    old = [add_blob(embedded_farm, model_id, key(n), created_at=days_ago(10)) for n in range(7)]
    for blob in old[:3]:
        pull(embedded_farm, blob.cache_key, 9)
    fresh = add_blob(embedded_farm, model_id, key("fresh"))
    pull(embedded_farm, fresh.cache_key, 1)
    listed: list[str] = []
    with embedded_farm.session() as session:
        report = gc.collect(
            session,
            embedded_farm.store,
            DAYS,
            batch_size=3,
            on_blob=lambda c: listed.append(c.cache_key),
        )
    assert listed == [b.cache_key for b in old]
    # Streamed to the caller: the report keeps the totals, not the rows.
    assert (report.blobs, report.blob_count, report.bytes) == (
        [],
        7,
        sum(b.size_bytes for b in old),
    )
    assert (report.objects_deleted, report.objects_kept, report.pending, report.errors) == (
        7,
        0,
        [],
        [],
    )
    assert blob_keys(embedded_farm) == object_keys(embedded_farm) == {fresh.cache_key}
    assert pull_count(embedded_farm) == 1
    records = deletions(embedded_farm)
    assert [(d.cache_key, d.state, d.pulls) for d in records] == [
        (b.cache_key, "deleted", 1 if n < 3 else 0) for n, b in enumerate(old)
    ]


def test_a_blob_pulled_after_gc_listed_it_is_left_with_its_pulls(embedded_farm, model_id):
    idle = add_blob(embedded_farm, model_id, key("idle"), created_at=days_ago(10))
    revived = add_blob(embedded_farm, model_id, key("revived"), created_at=days_ago(10))
    at = now()
    with embedded_farm.session() as session:
        listed = list(gc.candidates(session, DAYS, at))
    assert [c.cache_key for c in listed] == [idle.cache_key, revived.cache_key]
    with embedded_farm.session() as session:
        record_pull(session, revived.cache_key, "edge-1", True)  # pulled meanwhile
    with embedded_farm.session() as session:
        removed = gc._remove_rows(session, listed, at - timedelta(days=DAYS), DAYS)
    assert [c.cache_key for c in removed] == [idle.cache_key]
    assert blob_keys(embedded_farm) == {revived.cache_key}
    assert pull_count(embedded_farm) == 1
    assert [(d.cache_key, d.state) for d in deletions(embedded_farm)] == [
        (idle.cache_key, "pending")
    ]


def test_compile_vs_import_counts_imports_not_downloads(embedded_farm, model_id):
    """A pull reported ok without an import time (`farm pull`, fleet prefetch) is a download:
    `compile_vs_import.imports` counts only the pulls that imported."""
    blob = add_blob(embedded_farm, model_id, key("b"))
    with embedded_farm.session() as session:
        record_pull(session, blob.cache_key, "edge-1", True, import_seconds=0.5)
        record_pull(session, blob.cache_key, "edge-1", True, import_seconds=1.5)
        record_pull(session, blob.cache_key, "edge-2", True)  # downloaded only
        record_pull(session, blob.cache_key, "edge-3", False, error="device lost")
        row = session.execute(
            text("SELECT imports, import_seconds_avg FROM compile_vs_import")
        ).one()
        usage = session.execute(text("SELECT pulls, ok_pulls FROM blob_usage")).one()
    assert tuple(row) == (2, 1.0)
    assert tuple(usage) == (4, 3)
