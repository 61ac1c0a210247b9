"""The counters behind `/metrics` (migration 0022's triggers) against COUNT(*) of the tables,
after concurrent writers on PostgreSQL (pull reports through the real API, job transitions,
gc-like deletes, quarantines and verifications, some rolled back), and again after the API
restarts. SQLite: the same counters after single-writer changes."""

from __future__ import annotations

import random
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import case, delete, func, select, update

from farm.core.clock import now
from farm.core.config import Settings
from farm.server.api.metrics import COMPILE_SECONDS_BUCKETS, read_counts
from farm.server.context import FarmContext
from farm.server.db.models import Blob, BlobDeletion, Job, MetricCount, Pull, Verification
from farm.server.db.session import upgrade_database
from farm.server.tokens import create_token
from tests.integration.served import ApiServer
from tests.unit.conftest import CPU, TOOLCHAIN, add_model, key, sha256

TARGETS = ("CPU", "NPU.4000")


def _blob(model: int, n: int, target: str) -> dict:
    cache_key = key(f"b{n}")
    return dict(
        cache_key=cache_key,
        model_id=model,
        target=target,
        spec=CPU.canonical(),
        toolchain=TOOLCHAIN.as_dict(),
        openvino_version=TOOLCHAIN.openvino,
        storage_key=f"blobs/{cache_key}.blob",
        size_bytes=1000 + n,
        sha256=sha256(cache_key.encode()),
        payload_offset=0,
        weightless=False,
        created_at=now() - timedelta(seconds=n),
    )


def _job(model: int, n: int, target: str, state: str = "queued") -> dict:
    return dict(
        cache_key=key(f"j{n}"),
        model_id=model,
        target=target,
        queue=f"compile.{target.lower()}",
        spec=CPU.canonical(),
        toolchain=TOOLCHAIN.as_dict(),
        state=state,
        created_at=now(),
    )


def expected(farm: FarmContext) -> dict[tuple, float]:
    """The metrics as the tables count them (what /metrics computed before migration 0022)."""
    want: dict[tuple, float] = defaultdict(float)
    with farm.session() as session:
        for state, target, n in session.execute(
            select(Job.state, Job.target, func.count()).group_by(Job.state, Job.target)
        ):
            want[("farm_jobs", (("state", state), ("target", target)))] = n
        for queue, target, n in session.execute(
            select(Job.queue, Job.target, func.count())
            .where(Job.state == "queued")
            .group_by(Job.queue, Job.target)
        ):
            want[("farm_queue_depth", (("queue", queue), ("target", target)))] = n
        bounds = [
            func.sum(case((Job.compile_seconds <= b, 1), else_=0)) for b in COMPILE_SECONDS_BUCKETS
        ]
        for target, n, total, *cumulative in session.execute(
            select(Job.target, func.count(), func.sum(Job.compile_seconds), *bounds)
            .where(Job.state == "succeeded", Job.compile_seconds.is_not(None))
            .group_by(Job.target)
        ):
            t = (("target", target),)
            want[("farm_compile_seconds_count", t)] = n
            want[("farm_compile_seconds_sum", t)] = total
            want[("farm_compile_seconds_bucket", (("le", "+Inf"), *t))] = n
            for bound, c in zip(COMPILE_SECONDS_BUCKETS, cumulative, strict=True):
                want[("farm_compile_seconds_bucket", (("le", str(float(bound))), *t))] = c
        for target, n, size in session.execute(
            select(Blob.target, func.count(), func.sum(Blob.size_bytes)).group_by(Blob.target)
        ):
            want[("farm_blobs", (("target", target),))] = n
            want[("farm_blob_bytes", (("target", target),))] = size
        for target, ok, n in session.execute(
            select(Blob.target, Pull.ok, func.count())
            .join(Blob, Blob.id == Pull.blob_id)
            .group_by(Blob.target, Pull.ok)
        ):
            want[("farm_pulls_total", (("ok", str(ok).lower()), ("target", target)))] += n
        for target, pulls, failed in session.execute(
            select(
                BlobDeletion.target,
                func.sum(BlobDeletion.pulls),
                func.sum(BlobDeletion.failed_pulls),
            ).group_by(BlobDeletion.target)
        ):
            want[("farm_pulls_total", (("ok", "true"), ("target", target)))] += pulls - failed
            want[("farm_pulls_total", (("ok", "false"), ("target", target)))] += failed
        for target, passed, n in session.execute(
            select(Verification.target, Verification.passed, func.count()).group_by(
                Verification.target, Verification.passed
            )
        ):
            result = "passed" if passed else "failed"
            want[("farm_verifications_total", (("result", result), ("target", target)))] = n
        for target, n in session.execute(
            select(Blob.target, func.count())
            .where(Blob.quarantined_at.is_not(None))
            .group_by(Blob.target)
        ):
            want[("farm_blobs_quarantined", (("target", target),))] = n
    return {k: v for k, v in want.items() if v}


