"""The bounds one submitter or one edge meets (issue 25, item 2), on SQLite: queued jobs and
queues per submitter, stored bytes per submitter, verification reports per blob and per agent;
and a matrix submission that is all or nothing."""

from __future__ import annotations

import pytest
from sqlalchemy import func, select

from farm.core.errors import (
    StorageQuotaExceeded,
    TooManyQueuedJobs,
    TooManyQueues,
    TooManyReports,
)
from farm.core.spec import CompileSpec, Toolchain
from farm.server.blobs import verifications
from farm.server.db.models import Job, Verification
from farm.server.jobs import service
from farm.server.jobs.dispatch import StubDispatcher
from tests.unit.conftest import NOWHERE_BROKER as BROKER
from tests.unit.conftest import (
    TOOLCHAIN,
    add_blob,
    add_model,
    close_farm,
    key,
    make_ref,
    open_farm,
    store_model,
)
from tests.unit.test_rules_verify import report

SPECS = [CompileSpec.create("CPU", batch=n) for n in range(1, 9)]


@pytest.fixture
def limited(tmp_path, monkeypatch):
    def make(**settings):
        farm = open_farm(tmp_path / "farm", monkeypatch, broker_url=BROKER, **settings)
        opened.append(farm)
        return farm

    opened: list = []
    yield make
    for farm in opened:
        close_farm(farm)


def submit(farm, ref, specs, dispatcher, toolchain: Toolchain = TOOLCHAIN, who: str = "ci"):
    with farm.session() as session:
        return service.submit_matrix(
            session,
            farm.store,
            farm.settings,
            dispatcher,
            ref.identity,
            specs,
            toolchain,
            describe_model=lambda: ref.info,
            submitter=who,
        )


def jobs(farm) -> int:
    with farm.session() as session:
        return session.scalar(select(func.count()).select_from(Job)) or 0


def test_a_matrix_interrupted_half_way_records_none_of_its_jobs(limited, tmp_path, monkeypatch):
    farm = limited()
    ref = make_ref(tmp_path / "m")
    store_model(farm, ref)
    made: list[int] = []
    real_submit = service.submit

    def dies_at_the_fifth(*args, **kwargs):
        if len(made) == 4:
            raise KeyboardInterrupt("the API process was stopped mid-submission")
        made.append(1)
        return real_submit(*args, **kwargs)

    monkeypatch.setattr(service, "submit", dies_at_the_fifth)
    dispatcher = StubDispatcher()
    with pytest.raises(KeyboardInterrupt):
        submit(farm, ref, SPECS, dispatcher)
    assert len(made) == 4  # four rows were flushed...
    assert jobs(farm) == 0  # ...and none of them was committed
    assert dispatcher.sent == []

    monkeypatch.setattr(service, "submit", real_submit)
    done = submit(farm, ref, SPECS, dispatcher)
    assert jobs(farm) == len(SPECS) == len(dispatcher.sent)
    assert [outcome.outcome for _, outcome in done.results] == ["queued"] * len(SPECS)


def test_a_submitter_has_at_most_its_queued_jobs_and_others_are_not_counted(limited, tmp_path):
    farm = limited(max_queued_jobs_per_submitter=5)
    ref = make_ref(tmp_path / "m")
    store_model(farm, ref)
    dispatcher = StubDispatcher()
    submit(farm, ref, SPECS[:3], dispatcher)
    with pytest.raises(TooManyQueuedJobs, match="FARM_MAX_QUEUED_JOBS_PER_SUBMITTER=5") as error:
        submit(farm, ref, SPECS[3:6], dispatcher)  # 3 + 3 > 5: nothing of it is recorded
    assert error.value.details == {"setting": "FARM_MAX_QUEUED_JOBS_PER_SUBMITTER", "limit": 5}
    assert jobs(farm) == 3
    submit(farm, ref, SPECS[3:5], dispatcher)  # 3 + 2: exactly the limit
    submit(farm, ref, SPECS[5:8], dispatcher, who="another")  # its own count
    assert jobs(farm) == 8
    # A job that leaves the queue frees its place.
    with farm.session() as session:
        session.execute(Job.__table__.update().where(Job.submitter == "ci").values(state="running"))
        session.commit()
    submit(farm, ref, [CompileSpec.create("CPU", batch=9)], dispatcher)


def test_a_submitter_inventing_toolchains_cannot_open_queues_without_bound(limited, tmp_path):
    farm = limited(max_queues_per_submitter=2)
    ref = make_ref(tmp_path / "m")
    store_model(farm, ref)
    dispatcher = StubDispatcher()
    made_up = [Toolchain("2026.4.1", runtime_requirements=f"fake-{n}") for n in range(3)]
    submit(farm, ref, SPECS[:2], dispatcher, made_up[0])  # one queue, two jobs
    submit(farm, ref, SPECS[:1], dispatcher, made_up[1])  # a second queue
    with pytest.raises(TooManyQueues, match="FARM_MAX_QUEUES_PER_SUBMITTER=2"):
        submit(farm, ref, SPECS[:1], dispatcher, made_up[2])
    assert len({queue for _, queue in dispatcher.sent}) == 2
    submit(farm, ref, SPECS[2:3], dispatcher, made_up[1])  # an open queue: fine


