"""Fault injection on the served farm: a restarted broker, an unreachable store.

Each test starts its own instance of the service it breaks, on another loopback port, and
records what was lost (nothing) and what was duplicated (nothing, in the database).
"""

from __future__ import annotations

from urllib.parse import urlparse

import pytest

from farm.server.db.models import Blob, Job
from tests import models
from tests.conftest import S3_ENDPOINT_URL
from tests.integration.faults import PrivateRedis, TcpProxy
from tests.integration.served import ServedFarm, wait_until
from tests.integration.test_served import submit_direct


@pytest.fixture
def private_redis(tmp_path):
    redis = PrivateRedis(tmp_path)
    redis.start()
    yield redis
    redis.stop()


def test_jobs_queued_survive_a_redis_restart(tmp_path, served_env, private_redis):
    farm = ServedFarm({**served_env, "FARM_BROKER_URL": private_redis.url}, tmp_path)
    try:
        xmls = [
            models.save_ir(models.conv_net(seed=s), tmp_path / f"m{s}" / "m.xml") for s in range(3)
        ]
        jobs = [submit_direct(farm, xml).job_id for xml in xmls]
        private_redis.stop()  # the messages are only in Redis's AOF now
        private_redis.start()
        farm.start_worker("w1")
        for job_id in jobs:
            assert farm.wait_job(job_id).state == "succeeded"
        assert farm.count(Job) == 3 and farm.count(Blob) == 3  # nothing lost, nothing twice
    finally:
        farm.stop()


def test_s3_unreachable_during_a_job_is_retried_and_never_leaves_a_row_without_object(
    tmp_path, served_env
):
    proxy = TcpProxy(urlparse(S3_ENDPOINT_URL).port)
    proxy.start()
    farm = ServedFarm(served_env, tmp_path)
    try:
        farm.start_worker("w1", env={"FARM_S3_ENDPOINT_URL": f"http://127.0.0.1:{proxy.port}"})
        proxy.cut()  # the worker's S3 is gone; the submitter's is not
        xml = models.save_ir(models.conv_net(), tmp_path / "m" / "m.xml")
        job_id = submit_direct(farm, xml).job_id
        wait_until(lambda: "Retry in" in farm.worker_log("w1"), 90, "a retry")
        assert farm.job(job_id).state in ("queued", "running")  # not failed: retried
        assert farm.count(Blob) == 0
        proxy.start()
        job = farm.wait_job(job_id, timeout=120)
        # The claim that met the outage counts as an attempt (FARM_MAX_ATTEMPTS, 3 here).
        assert job.state == "succeeded" and job.attempts in (2, 3)
        (blob,) = farm.blobs()
        assert farm.store.stat(blob.storage_key).sha256 == blob.sha256
    finally:
        proxy.cut()
        farm.stop()
