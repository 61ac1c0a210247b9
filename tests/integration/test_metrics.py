"""`GET /metrics` on a served farm (API, PostgreSQL, Redis, SeaweedFS, a real worker): queued jobs
show as queue depth, a compile lands in the histogram, blob bytes and pulls are counted, and the
pull counter stays monotonic when `farm gc` deletes the pulls with their blob."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from farm.server.db.models import Job
from tests import models
from tests.integration.admin_farm import farm_cli, pull_and_report
from tests.integration.served import host_queue


def scrape(api, role: str | None = "pull") -> dict[tuple[str, tuple], float]:
    """Samples as {(name, sorted labels): value}."""
    headers = {"Authorization": f"Bearer {api.tokens[role]}"} if role else {}
    response = httpx.get(f"{api.url}/metrics", headers=headers, timeout=30)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def test_metrics_follow_a_job_from_queue_to_pull_to_gc(served, api, tmp_path):
    assert httpx.get(f"{api.url}/metrics").status_code == 401
    xml = models.save_ir(models.conv_net(), tmp_path / "conv" / "conv.xml")
    env = {
        "FARM_API_URL": api.url,
        "FARM_TOKEN": api.tokens["submit"],
        "FARM_CACHE_DIR": str(tmp_path / "cache"),
    }
    submitted = farm_cli(env, "submit", str(xml), "-d", "CPU")  # no worker yet: it waits
    key = submitted["cache_key"]

    queued = scrape(api)
    assert queued[("farm_queue_depth", (("queue", host_queue()), ("target", "CPU")))] == 1
    assert queued[("farm_jobs", (("state", "queued"), ("target", "CPU")))] == 1
    assert queued[("farm_jobs", (("state", "succeeded"), ("target", "CPU")))] == 0
    assert queued[("farm_workers_live", ())] == 0

    served.start_worker("w1")
    job = served.wait_job(submitted["job"]["id"])
    assert job.state == "succeeded"
    assert pull_and_report(api.url, api.tokens["pull"], key, "edge-1", tmp_path / "edge")["ok"]

    done = scrape(api)
    cpu = (("target", "CPU"),)
    assert ("farm_queue_depth", (("queue", host_queue()), ("target", "CPU"))) not in done
    assert done[("farm_jobs", (("state", "succeeded"), ("target", "CPU")))] == 1
    assert done[("farm_compile_seconds_count", cpu)] == 1
    assert done[("farm_compile_seconds_sum", cpu)] == job.compile_seconds
    fast = job.compile_seconds <= 1
    assert done[("farm_compile_seconds_bucket", (("le", "1.0"), *cpu))] == int(fast)
    assert done[("farm_compile_seconds_bucket", (("le", "+Inf"), *cpu))] == 1
    (blob,) = served.blobs()
    assert done[("farm_blobs", cpu)] == 1
    assert done[("farm_blob_bytes", cpu)] == blob.size_bytes
    assert done[("farm_pulls_total", (("ok", "true"), *cpu))] == 1
    assert done[("farm_workers_live", ())] == 1

    gc = farm_cli(served.env, "gc", "--unpulled-days", "0")  # unpulled since now: every blob
    assert [b["cache_key"] for b in gc["blobs"]] == [key]
    after_gc = scrape(api)
    assert ("farm_blob_bytes", cpu) not in after_gc
    assert after_gc[("farm_pulls_total", (("ok", "true"), *cpu))] == 1  # still counted
    assert after_gc[("farm_jobs", (("state", "succeeded"), ("target", "CPU")))] == 1
    assert served.count(Job) == 1
