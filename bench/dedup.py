"""Dedup storm (issue 7, target 2): 200 concurrent identical submits through the API, and the
latency of a cache-hit submit.

Through the served stack (`farm api` + PostgreSQL + Redis + one `farm worker` + SeaweedFS).
Each run takes a new small model (a new cache key), uploads its files, then fires 200
identical `POST /v1/submissions` at once (threads released by one barrier). Target: exactly
one job and one compile per storm. Then, with the blob recorded, cache-hit submits one after
another on a kept-alive connection: p50 <= 20 ms and p99 <= 100 ms. The baseline is the
same server's `GET /healthz` (the HTTP floor), measured in the same rounds.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from sqlalchemy import func, select

from farm.client import FarmClient
from farm.core.identity import ModelRef
from farm.core.spec import CompileSpec
from farm.server.db.models import Blob, Job
from farm.toolchain import host_toolchain

from .common import (
    RUNS,
    build_small_models,
    comparison,
    log,
    percentile,
    scaled,
    scratch,
    stats,
    target,
    write_result,
)
from .stack import served_stack

NAME = "dedup"
STORM = scaled(200, 10)
HITS_PER_ROUND = scaled(200, 10)


def submission_body(ref: ModelRef) -> dict:
    spec = CompileSpec.create("CPU")
    toolchain = host_toolchain(spec.target)
    return {
        "model": ref.identity,
        "model_name": ref.name,
        "specs": [{"target": spec.target.name, **spec.canonical()}],
        "toolchain": {
            "openvino": toolchain.openvino,
            "runtime_requirements": toolchain.runtime_requirements,
        },
    }


def storm(url: str, token: str, body: dict) -> tuple[list[str], list[float]]:
    """STORM identical submits at once, each on a new connection of its own (as many CLIs
    would); latency includes connecting."""
    barrier = threading.Barrier(STORM)
    headers = {"Authorization": f"Bearer {token}"}

    def one(_: int) -> tuple[str, float]:
        with httpx.Client(base_url=url, headers=headers, timeout=120) as client:
            # Not connected ahead: the server drops connections idle for 5 s, and 200
            # threads on 2 cores can take that long to reach the barrier.
            barrier.wait()
            started = time.perf_counter()
            response = client.post("/v1/submissions", json=body)
            elapsed = time.perf_counter() - started
        response.raise_for_status()
        return response.json()["results"][0]["outcome"], elapsed

    with ThreadPoolExecutor(STORM) as pool:
        answers = list(pool.map(one, range(STORM)))
    return [outcome for outcome, _ in answers], [elapsed for _, elapsed in answers]


def sequential(client: httpx.Client, method: str, path: str, count: int, **kwargs) -> list[float]:
    latencies = []
    for _ in range(count):
        started = time.perf_counter()
        response = client.request(method, path, **kwargs)
        latencies.append(time.perf_counter() - started)
        response.raise_for_status()
    return latencies


def main() -> dict:
    with scratch(NAME) as root:
        models = build_small_models(root / "models", RUNS)
        with served_stack(root) as stack:
            stack.farm.start_worker("w1")
            return measure(stack, models)


def measure(stack, models) -> dict:
    token = stack.tokens["submit"]
    storms = []
    hit_rounds = []
    with FarmClient(stack.api.url, token) as farm_client:
        for run, xml in enumerate(models):
            log(f"run {run + 1}/{len(models)}: storm of {STORM}")
            ref = ModelRef.from_path(xml)
            for role, sha in ref.identity.items():
                farm_client.upload(sha, ref.files[role])
            body = submission_body(ref)
            outcomes, latencies = storm(stack.api.url, token, body)
            key = farm_client.submit(**_args(body))["results"][0]["cache_key"]
            jobs = stack.farm.count(Job, Job.cache_key == key)
            job_id = farm_client.jobs(cache_key=key)[0]["id"]
            job = stack.farm.wait_job(job_id, timeout=300)
            storms.append(
                {
                    "outcomes": {o: outcomes.count(o) for o in sorted(set(outcomes))},
                    "jobs": jobs,
                    "job_state": job.state,
                    "attempts": job.attempts,
                    "blobs": stack.farm.count(Blob, Blob.cache_key == key),
                    "latency_ms": {
                        "p50": percentile(latencies, 50) * 1000,
                        "p99": percentile(latencies, 99) * 1000,
                        "max": max(latencies) * 1000,
                    },
                }
            )
            log(f"  {storms[-1]['outcomes']}, jobs {jobs}, job {job.state}")

            log(f"  {HITS_PER_ROUND} cache-hit submits, one after another")
            http = farm_client.http
            sequential(http, "POST", "/v1/submissions", 20, json=body)  # warm
            hits = sequential(http, "POST", "/v1/submissions", HITS_PER_ROUND, json=body)
            health = sequential(http, "GET", "/healthz", HITS_PER_ROUND)
            resolve = sequential(http, "GET", f"/v1/blobs/{key}", HITS_PER_ROUND)
            answer = http.post("/v1/submissions", json=body).json()["results"][0]
            assert answer["outcome"] == "hit", answer
            hit_rounds.append(
                {
                    name: {
                        "p50": percentile(values, 50) * 1000,
                        "p99": percentile(values, 99) * 1000,
                    }
                    for name, values in (("hit", hits), ("healthz", health), ("resolve", resolve))
                }
            )
    compiled = sum(1 for s in storms if s["jobs"] == 1 and s["attempts"] == 1)
    with stack.farm.sessions() as session:
        all_jobs = session.scalar(select(func.count()).select_from(Job))

    def median_of(name: str, p: str) -> float:
        return stats([r[name][p] for r in hit_rounds])["median"]

    hit50, hit99 = median_of("hit", "p50"), median_of("hit", "p99")
    floor50, floor99 = median_of("healthz", "p50"), median_of("healthz", "p99")
    return {
        "title": f"{STORM} concurrent identical submits x {len(models)} models; "
        f"{HITS_PER_ROUND} sequential cache-hit submits per run",
        "comparisons": [
            comparison("cache-hit submit p50", "GET /healthz p50", floor50, hit50, "ms"),
            comparison("cache-hit submit p99", "GET /healthz p99", floor99, hit99, "ms"),
            comparison(
                "resolve (GET /v1/blobs/KEY) p50",
                "GET /healthz p50",
                floor50,
                median_of("resolve", "p50"),
                "ms",
            ),
            comparison(
                f"storm of {STORM}: submit latency p50 (under load)",
                None,
                None,
                stats([s["latency_ms"]["p50"] for s in storms])["median"],
                "ms",
            ),
            comparison(
                f"storm of {STORM}: submit latency p99 (under load)",
                None,
                None,
                stats([s["latency_ms"]["p99"] for s in storms])["median"],
                "ms",
            ),
        ],
        "storms": storms,
        "hit_rounds_ms": hit_rounds,
        "jobs_in_database": all_jobs,
        "targets": [
            target(
                f"storms that made exactly one job and one compile (of {len(storms)})",
                compiled,
                len(storms),
                at_most=False,
            ),
            target("cache-hit submit latency p50 (ms)", hit50, 20, unit="ms"),
            target("cache-hit submit latency p99 (ms)", hit99, 100, unit="ms"),
        ],
        "notes": (
            "Storm requests each open their own connection and are released together by a "
            "barrier; the API is one uvicorn process on a 2-core machine shared with "
            "PostgreSQL, Redis, SeaweedFS, the worker and this client, so storm latencies "
            "are queueing, not service time. Hit latencies are client-side wall times of "
            "sequential requests on a kept-alive connection."
        ),
    }


def _args(body: dict) -> dict:
    return {
        "model": body["model"],
        "name": body["model_name"],
        "specs": body["specs"],
        "toolchain": body["toolchain"],
    }


if __name__ == "__main__":
    write_result(NAME, main())
