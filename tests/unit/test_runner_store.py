"""The runner and the write-once store: a blob object that no row names (left by an attempt that
failed between storing and recording it) never blocks its cache key."""

from __future__ import annotations

import hashlib

from sqlalchemy import select

from farm.server.db.models import Blob, Job
from farm.server.storage import blob_storage_key
from tests.unit.test_rules_cancel import fake_compile, queued_job, run, use_compile  # noqa: F401


def test_an_object_no_row_names_is_replaced_by_the_blob_compiled_now(
    embedded_farm,
    queued_job,  # noqa: F811 - the fixture, imported above
    tmp_path,
    monkeypatch,
):
    with embedded_farm.session() as session:
        cache_key = session.get(Job, queued_job).cache_key
    left = tmp_path / "left behind"
    left.write_bytes(b"an earlier attempt's other bytes")
    embedded_farm.store.adopt_file(blob_storage_key(cache_key), left)
    use_compile(monkeypatch, fake_compile(lambda should_stop: None))

    job = run(embedded_farm, embedded_farm.store, queued_job, tmp_path)

    assert job.state == "succeeded", job.error
    stored = embedded_farm.store.local_path(blob_storage_key(cache_key)).read_bytes()
    assert stored == b"compiled"
    with embedded_farm.session() as session:
        [recorded] = session.scalars(select(Blob.sha256).where(Blob.cache_key == cache_key))
    assert recorded == hashlib.sha256(b"compiled").hexdigest()
