"""The verification rules on SQLite: a report is recorded against the bytes it ran, a failed one
quarantines the blob once (the first reason stays), an admin releases it, and a rebuild retires
only a quarantined blob, keeping its verifications."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import select

from farm.core.clock import now
from farm.core.errors import Conflict, NotFound
from farm.core.identity import key_for
from farm.server.blobs import verifications
from farm.server.blobs.rebuild import retire_quarantined
from farm.server.db.models import Blob, BlobDeletion, Pull, Verification
from farm.server.storage import blob_storage_key
from tests.unit.conftest import CPU, TOOLCHAIN, add_blob, add_model, key

IDENTITY = {"xml": "1" * 64, "bin": "2" * 64}


def report(passed: bool = True, **fields: Any) -> dict[str, Any]:
    return {
        "agent_id": "edge-1",
        "device_name": "Intel(R) AI Boost",
        "openvino_version": "2026.4.1",
        "driver_version": "1.10",
        "passed": passed,
        "max_abs_error": 0.0 if passed else 0.5,
        "mean_abs_error": 0.0 if passed else 0.1,
        "min_cosine": 1.0 if passed else 0.9,
        "tolerance": {"atol": 0.01, "rtol": 0.02, "min_cosine": 0.999},
        "outputs": [],
        "runs": 10,
        "latency_p50_ms": 1.5,
        **fields,
    }


def blob_row(farm, cache_key: str) -> Blob:
    with farm.session() as session:
        blob = session.scalar(select(Blob).where(Blob.cache_key == cache_key))
        assert blob is not None
        return blob


def test_a_passed_report_is_recorded_and_quarantines_nothing(embedded_farm):
    blob = add_blob(embedded_farm, add_model(embedded_farm), key(1))
    with embedded_farm.session() as session:
        row, quarantined = verifications.record_verification(session, key(1), blob.sha256, report())
        assert (row.blob_id, row.target, row.passed, quarantined) == (blob.id, "CPU", True, False)
    assert blob_row(embedded_farm, key(1)).quarantined_at is None


def test_a_failed_report_quarantines_only_its_blob_with_its_figures(embedded_farm):
    model = add_model(embedded_farm)
    bad, good = add_blob(embedded_farm, model, key(1)), add_blob(embedded_farm, model, key(2))
    with embedded_farm.session() as session:
        row, quarantined = verifications.record_verification(
            session, key(1), bad.sha256, report(passed=False)
        )
    assert quarantined is True
    quarantined_blob = blob_row(embedded_farm, key(1))
    assert quarantined_blob.quarantined_at is not None
    assert f"verification {row.id} on Intel(R) AI Boost (edge-1)" in (
        quarantined_blob.quarantine_reason or ""
    )
    assert "max abs error 0.5" in (quarantined_blob.quarantine_reason or "")
    assert blob_row(embedded_farm, key(2)).quarantined_at is None
    assert good.id != bad.id


def test_a_second_failure_keeps_the_first_reason(embedded_farm):
    blob = add_blob(embedded_farm, add_model(embedded_farm), key(1))
    with embedded_farm.session() as session:
        first, _ = verifications.record_verification(
            session, key(1), blob.sha256, report(passed=False)
        )
        second, quarantined = verifications.record_verification(
            session, key(1), blob.sha256, report(passed=False, agent_id="edge-2")
        )
    assert quarantined is False
    assert f"verification {first.id} " in (blob_row(embedded_farm, key(1)).quarantine_reason or "")
    assert second.id != first.id


def test_a_report_that_could_not_judge_the_blob_is_recorded_and_never_quarantines(
    embedded_farm,
):
    """No false quarantine: an import out of memory, a missing device library, inputs that do
    not fit are the harness's errors, not the blob's."""
    blob = add_blob(embedded_farm, add_model(embedded_farm), key(1))
    with embedded_farm.session() as session:
        for passed in (True, False):
            row, quarantined = verifications.record_verification(
                session,
                key(1),
                blob.sha256,
                report(passed=passed, error="could not import the blob on NPU: out of memory"),
            )
            assert (row.passed, quarantined) == (False, False)
    assert blob_row(embedded_farm, key(1)).quarantined_at is None


def test_the_quarantine_reason_is_one_line_naming_the_worst_output(embedded_farm):
    blob = add_blob(embedded_farm, add_model(embedded_farm), key(1))
    outputs = [
        {
            "name": "speech_probs",
            "max_abs_error": 0.5,
            "mean_abs_error": 0.2,
            "cosine": 0.8,
            "passed": False,
        },
        {
            "name": "stateN",
            "max_abs_error": 0.0,
            "mean_abs_error": 0.0,
            "cosine": 1.0,
            "passed": True,
        },
    ]
    failed = report(passed=False, outputs=outputs, device_name="NPU\nInjected: line")
    with embedded_farm.session() as session:
        row, quarantined = verifications.record_verification(session, key(1), blob.sha256, failed)
    reason = blob_row(embedded_farm, key(1)).quarantine_reason or ""
    assert quarantined and "\n" not in reason
    assert f"verification {row.id} on NPU Injected: line (edge-1): output 'speech_probs'" in reason
    assert "max abs error 0.5, cosine 0.800000; allowed atol=0.01" in reason


def test_an_ok_pull_of_a_quarantined_blob_is_refused_a_failed_one_recorded(embedded_farm):
    from farm.core.errors import BlobQuarantined
    from farm.server.blobs.service import record_pull

    add_blob(embedded_farm, add_model(embedded_farm), key(1))
    with embedded_farm.session() as session:
        record_pull(session, key(1), "edge-1", ok=True)
        verifications.quarantine(session, key(1), "bad numbers")
        with pytest.raises(BlobQuarantined, match="bad numbers"):
            record_pull(session, key(1), "edge-1", ok=True)
        record_pull(session, key(1), "edge-1", ok=False, error="BlobQuarantined: ...")
        assert [p.ok for p in session.scalars(select(Pull).order_by(Pull.id))] == [True, False]


def test_a_rebuild_into_the_same_bytes_stays_quarantined_only_an_admin_lifts_it(embedded_farm):
    cache_key = key_for(IDENTITY, CPU, TOOLCHAIN)
    blob = add_blob(embedded_farm, add_model(embedded_farm), cache_key)
    with embedded_farm.session() as session:
        verifications.record_verification(session, cache_key, blob.sha256, report(passed=False))
        retire_quarantined(session, embedded_farm.store, IDENTITY, [CPU], TOOLCHAIN)
        inherited = verifications.inherited_quarantine(session, cache_key, blob.sha256)
        assert inherited is not None
        assert inherited.startswith("rebuilt into the same bytes as the blob quarantined")
        assert "outside tolerance" in inherited
        assert verifications.inherited_quarantine(session, cache_key, "e" * 64) is None
        assert verifications.inherited_quarantine(session, key(5), blob.sha256) is None


def test_a_blob_collected_unquarantined_passes_on_no_quarantine(embedded_farm):
    from datetime import timedelta

    from farm.server.blobs import gc

    blob = add_blob(
        embedded_farm, add_model(embedded_farm), key(1), created_at=now() - timedelta(days=40)
    )
    with embedded_farm.session() as session:
        gc.collect(session, embedded_farm.store, unpulled_days=30)
        assert session.scalars(select(BlobDeletion)).one().quarantine_reason is None
        assert verifications.inherited_quarantine(session, key(1), blob.sha256) is None


def test_a_report_about_other_bytes_or_no_blob_is_refused_and_records_nothing(embedded_farm):
    add_blob(embedded_farm, add_model(embedded_farm), key(1))
    with embedded_farm.session() as session:
        with pytest.raises(Conflict, match="verify it again"):
            verifications.record_verification(session, key(1), "f" * 64, report(passed=False))
        with pytest.raises(NotFound):
            verifications.record_verification(session, key(9), "f" * 64, report())
        assert session.scalars(select(Verification)).all() == []
    assert blob_row(embedded_farm, key(1)).quarantined_at is None


def test_an_admin_quarantines_and_releases(embedded_farm):
    add_blob(embedded_farm, add_model(embedded_farm), key(1))
    with embedded_farm.session() as session:
        blob = verifications.quarantine(session, key(1), "crashed a Lunar Lake NPU")
        assert blob.quarantine_reason == "crashed a Lunar Lake NPU"
        again = verifications.quarantine(session, key(1), "another reason")
        assert again.quarantine_reason == "crashed a Lunar Lake NPU"
        released = verifications.release(session, key(1))
        assert (released.quarantined_at, released.quarantine_reason) == (None, None)


def test_a_rebuild_refuses_a_blob_that_is_not_quarantined_and_deletes_nothing(embedded_farm):
    cache_key = key_for(IDENTITY, CPU, TOOLCHAIN)
    add_blob(embedded_farm, add_model(embedded_farm), cache_key)
    with embedded_farm.session() as session, pytest.raises(Conflict, match="not quarantined"):
        retire_quarantined(session, embedded_farm.store, IDENTITY, [CPU], TOOLCHAIN)
    assert blob_row(embedded_farm, cache_key).id
    assert embedded_farm.store.exists(blob_storage_key(cache_key))


def test_a_rebuild_retires_a_quarantined_blob_and_keeps_its_history(embedded_farm):
    cache_key = key_for(IDENTITY, CPU, TOOLCHAIN)
    blob = add_blob(embedded_farm, add_model(embedded_farm), cache_key)
    untouched = add_blob(embedded_farm, add_model(embedded_farm, "other"), key(2))
    with embedded_farm.session() as session:
        session.add_all(
            Pull(blob_id=b.id, cache_key=b.cache_key, agent_id="e", ok=ok, created_at=b.created_at)
            for b, ok in ((blob, True), (blob, False), (untouched, True))
        )
        session.commit()
        row, _ = verifications.record_verification(
            session, cache_key, blob.sha256, report(passed=False)
        )
        retired = retire_quarantined(session, embedded_farm.store, IDENTITY, [CPU], TOOLCHAIN)
        assert retired == [cache_key]
        assert session.scalar(select(Blob).where(Blob.cache_key == cache_key)) is None
        kept = session.get_one(Verification, row.id)
        assert (kept.blob_id, kept.cache_key, kept.blob_sha256) == (None, cache_key, blob.sha256)
        deletion = session.scalars(select(BlobDeletion)).one()
        assert (deletion.cache_key, deletion.pulls, deletion.failed_pulls, deletion.state) == (
            cache_key,
            2,
            1,
            "deleted",
        )
        assert deletion.reason.startswith("rebuilt after quarantine: verification ")
        assert [p.blob_id for p in session.scalars(select(Pull))] == [untouched.id]
    assert not embedded_farm.store.exists(blob_storage_key(cache_key))
    assert embedded_farm.store.exists(blob_storage_key(key(2)))


def test_a_rebuild_of_a_model_without_a_blob_retires_nothing(embedded_farm):
    with embedded_farm.session() as session:
        assert retire_quarantined(session, embedded_farm.store, IDENTITY, [CPU], TOOLCHAIN) == []


def test_a_key_rotation_re_signs_the_reference_with_the_manifest(embedded_farm, tmp_path):
    from farm.core.identity import ModelInfo
    from farm.core.signing import Signer, TrustedKeys
    from farm.server.blobs.resign import resign
    from farm.server.blobs.signatures import sign_reference, sign_row
    from farm.server.jobs.service import register_model

    old, new = (Signer.from_file(_key(tmp_path / name)) for name in ("old", "new"))
    with embedded_farm.session() as session:
        model = register_model(session, ModelInfo(IDENTITY, "m.xml", 10))
        session.commit()
        model_id = model.id
    cache_key = key_for(IDENTITY, CPU, TOOLCHAIN)
    add_blob(embedded_farm, model_id, cache_key)
    compiled = _real_blob(tmp_path)  # resign checks the stored object is a compiled blob
    stored = embedded_farm.store.put_file(f"blobs/{cache_key}.compiled", compiled.blob_path)
    with embedded_farm.session() as session:
        row = session.scalars(select(Blob)).one()
        row.storage_key, row.size_bytes, row.sha256 = stored.key, stored.size, stored.sha256
        row.payload_offset = compiled.payload_offset
        row.reference_sha256, row.reference_size_bytes = "d" * 64, 99
        sign_row(row, old)
        sign_reference(row, old)
        session.commit()
    report = resign(
        embedded_farm.sessions, embedded_farm.store, new, TrustedKeys({old.key_id: old.public_key})
    )
    assert report.failures == [] and report.resigned == 1, report.failures[0].reason
    row = blob_row(embedded_farm, cache_key)
    assert row.signing_key_id == new.key_id
    record = {c.key: getattr(row, c.key) for c in Blob.__table__.columns}
    TrustedKeys({new.key_id: new.public_key}).verify_reference(record)


def _real_blob(tmp_path):
    from farm.core.spec import CompileSpec
    from farm.server.jobs import compiler
    from tests import models

    files = {"xml": models.save_ir(models.conv_net(), tmp_path / "m" / "m.xml")}
    files["bin"] = files["xml"].with_suffix(".bin")
    (tmp_path / "out").mkdir()
    return compiler.compile_to_file(files, CompileSpec.create("CPU"), tmp_path / "out", "k" * 64)


def _key(path):
    from farm.core.signing import create_key_pair

    create_key_pair(path / "k.pem")
    return path / "k.pem"


def test_a_report_of_non_finite_outputs_quarantines_with_a_reason_that_says_so(embedded_farm):
    blob = add_blob(embedded_farm, add_model(embedded_farm), key(1))
    nan = report(passed=False, max_abs_error=None, mean_abs_error=None, min_cosine=None)
    with embedded_farm.session() as session:
        _, quarantined = verifications.record_verification(session, key(1), blob.sha256, nan)
    assert quarantined is True
    assert "max abs error non-finite or missing" in (
        blob_row(embedded_farm, key(1)).quarantine_reason or ""
    )


@pytest.mark.parametrize(
    "tolerance",
    [
        {"atol": 0.0, "rtol": 0.02, "min_cosine": 0.999},
        {"atol": 0.01, "rtol": 0.02, "min_cosine": 1.0},
    ],
    ids=["atol", "cosine"],
)
def test_a_failure_under_a_tolerance_stricter_than_the_default_does_not_quarantine(
    embedded_farm, tolerance
):
    blob = add_blob(embedded_farm, add_model(embedded_farm), key(1))  # a CPU blob
    strict = report(passed=False, tolerance={**tolerance, "atol": min(tolerance["atol"], 1e-5)})
    with embedded_farm.session() as session:
        row, quarantined = verifications.record_verification(session, key(1), blob.sha256, strict)
        assert (row.passed, quarantined) == (False, False)
    assert blob_row(embedded_farm, key(1)).quarantined_at is None


def test_quarantine_on_failure_off_records_without_quarantining(embedded_farm):
    blob = add_blob(embedded_farm, add_model(embedded_farm), key(1))
    with embedded_farm.session() as session:
        _, quarantined = verifications.record_verification(
            session, key(1), blob.sha256, report(passed=False), quarantine_on_failure=False
        )
    assert quarantined is False and blob_row(embedded_farm, key(1)).quarantined_at is None


def test_verifications_are_listed_newest_first_a_page_at_a_time(embedded_farm):
    blob = add_blob(embedded_farm, add_model(embedded_farm), key(1))
    with embedded_farm.session() as session:
        ids = [
            verifications.record_verification(session, key(1), blob.sha256, report())[0].id
            for _ in range(3)
        ]
        first = verifications.verifications_of(session, key(1), limit=2)
        rest = verifications.verifications_of(session, key(1), limit=2, before_id=first[-1].id)
        assert [v.id for v in first + rest] == ids[::-1]
        with pytest.raises(NotFound):
            verifications.verifications_of(session, key(9))


def test_an_admin_deletes_only_a_quarantined_blob(embedded_farm):
    from farm.server.blobs.rebuild import delete_quarantined

    add_blob(embedded_farm, add_model(embedded_farm), key(1))
    with embedded_farm.session() as session:
        with pytest.raises(Conflict, match="not quarantined"):
            delete_quarantined(session, embedded_farm.store, key(1), "root@host")
        verifications.quarantine(session, key(1), "bad numbers")
        delete_quarantined(session, embedded_farm.store, key(1), "root@host")
        deletion = session.scalars(select(BlobDeletion)).one()
        assert deletion.reason == "deleted by root@host after quarantine: bad numbers"
        assert deletion.quarantine_reason == "bad numbers"
    assert not embedded_farm.store.exists(blob_storage_key(key(1)))


def test_gc_deletes_a_blobs_reference_object_with_it(embedded_farm, tmp_path):
    from datetime import timedelta

    from sqlalchemy import update

    from farm.server.blobs import gc
    from farm.server.storage import reference_storage_key

    blob = add_blob(embedded_farm, add_model(embedded_farm), key(1))
    source = tmp_path / "r.npz"
    source.write_bytes(b"reference")
    stored = embedded_farm.store.put_file(reference_storage_key(key(1), "e" * 64), source)
    with embedded_farm.session() as session:
        session.execute(
            update(Blob)
            .where(Blob.id == blob.id)
            .values(
                reference_sha256="e" * 64,
                reference_size_bytes=stored.size,
                created_at=blob.created_at - timedelta(days=40),
            )
        )
        session.commit()
        report = gc.collect(session, embedded_farm.store, unpulled_days=30)
        deletion = session.scalars(select(BlobDeletion)).one()
    assert report.blob_count == 1 and deletion.state == "deleted"
    assert deletion.reference_storage_key == reference_storage_key(key(1), "e" * 64)
    assert not embedded_farm.store.exists(reference_storage_key(key(1), "e" * 64))


def test_a_pull_token_s_key_prefixes_see_blobs_only(embedded_farm):
    """What a pull token's `GET /v1/cache-keys` is answered from: the keys of blobs, never of
    jobs (a pull token cannot read jobs by their full key either)."""
    from farm.server.blobs.service import cache_keys_starting_with
    from tests.unit.conftest import add_job

    model = add_model(embedded_farm)
    add_blob(embedded_farm, model, key(1))
    add_job(embedded_farm, model, 2)
    with embedded_farm.session() as session:
        for n in (1, 2):
            prefix = key(n)[:8]
            everything = cache_keys_starting_with(session, prefix, 6)
            blobs_only = cache_keys_starting_with(session, prefix, 6, jobs=False)
            assert everything == [key(n)]
            assert blobs_only == ([key(1)] if n == 1 else [])
