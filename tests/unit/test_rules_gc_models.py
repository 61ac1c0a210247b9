"""`farm gc` also deletes the model files no job names, once older than a grace period: a model
uploaded but not yet submitted, or still uploading, survives (docs/architecture.md §7)."""

from __future__ import annotations

import os
import time

from farm.server.blobs import gc
from farm.server.jobs.service import register_model
from farm.server.storage import model_storage_key
from farm.server.storage.local import LocalStore
from tests.unit.conftest import make_ref, store_model

DAY = 24 * 3600


def stored_models(farm) -> set[str]:
    return {key.removeprefix("models/") for key, _, _ in farm.store.list_objects("models/")}


def backdate(farm, ref, seconds: float) -> None:
    """Make the model's stored files `seconds` older (a test cannot wait a day)."""
    for sha in ref.identity.values():
        path = farm.store.local_path(model_storage_key(sha))
        then = time.time() - seconds
        os.utime(path, (then, then))


def register(farm, ref) -> None:
    """What a submit does when it creates a job: the model's row names its files."""
    with farm.session() as session:
        register_model(session, ref.info)
        session.commit()


def test_model_files_no_job_names_are_deleted_after_the_grace_period(embedded_farm, tmp_path):
    named, orphan, fresh = (make_ref(tmp_path / name, name) for name in ("named", "orphan", "new"))
    for ref in (named, orphan, fresh):
        store_model(embedded_farm, ref)
    register(embedded_farm, named)
    backdate(embedded_farm, named, 2 * DAY)
    backdate(embedded_farm, orphan, 2 * DAY)  # uploaded two days ago, never submitted
    everything = {sha for ref in (named, orphan, fresh) for sha in ref.identity.values()}
    orphan_files = sorted(orphan.identity.values())

    with embedded_farm.session() as session:
        dry = gc.collect(session, embedded_farm.store, 7, dry_run=True, model_grace_seconds=DAY)
    assert sorted(m.sha256 for m in dry.models) == orphan_files
    assert dry.model_bytes == orphan.info.size_bytes
    assert dry.as_dict()["model_grace_seconds"] == DAY
    assert stored_models(embedded_farm) == everything  # a dry run deletes nothing

    with embedded_farm.session() as session:
        report = gc.collect(session, embedded_farm.store, 7, model_grace_seconds=DAY)
    assert sorted(m.sha256 for m in report.models) == orphan_files and report.errors == []
    assert stored_models(embedded_farm) == everything - set(orphan_files)

    with embedded_farm.session() as session:
        again = gc.collect(session, embedded_farm.store, 7, model_grace_seconds=DAY)
    assert again.models == []
    assert stored_models(embedded_farm) == everything - set(orphan_files)


class SubmittingStore(LocalStore):
    """The farm's local store; a submit registers `ref` while gc lists the model files."""

    def __init__(self, farm, ref) -> None:
        super().__init__(farm.store.root)
        self.farm, self.ref = farm, ref

    def list_objects(self, prefix):
        yield from super().list_objects(prefix)
        register(self.farm, self.ref)


def test_a_model_file_a_job_names_while_gc_runs_is_kept(embedded_farm, tmp_path):
    ref = make_ref(tmp_path / "late", "late")
    store_model(embedded_farm, ref)
    backdate(embedded_farm, ref, 2 * DAY)
    store = SubmittingStore(embedded_farm, ref)
    with embedded_farm.session() as session:
        report = gc.collect(session, store, 7, model_grace_seconds=DAY)
    assert report.models == [] and report.errors == []
    assert stored_models(embedded_farm) == set(ref.identity.values())
