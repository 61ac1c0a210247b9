"""Submit (docs/architecture.md §6): per spec a hit (no job), the active job of the key (single
flight) or a new queued job, dispatched only after every row of the matrix is committed, on the
queue its target and model size route it to. The model is described and uploaded only when a
new job needs it."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence

import pytest
from sqlalchemy import select, update

from farm import toolchain
from farm.core import hashing
from farm.core.clock import now
from farm.core.errors import ChecksumMismatch, ModelMissing
from farm.core.identity import ModelInfo, ModelRef, file_version, key_for
from farm.core.spec import CompileSpec, Target, Toolchain
from farm.server.context import FarmContext
from farm.server.db.models import Blob, Job, Model
from farm.server.jobs import service
from farm.server.jobs.dispatch import StubDispatcher
from farm.server.jobs.runner import claim
from farm.server.jobs.service import MatrixSubmission, Submission
from farm.server.routing import queue_name
from farm.server.storage import model_storage_key
from tests.unit.conftest import (
    CPU,
    TOOLCHAIN,
    add_blob,
    add_job,
    close_farm,
    get_job,
    make_ref,
    open_farm,
    store_model,
)

CPU_B2 = CompileSpec.create("CPU", batch=2)
CPU_LATENCY = CompileSpec.create("CPU", performance_hint="latency")
NPU = CompileSpec.create("4000")
GiB = 2**30


@pytest.fixture
def ref(tmp_path) -> ModelRef:
    return make_ref(tmp_path / "model")


def never_describe() -> ModelInfo:
    raise AssertionError("describe_model was called, but no new job was needed")


def submit(
    farm: FarmContext,
    dispatcher,
    ref: ModelRef,
    specs: Sequence[CompileSpec],
    *,
    describe=None,
    upload: bool = True,
    **options,
) -> MatrixSubmission:
    with farm.session() as session:
        return service.submit_matrix(
            session,
            farm.store,
            farm.settings,
            dispatcher,
            ref.identity,
            specs,
            TOOLCHAIN,
            describe_model=describe or (lambda: ref.info),
            upload_from=ref if upload else None,
            **options,
        )


def outcomes(submitted: MatrixSubmission) -> list[tuple[CompileSpec, str, int | None]]:
    return [(spec, s.outcome, s.job_id) for spec, s in submitted.results]


def job_ids(farm: FarmContext) -> list[int]:
    with farm.session() as session:
        return list(session.scalars(select(Job.id).order_by(Job.id)))


def model_rows(farm: FarmContext) -> list[tuple[str, str, dict, int, str]]:
    with farm.session() as session:
        return [
            (m.digest, m.format, m.files, m.size_bytes, m.name)
            for m in session.scalars(select(Model).order_by(Model.id))
        ]


def stored_models(farm: FarmContext) -> list[str]:
    folder = farm.store.root / "models"
    return sorted(path.name for path in folder.iterdir()) if folder.exists() else []


def blob_for(farm: FarmContext, ref: ModelRef, spec: CompileSpec) -> str:
    """Record a blob for (ref, spec); returns its cache key."""
    with farm.session() as session:
        model_id = service.register_model(session, ref.info).id
        session.commit()
    cache_key = key_for(ref.identity, spec, TOOLCHAIN)
    add_blob(farm, model_id, cache_key)
    return cache_key


# --- hit, existing, queued -------------------------------------------------------------------


def test_a_hit_answers_hit_without_a_job_and_dispatches_nothing(embedded_farm, stub, ref):
    cache_key = blob_for(embedded_farm, ref, CPU)
    submitted = submit(embedded_farm, stub, ref, [CPU], describe=never_describe)
    assert submitted.results == [(CPU, Submission("hit", cache_key, None))]
    assert stub.sent == []
    assert job_ids(embedded_farm) == []


def test_a_second_submit_while_queued_answers_existing_with_the_same_job(embedded_farm, stub, ref):
    first = submit(embedded_farm, stub, ref, [CPU]).results[0][1]
    second = submit(embedded_farm, stub, ref, [CPU], describe=never_describe).results[0][1]
    assert second == Submission("existing", first.cache_key, first.job_id)
    assert stub.sent == [(first.job_id, "embedded")]
    assert job_ids(embedded_farm) == [first.job_id]


def test_a_submit_while_running_answers_existing_with_the_running_job(embedded_farm, stub, ref):
    first = submit(embedded_farm, stub, ref, [CPU]).results[0][1]
    with embedded_farm.session() as session:
        assert claim(session, first.job_id, "w1", 120)
    second = submit(embedded_farm, stub, ref, [CPU], describe=never_describe).results[0][1]
    assert second == Submission("existing", first.cache_key, first.job_id)
    assert stub.sent == [(first.job_id, "embedded")]


@pytest.mark.parametrize("state", ["failed", "cancelled"])
def test_a_key_whose_job_ended_without_a_blob_gets_a_new_job(embedded_farm, stub, ref, state):
    with embedded_farm.session() as session:
        model_id = service.register_model(session, ref.info).id
        session.commit()
    cache_key = key_for(ref.identity, CPU, TOOLCHAIN)
    old = add_job(embedded_farm, model_id, 0, cache_key=cache_key, state=state, finished_at=now())
    submitted = submit(embedded_farm, stub, ref, [CPU]).results[0][1]
    assert (submitted.outcome, submitted.cache_key) == ("queued", cache_key)
    assert submitted.job_id != old
    assert stub.sent == [(submitted.job_id, "embedded")]


def test_a_new_job_is_queued_sent_once_and_marked_sent(embedded_farm, stub, ref):
    before = now()
    submitted = submit(embedded_farm, stub, ref, [CPU], submitter="ci")
    [(spec, result)] = submitted.results
    cache_key = key_for(ref.identity, CPU, TOOLCHAIN)
    assert (spec, result.outcome, result.cache_key) == (CPU, "queued", cache_key)
    assert stub.sent == [(result.job_id, "embedded")]
    job = get_job(embedded_farm, result.job_id)
    assert (job.state, job.cache_key, job.queue, job.target) == (
        "queued",
        cache_key,
        "embedded",
        "CPU",
    )
    assert (job.spec, job.toolchain) == (CPU.canonical(), TOOLCHAIN.key_part(CPU.target))
    assert (job.submitter, job.submission_id) == ("ci", submitted.submission_id)
    assert (job.attempts, job.cancel_requested, job.worker) == (0, False, None)
    assert before <= job.created_at <= job.sent_at <= now()


def test_submit_alone_commits_the_job_without_sending_it(embedded_farm, ref):
    store_model(embedded_farm, ref)
    with embedded_farm.session() as session:
        result = service.submit(session, embedded_farm.store, ref.info, CPU, TOOLCHAIN)
    job = get_job(embedded_farm, result.job_id)
    assert (result.outcome, job.state, job.queue, job.sent_at) == (
        "queued",
        "queued",
        "embedded",
        None,
    )
    assert job.max_attempts == 3  # no max_attempts given: the column's default


def test_losing_the_insert_race_answers_the_winners_job(embedded_farm, ref, monkeypatch):
    store_model(embedded_farm, ref)
    with embedded_farm.session() as session:
        winner = service.submit(session, embedded_farm.store, ref.info, CPU, TOOLCHAIN)
    # The loser checked before the winner's insert committed: it saw no active job.
    monkeypatch.setattr(service, "known_outcome", lambda *args: None)
    with embedded_farm.session() as session:
        loser = service.submit(session, embedded_farm.store, ref.info, CPU, TOOLCHAIN)
    assert loser == Submission("existing", winner.cache_key, winner.job_id)
    assert job_ids(embedded_farm) == [winner.job_id]


# --- the matrix ------------------------------------------------------------------------------


class CommitChecker(StubDispatcher):
    """Records, at each send, the job ids another connection can see (committed rows)."""

    def __init__(self, farm: FarmContext) -> None:
        super().__init__()
        self.farm = farm
        self.visible: list[list[int]] = []

    def send(self, job_id: int, queue: str) -> None:
        self.visible.append(job_ids(self.farm))
        super().send(job_id, queue)


def test_a_matrix_answers_in_order_and_sends_only_new_jobs_after_all_are_committed(
    embedded_farm, ref
):
    hit_key = blob_for(embedded_farm, ref, CPU)
    earlier = submit(embedded_farm, StubDispatcher(), ref, [CPU_LATENCY])
    existing = earlier.results[0][1]
    checker = CommitChecker(embedded_farm)
    described = []

    def describe() -> ModelInfo:
        described.append(1)
        return ref.info

    submitted = submit(
        embedded_farm, checker, ref, [CPU, CPU_B2, CPU_LATENCY, NPU, CPU_B2], describe=describe
    )
    b2, npu = submitted.results[1][1].job_id, submitted.results[3][1].job_id
    assert outcomes(submitted) == [
        (CPU, "hit", None),
        (CPU_B2, "queued", b2),
        (CPU_LATENCY, "existing", existing.job_id),
        (NPU, "queued", npu),
        (CPU_B2, "existing", b2),  # the same spec twice: one job
    ]
    assert submitted.results[0][1].cache_key == hit_key
    assert len({s.cache_key for _, s in submitted.results}) == 4
    assert checker.sent == [(b2, "embedded"), (npu, "embedded")]
    all_jobs = [existing.job_id, b2, npu]
    assert checker.visible == [all_jobs, all_jobs]  # both rows committed before the first send
    assert described == [1]  # described once for two new jobs
    assert [get_job(embedded_farm, j).submission_id for j in all_jobs] == [
        earlier.submission_id,
        submitted.submission_id,
        submitted.submission_id,
    ]


def test_describe_model_is_not_called_when_every_spec_is_known(embedded_farm, stub, ref):
    blob_for(embedded_farm, ref, CPU)
    queued = submit(embedded_farm, stub, ref, [CPU_B2]).results[0][1]
    stub.sent.clear()
    submitted = submit(embedded_farm, stub, ref, [CPU, CPU_B2], describe=never_describe)
    assert [s.outcome for _, s in submitted.results] == ["hit", "existing"]
    assert submitted.results[1][1].job_id == queued.job_id
    assert stub.sent == []


# --- model files -----------------------------------------------------------------------------


def test_missing_model_files_raise_model_missing_naming_them(embedded_farm, stub, ref):
    digests = sorted(ref.identity.values())
    with pytest.raises(ModelMissing) as raised:
        submit(embedded_farm, stub, ref, [CPU], upload=False)
    assert raised.value.missing == digests
    assert (
        str(raised.value) == f"the farm lacks model files {', '.join(digests)}; upload them first"
    )
    assert raised.value.details == {"missing": digests}
    assert (job_ids(embedded_farm), model_rows(embedded_farm), stub.sent) == ([], [], [])


def test_model_missing_names_only_the_files_the_store_lacks(embedded_farm, stub, ref):
    xml = ref.identity["xml"]
    embedded_farm.store.put_file(model_storage_key(xml), ref.files["xml"], expected_sha256=xml)
    with pytest.raises(ModelMissing) as raised:
        submit(embedded_farm, stub, ref, [CPU], upload=False)
    assert raised.value.missing == [ref.identity["bin"]]


def test_with_upload_from_only_the_missing_files_are_uploaded(embedded_farm, stub, ref):
    xml = ref.identity["xml"]
    embedded_farm.store.put_file(model_storage_key(xml), ref.files["xml"], expected_sha256=xml)
    xml_inode = embedded_farm.store.local_path(model_storage_key(xml)).stat().st_ino
    submitted = submit(embedded_farm, stub, ref, [CPU])
    assert submitted.results[0][1].outcome == "queued"
    assert stored_models(embedded_farm) == sorted(ref.identity.values())
    assert embedded_farm.store.local_path(model_storage_key(xml)).stat().st_ino == xml_inode
    for role, path in ref.files.items():
        stored = embedded_farm.store.local_path(model_storage_key(ref.identity[role]))
        assert stored.read_bytes() == path.read_bytes()


def test_uploaded_model_files_are_checked_against_their_digests(embedded_farm, stub, ref):
    """A file that changed on disk after it was hashed (rewritten while `farm submit` ran) is
    refused: stored under its old digest, it would be compiled as a model it is not."""
    ref.files["bin"].write_bytes(b"weights rewritten after hashing")
    with pytest.raises(ChecksumMismatch) as raised:
        submit(embedded_farm, stub, ref, [CPU])
    bin_key = model_storage_key(ref.identity["bin"])
    assert str(raised.value).startswith(f"{bin_key}: the bytes have sha256 ")
    assert str(raised.value).endswith(f"expected {ref.identity['bin']}; nothing stored")
    assert ref.identity["bin"] not in stored_models(embedded_farm)
    assert (job_ids(embedded_farm), stub.sent) == ([], [])


def test_upload_model_files_uploads_every_file_unless_told_which(embedded_farm, ref):
    service.upload_model_files(embedded_farm.store, ref, [ref.identity["xml"]])
    assert stored_models(embedded_farm) == [ref.identity["xml"]]
    service.upload_model_files(embedded_farm.store, ref)
    assert stored_models(embedded_farm) == sorted(ref.identity.values())


def test_each_matrix_has_its_own_submission_id(embedded_farm, stub, ref):
    first = submit(embedded_farm, stub, ref, [CPU])
    second = submit(embedded_farm, stub, ref, [CPU_B2])
    assert re.fullmatch(r"[0-9a-f]{32}", first.submission_id)
    assert first.submission_id != second.submission_id
    assert get_job(embedded_farm, second.results[0][1].job_id).submission_id == (
        second.submission_id
    )


def test_a_hit_needs_no_model_files(embedded_farm, stub, ref):
    blob_for(embedded_farm, ref, CPU)
    submitted = submit(embedded_farm, stub, ref, [CPU], upload=False, describe=never_describe)
    assert submitted.results[0][1].outcome == "hit"
    assert stored_models(embedded_farm) == []


# --- models ----------------------------------------------------------------------------------


def test_an_ir_model_is_recorded_once_as_ir(embedded_farm, stub, ref):
    first = submit(embedded_farm, stub, ref, [CPU]).results[0][1]
    renamed = ModelRef(ref.files, ref.identity, "renamed.xml")
    second = submit(embedded_farm, stub, renamed, [CPU_B2]).results[0][1]
    digest = service.hashing.model_digest(ref.identity)
    assert model_rows(embedded_farm) == [
        (digest, "ir", ref.identity, ref.size_bytes, "model.xml")  # the first name stays
    ]
    assert (
        get_job(embedded_farm, first.job_id).model_id
        == get_job(embedded_farm, second.job_id).model_id
    )


def test_an_onnx_model_is_recorded_as_onnx(embedded_farm, stub, tmp_path):
    onnx = make_ref(tmp_path / "onnx", "net", onnx=True)
    submit(embedded_farm, stub, onnx, [CPU])
    digest = service.hashing.model_digest(onnx.identity)
    assert list(onnx.identity) == ["onnx"]
    assert model_rows(embedded_farm) == [
        (digest, "onnx", onnx.identity, onnx.size_bytes, "net.onnx")
    ]
    assert stored_models(embedded_farm) == [onnx.identity["onnx"]]


# --- routing and settings --------------------------------------------------------------------


def sized(ref: ModelRef, size_bytes: int):
    return lambda: ModelInfo(dict(ref.identity), ref.name, size_bytes)


def test_embedded_jobs_go_to_the_embedded_queue_whatever_their_size(embedded_farm, stub, ref):
    big = embedded_farm.settings.large_model_bytes + 1
    submitted = submit(embedded_farm, stub, ref, [CPU, NPU], describe=sized(ref, big))
    assert [queue for _, queue in stub.sent] == ["embedded", "embedded"]
    assert [get_job(embedded_farm, s.job_id).queue for _, s in submitted.results] == [
        "embedded",
        "embedded",
    ]


@pytest.mark.parametrize(
    ("spec", "size", "queue"),
    [
        (CPU, 10, queue_name("CPU", TOOLCHAIN.key_part(CPU.target))),
        # at the limit: not large
        (CPU, 2 * GiB, queue_name("CPU", TOOLCHAIN.key_part(CPU.target))),
        (CPU, 2 * GiB + 1, queue_name("CPU", TOOLCHAIN.key_part(CPU.target), large=True)),
        (NPU, 10, queue_name("4000", TOOLCHAIN.key_part(NPU.target))),
        (NPU, 2 * GiB + 1, queue_name("4000", TOOLCHAIN.key_part(NPU.target), large=True)),
    ],
)
def test_served_jobs_go_to_their_targets_queue_and_large_models_to_large(
    served_farm, stub, ref, spec, size, queue
):
    assert served_farm.settings.large_model_bytes == 2 * GiB
    submitted = submit(served_farm, stub, ref, [spec], describe=sized(ref, size))
    job_id = submitted.results[0][1].job_id
    assert stub.sent == [(job_id, queue)]
    assert get_job(served_farm, job_id).queue == queue


def test_route_follows_the_settings_limit(served_farm):
    settings = served_farm.settings.model_copy(update={"large_model_bytes": 100})
    cpu = Target.parse("CPU")
    part = TOOLCHAIN.key_part(cpu)
    assert service.route(settings, cpu, 100, TOOLCHAIN) == queue_name(cpu, part)
    assert service.route(settings, cpu, 101, TOOLCHAIN) == queue_name(cpu, part, large=True)


def test_a_toolchain_is_routed_to_its_own_queue(served_farm):
    cpu = Target.parse("CPU")
    other = Toolchain("2025.4.1", runtime_requirements="ov=2025.4.1")
    assert service.route(served_farm.settings, cpu, 1, TOOLCHAIN) != service.route(
        served_farm.settings, cpu, 1, other
    )
    assert service.route(served_farm.settings, cpu, 1, other).startswith("compile.cpu.2025.4.1.")


def test_max_attempts_from_the_settings_lands_on_the_row(tmp_path, monkeypatch, ref):
    farm = open_farm(tmp_path / "farm5", monkeypatch, max_attempts=5)
    try:
        submitted = submit(farm, StubDispatcher(), ref, [CPU])
        assert get_job(farm, submitted.results[0][1].job_id).max_attempts == 5
    finally:
        close_farm(farm)


# --- targets this host cannot compile --------------------------------------------------------


def test_an_uncompilable_target_is_unavailable_and_nothing_is_stored(embedded_farm, stub, ref):
    # The real probe: this host has no NPU compiler.
    submitted = submit(embedded_farm, stub, ref, [NPU], refuse_uncompilable=True)
    [(_, outcome)] = submitted.results
    assert (outcome.outcome, outcome.job_id) == ("unavailable", None)
    assert outcome.reason and outcome.reason.startswith("cannot compile for NPU.4000: ")
    assert (job_ids(embedded_farm), model_rows(embedded_farm)) == ([], [])
    assert (stored_models(embedded_farm), stub.sent) == ([], [])


def test_without_refusing_an_uncompilable_target_is_recorded(embedded_farm, stub, ref):
    submitted = submit(embedded_farm, stub, ref, [NPU])  # the embedded API: the job fails later
    assert stub.sent == [(submitted.results[0][1].job_id, "embedded")]


def fake_probe(target: Target) -> str | None:
    return f"cannot compile for {target}: no compiler" if target.is_npu else None


def test_a_matrix_compiles_what_this_host_can_and_says_why_not_the_rest(
    embedded_farm, stub, ref, monkeypatch
):
    monkeypatch.setattr(toolchain, "unavailable_reason", fake_probe)
    monkeypatch.setattr(toolchain, "host_toolchain", lambda target: TOOLCHAIN)
    submitted = submit(embedded_farm, stub, ref, [CPU, NPU], refuse_uncompilable=True)
    (_, cpu), (_, npu) = submitted.results
    assert cpu.outcome == "queued" and stub.sent == [(cpu.job_id, "embedded")]
    assert (npu.outcome, npu.job_id) == ("unavailable", None)
    assert npu.reason == "cannot compile for NPU.4000: no compiler"
    assert job_ids(embedded_farm) == [cpu.job_id]


def test_the_embedded_farm_refuses_a_toolchain_it_does_not_have(embedded_farm, stub, ref):
    """It would compile with its own toolchain and record the blob under another's key."""
    [(_, outcome)] = submit(embedded_farm, stub, ref, [CPU], refuse_uncompilable=True).results
    assert outcome.outcome == "unavailable"
    assert re.search(r"the submission asks for .*'x'.*--toolchain", outcome.reason or "")
    assert stub.sent == [] and job_ids(embedded_farm) == []