def scraped(url: str, token: str) -> dict[tuple, float]:
    response = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {token}"})
    assert response.status_code == 200, response.text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
        if sample.value and sample.name != "farm_workers_live"
    }


def _same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert got[name] == pytest.approx(value), name


def test_counters_match_the_tables_after_concurrent_writers_and_a_restart(
    tmp_path, postgres_url, redis_url
):
    home = tmp_path / "home"
    env = {
        "FARM_HOME": str(home),
        "FARM_DATABASE_URL": postgres_url,
        "FARM_STORAGE_URL": str(tmp_path / "store"),
        "FARM_BROKER_URL": redis_url,
        "FARM_METRICS_CACHE_SECONDS": "0",
    }
    upgrade_database(postgres_url)
    farm = FarmContext.open(Settings(home=home, database_url=postgres_url))
    model = add_model(farm)
    with farm.session() as session:
        session.execute(
            Blob.__table__.insert(), [_blob(model, n, TARGETS[n % 2]) for n in range(40)]
        )
        session.execute(Job.__table__.insert(), [_job(model, n, TARGETS[n % 2]) for n in range(40)])
        token = create_token(session, "edge", "pull")
        session.commit()
        keys = list(session.scalars(select(Blob.cache_key)))
    server = ApiServer(env, tmp_path / "api.log").start()
    errors: list[BaseException] = []

    def guarded(work):
        def run(n: int) -> None:
            try:
                work(n)
            except BaseException as error:  # reported below, with the thread's work
                errors.append(error)

        return run

    @guarded
    def report_pulls(n: int) -> None:
        rng = random.Random(n)
        with httpx.Client(base_url=server.url) as client:
            for _ in range(60):
                response = client.post(
                    f"/v1/blobs/{rng.choice(keys)}/pulls",
                    headers={"Authorization": f"Bearer {token}"},
                    json={"agent_id": f"edge-{n}", "ok": rng.random() < 0.8, "import_seconds": 1},
                )
                assert response.status_code in (200, 201, 404, 409), response.text

    @guarded
    def move_jobs(n: int) -> None:
        rng = random.Random(n)
        for step in range(40):
            with farm.session() as session:
                job = session.scalar(
                    select(Job).where(Job.state.in_(("queued", "running"))).limit(1).offset(n)
                )
                if job is None:
                    session.execute(Job.__table__.insert(), [_job(model, 1000 * n + step, "CPU")])
                elif job.state == "queued":
                    job.state = "running"
                else:
                    job.state = rng.choice(("succeeded", "failed", "cancelled"))
                    job.compile_seconds = rng.choice((0.5, 3.0, 70.0, 5000.0, 20000.0))
                if rng.random() < 0.2:
                    session.rollback()  # a rollback takes its counts with it
                else:
                    session.commit()

    @guarded
    def collect_garbage(n: int) -> None:
        rng = random.Random(n)
        for _ in range(8):
            with farm.session() as session:
                blob = session.scalar(
                    select(Blob)
                    .order_by(Blob.created_at)
                    .limit(1)
                    .with_for_update(skip_locked=True, of=Blob)
                )
                if blob is None:
                    return
                pulls, failed = session.execute(
                    select(func.count(), func.sum(case((Pull.ok, 0), else_=1))).where(
                        Pull.blob_id == blob.id
                    )
                ).one()
                session.execute(delete(Pull).where(Pull.blob_id == blob.id))
                session.add(
                    BlobDeletion(
                        cache_key=blob.cache_key,
                        storage_key=blob.storage_key,
                        target=blob.target,
                        size_bytes=blob.size_bytes,
                        sha256=blob.sha256,
                        blob_created_at=blob.created_at,
                        pulls=pulls,
                        failed_pulls=failed or 0,
                        reason="test",
                        deleted_at=now(),
                        state="pending",
                    )
                )
                session.delete(blob)
                session.commit()
                if rng.random() < 0.5:
                    session.execute(
                        Blob.__table__.insert(), [_blob(model, 500 + rng.randrange(10**6), "CPU")]
                    )
                    session.commit()

    @guarded
    def quarantine_and_verify(n: int) -> None:
        rng = random.Random(n)
        for _ in range(30):
            with farm.session() as session:
                blob = session.scalar(  # locked: gc may not delete it under the verification
                    select(Blob).order_by(func.random()).limit(1).with_for_update(of=Blob)
                )
                if blob is None:
                    return
                session.execute(
                    update(Blob)
                    .where(Blob.id == blob.id)
                    .values(
                        quarantined_at=None if blob.quarantined_at else now(),
                        quarantine_reason=None if blob.quarantined_at else "failed on an edge",
                    )
                )
                session.add(
                    Verification(
                        blob_id=blob.id,
                        cache_key=blob.cache_key,
                        blob_sha256=blob.sha256,
                        target=blob.target,
                        agent_id="edge",
                        device_name="CPU",
                        openvino_version="2026.4.1",
                        passed=rng.random() < 0.7,
                        tolerance={},
                        outputs=[],
                        runs=1,
                        created_at=now(),
                    )
                )
                session.commit()

    try:
        work = [report_pulls] * 4 + [move_jobs] * 2 + [collect_garbage, quarantine_and_verify]
        with ThreadPoolExecutor(len(work)) as pool:
            list(pool.map(lambda pair: pair[1](pair[0]), enumerate(work)))
        assert not errors, errors
        want = expected(farm)
        assert want[("farm_pulls_total", (("ok", "true"), ("target", "CPU")))] > 0
        _same(scraped(server.url, token), want)
        server.stop()
        server.start()  # counters live in the database: a restart changes nothing
        _same(scraped(server.url, token), want)
        with farm.session() as session:  # the reads folded the deltas: one row per label set
            rows = session.scalar(select(func.count()).select_from(MetricCount))
            assert rows == len(read_counts(session))
    finally:
        server.stop()
        farm.sessions.kw["bind"].dispose()


