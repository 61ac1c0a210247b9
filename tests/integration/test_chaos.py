"""Chaos: a real worker pool takes a few hundred small jobs from several submitters while its
workers are killed with SIGKILL at random and its broker (a private Redis with AOF) and database
(a private PostgreSQL, crashed with `pg_ctl -m immediate`) are restarted under it.

At the end every job has ended (succeeded, or failed with a reason), no submission was lost,
there is exactly one blob per cache key, and every stored blob's sha256 is what its row says.
The figures are printed and recorded in SECURITY.md ("Figures").
"""

from __future__ import annotations

import contextlib
import json
import random
import signal
import threading
import time

import pytest
from sqlalchemy import func, select

from farm.core import hashing
from farm.core.identity import ModelRef
from farm.core.spec import CompileSpec
from farm.core.vocabulary import FINAL_STATES, JobState
from farm.server.db.models import Blob, Job
from farm.server.jobs.dispatch import CeleryDispatcher
from farm.server.jobs.reconcile import reconcile
from tests import models
from tests.integration.faults import PrivatePostgres, PrivateRedis
from tests.integration.served import ServedFarm, submit_ref, wait_until

pytestmark = pytest.mark.slow

SUBMITTERS = ("alice", "bob", "carol")
MODELS_PER_SUBMITTER = 65
"""Each submitter's own models; each also resubmits some of another's (single flight)."""
SHARED_PER_SUBMITTER = 15
WORKERS = ("w1", "w2")
CHAOS_SECONDS = 60
SEED = 20261124


@pytest.fixture
def cluster():
    postgres = PrivatePostgres()
    postgres.start()
    yield postgres
    postgres.remove()


def _retrying(action, stop: threading.Event, what: str):
    """Run `action` until it succeeds: the database or broker may be restarting."""
    while not stop.is_set():
        try:
            return action()
        except Exception:
            time.sleep(0.5)
    raise AssertionError(f"gave up on {what}")