def test_an_unavailable_spec_carries_its_cache_key(embedded_farm, stub, ref, monkeypatch):
    monkeypatch.setattr(toolchain, "unavailable_reason", fake_probe)
    [(_, npu)] = submit(embedded_farm, stub, ref, [NPU], refuse_uncompilable=True).results
    assert npu == Submission(
        "unavailable",
        key_for(ref.identity, NPU, TOOLCHAIN),
        reason="cannot compile for NPU.4000: no compiler",
    )


def test_a_hit_stays_a_hit_on_a_farm_that_cannot_compile_its_target(
    embedded_farm, stub, ref, monkeypatch
):
    monkeypatch.setattr(toolchain, "unavailable_reason", fake_probe)
    cache_key = blob_for(embedded_farm, ref, NPU)
    submitted = submit(
        embedded_farm, stub, ref, [NPU], refuse_uncompilable=True, describe=never_describe
    )
    assert submitted.results == [(NPU, Submission("hit", cache_key))]


# --- rebuild ---------------------------------------------------------------------------------


def quarantine(farm: FarmContext, cache_key: str) -> None:
    with farm.session() as session:
        session.execute(
            update(Blob)
            .where(Blob.cache_key == cache_key)
            .values(quarantined_at=now(), quarantine_reason="failed on an edge")
        )
        session.commit()