def test_sqlite_counters_follow_single_writer_changes(tmp_path):
    farm = FarmContext.open(Settings(home=tmp_path / "home"))
    model = add_model(farm)
    with farm.session() as session:
        session.execute(
            Blob.__table__.insert(), [_blob(model, n, TARGETS[n % 2]) for n in range(6)]
        )
        session.execute(Job.__table__.insert(), [_job(model, n, "CPU") for n in range(5)])
        session.commit()
        blob = session.scalars(select(Blob)).first()
        session.add(
            Pull(blob_id=blob.id, cache_key=blob.cache_key, agent_id="e", ok=True, created_at=now())
        )
        session.execute(
            update(Job).where(Job.id <= 2).values(state="succeeded", compile_seconds=4.0)
        )
        session.execute(delete(Blob).where(Blob.id > 4))
        session.commit()
        counts = read_counts(session)
    assert counts[("jobs", "queued", "CPU", "compile.cpu")] == (3, 0.0)
    assert counts[("jobs", "succeeded", "CPU", "compile.cpu")] == (2, 0.0)
    assert counts[("compile_seconds", "CPU", "5.0", "")] == (2, 8.0)
    assert counts[("pulls", blob.target, "true", "")] == (1, 0.0)
    blobs = sum(n for (family, *_), (n, _) in counts.items() if family == "blobs")
    assert blobs == 4
    farm.sessions.kw["bind"].dispose()


def test_a_batch_connection_that_dies_is_replaced(tmp_path, postgres_url):
    """The resolve and report batches keep one connection (no pool ping per batch); when the
    database drops it, that batch fails as unavailable and the next opens a new one."""
    from sqlalchemy import text

    from farm.core.errors import DatabaseUnavailable
    from farm.server.api.batches import KeptSessions

    upgrade_database(postgres_url)
    farm = FarmContext.open(Settings(home=tmp_path / "home", database_url=postgres_url))
    sessions = KeptSessions(farm)
    try:
        with sessions() as session:
            first = session.scalar(text("SELECT pg_backend_pid()"))
        with sessions() as session:  # the same connection, in autocommit
            assert session.scalar(text("SELECT pg_backend_pid()")) == first
            assert session.scalar(text("SHOW transaction_isolation")) == "read committed"
            assert session.connection().get_execution_options()["isolation_level"] == "AUTOCOMMIT"
        with farm.session() as other:
            other.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": first})
        with pytest.raises(DatabaseUnavailable), sessions() as session:
            session.scalar(text("SELECT 1"))
        with sessions() as session:
            assert session.scalar(text("SELECT pg_backend_pid()")) != first
        sessions.close()
        assert sessions.kept == []
    finally:
        sessions.close()
        farm.sessions.kw["bind"].dispose()