def test_a_worker_pool_under_kills_and_restarts_loses_nothing(tmp_path, served_env, cluster):
    broker = PrivateRedis(tmp_path)
    broker.start()
    env = {
        **served_env,
        "FARM_DATABASE_URL": cluster.create_database(),
        "FARM_BROKER_URL": broker.url,
        "FARM_LEASE_SECONDS": "6",
        "FARM_RESEND_AFTER_SECONDS": "10",
        "FARM_WORKER_HEARTBEAT_SECONDS": "2",
        "FARM_MAX_ATTEMPTS": "6",
        # What is tested here is loss and duplication under kills; a reference run per job
        # (tests/integration/test_verify.py) would only double the compile time of 195 jobs.
        "FARM_REFERENCE_OUTPUTS": "false",
    }
    farm = ServedFarm(env, tmp_path)
    rng = random.Random(SEED)
    figures = {"kills": 0, "redis_restarts": 0, "postgres_restarts": 0, "worker_restarts": 0}
    stop, done = threading.Event(), threading.Event()
    workers_lock = threading.Lock()
    try:
        refs = [
            ModelRef.from_path(
                models.save_ir(
                    models.conv_net(seed=n, channels=4), tmp_path / "m" / f"{n}" / "m.xml"
                )
            )
            for n in range(len(SUBMITTERS) * MODELS_PER_SUBMITTER)
        ]
        for name in WORKERS:
            farm.start_worker(name)
        spec = CompileSpec.create("CPU")
        submissions: list[tuple[str, str, int | None]] = []  # submitter, cache key, job id
        record = threading.Lock()

        def submitter(index: int, name: str) -> None:
            own = refs[index * MODELS_PER_SUBMITTER : (index + 1) * MODELS_PER_SUBMITTER]
            other = (index + 1) % len(SUBMITTERS)
            shared = refs[other * MODELS_PER_SUBMITTER :][:SHARED_PER_SUBMITTER]
            for ref in [*own, *shared]:
                outcome = _retrying(
                    lambda ref=ref: submit_ref(
                        farm, ref, spec, dispatcher=dispatcher, submitter=name
                    ),
                    stop,
                    f"{name}'s submission",
                )
                with record:
                    submissions.append((name, outcome.cache_key, outcome.job_id))

        def reconciler() -> None:
            while not done.is_set():
                with contextlib.suppress(Exception), farm.sessions() as session:
                    reconcile(session, farm.store, farm.settings, dispatcher)
                done.wait(2)

        def supervisor() -> None:
            """What systemd or `restart: unless-stopped` does: start a worker that died."""
            while not done.is_set():
                with workers_lock:
                    for name in WORKERS:
                        process = farm.workers.get(name)
                        if process is None or process.poll() is not None:
                            farm.workers.pop(name, None)
                            farm.start_worker(name, wait=False)
                            figures["worker_restarts"] += 1
                done.wait(1)

        dispatcher = CeleryDispatcher(farm.settings)
        threads = [
            threading.Thread(target=submitter, args=(i, name), daemon=True)
            for i, name in enumerate(SUBMITTERS)
        ]
        threads += [
            threading.Thread(target=reconciler, daemon=True),
            threading.Thread(target=supervisor, daemon=True),
        ]
        for thread in threads:
            thread.start()

        deadline = time.monotonic() + CHAOS_SECONDS
        while time.monotonic() < deadline:
            time.sleep(rng.uniform(3, 7))
            action = rng.choice(["kill", "kill", "kill", "redis", "postgres"])
            if action == "kill":
                with workers_lock:
                    name = rng.choice([n for n in WORKERS if n in farm.workers])
                    farm.kill_worker(name, signal.SIGKILL)  # the worker, pool and compile
                figures["kills"] += 1
            elif action == "redis":
                broker.stop()
                time.sleep(1)
                broker.start()  # same port, same AOF
                figures["redis_restarts"] += 1
            else:
                cluster.stop()  # a crash: nothing flushed
                time.sleep(1)
                cluster.start()
                figures["postgres_restarts"] += 1
        for thread in threads[: len(SUBMITTERS)]:
            thread.join(timeout=300)

        def all_ended() -> bool:
            with contextlib.suppress(Exception), farm.sessions() as session:
                unfinished = session.scalar(
                    select(func.count()).select_from(Job).where(Job.state.not_in(FINAL_STATES))
                )
                return unfinished == 0
            return False

        try:
            wait_until(all_ended, 240, "every job to end")
        except AssertionError:
            with farm.sessions() as session:
                states = dict(
                    session.execute(select(Job.state, func.count()).group_by(Job.state)).all()
                )
            tails = {name: farm.worker_log(name)[-3000:] for name in WORKERS}
            raise AssertionError(
                f"jobs by state {states}; figures {figures}; logs {tails}"
            ) from None
        done.set()
        for thread in threads[len(SUBMITTERS) :]:
            thread.join(timeout=30)

        with farm.sessions() as session:
            jobs = list(session.scalars(select(Job)))
            blobs = list(session.scalars(select(Blob)))
        by_key = {job.cache_key: job for job in jobs}
        submitted_keys = {key for _, key, _ in submissions}
        expected = len(SUBMITTERS) * (MODELS_PER_SUBMITTER + SHARED_PER_SUBMITTER)
        figures.update(
            submissions=len(submissions),
            jobs=len(jobs),
            succeeded=sum(job.state == JobState.SUCCEEDED for job in jobs),
            failed=sum(job.state == JobState.FAILED for job in jobs),
            retried=sum(job.attempts > 1 for job in jobs),
            lost=len(submitted_keys - set(by_key)),
            duplicates=len(blobs) - len({blob.cache_key for blob in blobs}),
            blobs=len(blobs),
        )
        print("chaos figures:", json.dumps(figures, sort_keys=True))

        assert len(submissions) == expected
        assert figures["lost"] == 0, "a submission has no job"
        assert len(submitted_keys) == len(refs) == len(jobs)  # one job per key: single flight
        assert all(job.state in FINAL_STATES for job in jobs)
        assert all(job.error for job in jobs if job.state == JobState.FAILED)
        assert figures["duplicates"] == 0
        succeeded = {job.cache_key for job in jobs if job.state == JobState.SUCCEEDED}
        assert {blob.cache_key for blob in blobs} == succeeded  # one blob per succeeded key
        for blob in blobs:  # the stored bytes themselves, hashed again
            with farm.store.open_read(blob.storage_key) as stored:
                assert hashing.sha256_stream(stored) == blob.sha256
        assert figures["kills"] >= 3 and figures["succeeded"] >= 0.9 * len(jobs)
    finally:
        done.set()
        stop.set()
        with workers_lock:
            farm.stop()
        broker.stop()