def blob_keys(farm: FarmContext) -> list[str]:
    with farm.session() as session:
        return sorted(session.scalars(select(Blob.cache_key)))


def test_a_rebuild_retires_the_quarantined_blob_and_queues_a_new_job(embedded_farm, stub, ref):
    store_model(embedded_farm, ref)
    cache_key = blob_for(embedded_farm, ref, CPU)
    quarantine(embedded_farm, cache_key)
    [(_, outcome)] = submit(embedded_farm, stub, ref, [CPU], rebuild=True).results
    assert (outcome.outcome, outcome.cache_key) == ("queued", cache_key)
    assert blob_keys(embedded_farm) == []
    assert stub.sent == [(outcome.job_id, "embedded")]


def test_a_rebuild_keeps_the_quarantined_blobs_this_farm_cannot_replace(
    embedded_farm, stub, ref, monkeypatch
):
    """An embedded farm without an NPU compiler retires only the CPU blob: the NPU blob, even
    quarantined, stays until a farm that can compile it replaces it."""
    monkeypatch.setattr(toolchain, "unavailable_reason", fake_probe)
    monkeypatch.setattr(toolchain, "host_toolchain", lambda target: TOOLCHAIN)
    store_model(embedded_farm, ref)
    cpu_key, npu_key = blob_for(embedded_farm, ref, CPU), blob_for(embedded_farm, ref, NPU)
    quarantine(embedded_farm, cpu_key)
    quarantine(embedded_farm, npu_key)
    submitted = submit(embedded_farm, stub, ref, [CPU, NPU], rebuild=True, refuse_uncompilable=True)
    (_, cpu), (_, npu) = submitted.results
    assert (cpu.outcome, cpu.cache_key, npu) == ("queued", cpu_key, Submission("hit", npu_key))
    assert blob_keys(embedded_farm) == [npu_key]
    assert stub.sent == [(cpu.job_id, "embedded")]