def test_stored_bytes_count_uploads_models_and_blobs_against_the_quota(limited, tmp_path):
    farm = limited(max_stored_bytes_per_submitter=1000, model_grace_seconds=3600)
    with farm.session() as session:
        service.check_storage_quota(session, farm.settings, "ci", 1000)  # exactly the quota
        service.record_upload(session, "ci", "a" * 64, 600)
        with pytest.raises(StorageQuotaExceeded, match="FARM_MAX_STORED_BYTES_PER_SUBMITTER"):
            service.check_storage_quota(session, farm.settings, "ci", 401)
        service.check_storage_quota(session, farm.settings, "other", 1000)
    # A submitted model and the blobs of its succeeded jobs count too.
    model = add_model(farm)  # 10 bytes
    blob = add_blob(farm, model, key(1))
    with farm.session() as session:
        session.add(
            Job(
                cache_key=key(1),
                model_id=model,
                target="CPU",
                queue="compile.cpu",
                spec={},
                toolchain={},
                state="succeeded",
                submitter="ci",
                created_at=blob.created_at,
            )
        )
        session.commit()
        assert service.stored_bytes(session, "ci", 3600) == 600 + 10 + blob.size_bytes
        # Uploads older than the grace period are either collected or counted by their model.
        assert service.stored_bytes(session, "ci", 0) == 10 + blob.size_bytes


def test_a_submission_at_the_quota_is_refused_and_records_nothing(limited, tmp_path):
    farm = limited(max_stored_bytes_per_submitter=100)
    ref = make_ref(tmp_path / "m")
    store_model(farm, ref)
    with farm.session() as session:
        service.record_upload(session, "ci", "a" * 64, 100)
    with pytest.raises(StorageQuotaExceeded):
        submit(farm, ref, SPECS[:1], StubDispatcher())
    assert jobs(farm) == 0


def test_verification_reports_are_bounded_per_agent_and_per_blob(embedded_farm):
    farm = embedded_farm
    blob = add_blob(farm, add_model(farm), key(1))
    limits = verifications.ReportLimits(per_blob=5, per_agent=2)

    def send(agent: str, passed: bool = True):
        with farm.session() as session:
            return verifications.record_verification(
                session, key(1), blob.sha256, report(passed, agent_id=agent), True, limits
            )

    send("edge-1")
    send("edge-1")
    with pytest.raises(TooManyReports, match="FARM_MAX_REPORTS_PER_AGENT=2"):
        send("edge-1")
    send("edge-2")
    send("edge-3")
    send("edge-4")
    with pytest.raises(TooManyReports, match="FARM_MAX_REPORTS_PER_BLOB=5"):
        send("edge-invented-5")  # agent ids are the edge's own words: the blob bound holds
    # A failure still quarantines a blob its passes filled up...
    _, quarantined = send("edge-1", passed=False)
    assert quarantined
    # ...and once quarantined, further failures are bounded like passes.
    with pytest.raises(TooManyReports):
        send("edge-6", passed=False)
    with farm.session() as session:
        assert session.scalar(select(func.count()).select_from(Verification)) == 6


def test_a_matrix_that_loses_an_insert_race_runs_again_and_follows_the_winner(
    limited, tmp_path, monkeypatch
):
    farm = limited()
    ref = make_ref(tmp_path / "m")
    store_model(farm, ref)
    with farm.session() as session:
        winner = service.submit(session, farm.store, ref.info, SPECS[1], TOOLCHAIN)
    # The first pass checked before the winner's insert committed: it saw no active job.
    real_known = service.known_outcome
    passes: list[int] = []

    def stale_once(session, identity, spec, toolchain, recipe=()):
        if spec == SPECS[0]:
            passes.append(1)
        if len(passes) == 1:
            return None
        return real_known(session, identity, spec, toolchain, recipe)

    monkeypatch.setattr(service, "known_outcome", stale_once)
    dispatcher = StubDispatcher()
    done = submit(farm, ref, SPECS[:3], dispatcher)
    assert len(passes) == 2
    outcomes = [(outcome.outcome, outcome.job_id) for _, outcome in done.results]
    assert outcomes[1] == ("existing", winner.job_id)
    assert [o for o, _ in outcomes] == ["queued", "existing", "queued"]
    assert jobs(farm) == 3 and len(dispatcher.sent) == 2