def test_without_refusing_a_rebuild_retires_every_quarantined_blob_of_the_matrix(
    embedded_farm, stub, ref, monkeypatch
):
    monkeypatch.setattr(toolchain, "unavailable_reason", fake_probe)
    store_model(embedded_farm, ref)
    keys = [blob_for(embedded_farm, ref, spec) for spec in (CPU, NPU)]
    for cache_key in keys:
        quarantine(embedded_farm, cache_key)
    submitted = submit(embedded_farm, stub, ref, [CPU, NPU], rebuild=True)
    assert [(s.outcome, s.cache_key) for _, s in submitted.results] == [
        ("queued", keys[0]),
        ("queued", keys[1]),
    ]
    assert blob_keys(embedded_farm) == []


# --- reference inputs ------------------------------------------------------------------------

REFERENCE = b"reference inputs"


def store_reference(farm: FarmContext, folder) -> str:
    path = folder / "inputs.npz"
    path.write_bytes(REFERENCE)
    digest = hashlib.sha256(REFERENCE).hexdigest()
    farm.store.put_file(model_storage_key(digest), path, expected_sha256=digest)
    return digest


def test_a_new_job_records_the_reference_inputs(embedded_farm, stub, ref, tmp_path):
    digest = store_reference(embedded_farm, tmp_path)
    [(_, outcome)] = submit(embedded_farm, stub, ref, [CPU], reference_inputs=digest).results
    assert get_job(embedded_farm, outcome.job_id).reference_inputs == digest


def test_submit_records_the_reference_inputs(embedded_farm, ref, tmp_path):
    store_model(embedded_farm, ref)
    digest = store_reference(embedded_farm, tmp_path)
    with embedded_farm.session() as session:
        outcome = service.submit(
            session, embedded_farm.store, ref.info, CPU, TOOLCHAIN, reference_inputs=digest
        )
    assert get_job(embedded_farm, outcome.job_id).reference_inputs == digest


def test_reference_inputs_missing_from_the_store_raise_model_missing(embedded_farm, stub, ref):
    store_model(embedded_farm, ref)
    digest = hashlib.sha256(REFERENCE).hexdigest()
    with pytest.raises(ModelMissing) as raised:
        submit(embedded_farm, stub, ref, [CPU], upload=False, reference_inputs=digest)
    assert raised.value.missing == [digest]
    assert job_ids(embedded_farm) == []


def test_submit_alone_answers_a_hit(embedded_farm, ref):
    cache_key = blob_for(embedded_farm, ref, CPU)
    with embedded_farm.session() as session:
        outcome = service.submit(session, embedded_farm.store, ref.info, CPU, TOOLCHAIN)
    assert outcome == Submission("hit", cache_key)
    assert job_ids(embedded_farm) == []


# --- model files and rows --------------------------------------------------------------------


def versioned(ref: ModelRef) -> ModelRef:
    """`ref` as `ModelRef.from_path` makes it: each file's version taken when it was hashed."""
    versions = {role: file_version(path) for role, path in ref.files.items()}
    return ModelRef(ref.files, ref.identity, ref.name, versions)


def test_a_file_unchanged_since_it_was_hashed_is_copied_without_hashing_it_again(
    embedded_farm, ref, monkeypatch
):
    def no_rehash(*args, **kwargs):
        raise AssertionError("an unchanged file was read and hashed again")

    monkeypatch.setattr(embedded_farm.store, "put_file", no_rehash)
    service.upload_model_files(embedded_farm.store, versioned(ref))
    assert stored_models(embedded_farm) == sorted(ref.identity.values())
    for role, path in ref.files.items():
        stored = embedded_farm.store.root / model_storage_key(ref.identity[role])
        assert stored.read_bytes() == path.read_bytes()


def test_a_file_changed_since_it_was_hashed_is_checked_against_its_digest(embedded_farm, ref):
    model = versioned(ref)
    ref.files["bin"].write_bytes(b"weights rewritten after hashing")
    with pytest.raises(ChecksumMismatch):
        service.upload_model_files(embedded_farm.store, model)
    assert ref.identity["bin"] not in stored_models(embedded_farm)


def test_losing_the_model_insert_race_answers_the_winners_row(embedded_farm, ref):
    """The loser looked the digest up before the winner's row was committed (simulated: its
    lookup answers nothing), then its insert hits the unique digest."""
    other = make_ref(ref.files["xml"].parent.parent / "other", "other")
    with embedded_farm.session() as session:
        service.register_model(session, other.info)
        winner = service.register_model(session, ref.info)
        session.commit()
        winner_id = winner.id
    with embedded_farm.session() as session:
        real_scalar = session.scalar
        looked_up = []

        def lookup_before_the_winner(statement, *args, **kwargs):
            if not looked_up:
                looked_up.append(statement)
                return None
            return real_scalar(statement, *args, **kwargs)

        session.scalar = lookup_before_the_winner  # type: ignore[method-assign]
        loser = service.register_model(session, ref.info)
        assert looked_up and (loser.id, loser.name) == (winner_id, ref.name)
    assert [row[0] for row in model_rows(embedded_farm)] == [
        hashing.model_digest(other.identity),
        hashing.model_digest(ref.identity),
    ]
