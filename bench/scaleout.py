"""Scale-out (issue 7, target 5): jobs per hour of small models with 1 and with 2 `farm worker`
processes, the ratio, and where each job's time goes.

Each run submits a batch of distinct small models (already uploaded, so only compiles are
timed) through the API, first with one worker process, then with two; throughput is the
batch size over the makespan (first job created -> last job finished, from the job rows).
Every job's time is split by what its worker recorded (`job_phases`, never file times): queue
wait, model fetch, the compile child's whole life (its own compile and export seconds, from the
job row, split it; the rest is the child's start: interpreter, OpenVINO import, reading the
model), blob upload, record, and the reference run that follows the record on the same worker
(the job is `succeeded` before it, but the worker takes its next job after it). Baselines in
the same run: the same compiles one after another in one warm process, and in a fresh process
each (what the worker's compile child costs at the least).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from sqlalchemy import func, select

from farm.client import FarmClient
from farm.core.identity import ModelRef
from farm.core.spec import CompileSpec
from farm.server.db.models import Blob

from .common import (
    RUNS,
    build_small_models,
    comparison,
    log,
    probe,
    ratio,
    scaled,
    scratch,
    stats,
    target,
    write_result,
)
from .observe import timestamp
from .overhead import body_for, recorded_phases, wait_all_final
from .stack import served_stack

NAME = "scaleout"
BATCH = scaled(20, 2)
"""Jobs per batch."""
FRESH_SAMPLES = scaled(3, 1)
"""Direct compiles in a fresh process each, per run (the per-job floor of a compile child)."""


def main() -> dict:
    with scratch(NAME) as root:
        log(f"building {RUNS * 2 * BATCH} small models")
        models = build_small_models(root / "models", RUNS * 2 * BATCH)
        worker_tmp = root / "worker-tmp"
        worker_tmp.mkdir()
        tmp_env = {"TMPDIR": str(worker_tmp)}
        with served_stack(root) as stack:
            client = FarmClient(stack.api.url, stack.tokens["submit"])
            spec = CompileSpec.create("CPU")
            bodies = []
            for xml in models:
                ref = ModelRef.from_path(xml)
                for role, sha in ref.identity.items():
                    client.upload(sha, ref.files[role])
                bodies.append(body_for(ref, spec))
            stack.farm.start_worker("w1", env=tmp_env)
            runs = []
            for run in range(RUNS):
                batches = {}
                for workers in (1, 2):
                    if workers == 2:
                        stack.farm.start_worker("w2", env=tmp_env)
                    offset = (run * 2 + workers - 1) * BATCH
                    batch = bodies[offset : offset + BATCH]
                    batches[workers] = one_batch(stack, client, batch)
                    log(
                        f"run {run + 1}/{RUNS}, {workers} worker(s): "
                        f"{batches[workers]['jobs_per_hour']:.0f} jobs/h"
                    )
                    if workers == 2:
                        stack.farm.kill_worker("w2", 15)
                batches["direct"] = direct_baselines(root, models[run * 2 * BATCH :][:BATCH])
                runs.append(batches)
            client.close()
    return summarize(runs)


def one_batch(stack, client: FarmClient, batch: list[dict]) -> dict:
    job_ids = []
    for body in batch:
        answer = client.submit(**body)["results"][0]
        assert answer["outcome"] == "queued", answer
        job_ids.append(answer["job"]["id"])
    jobs = wait_all_final(stack.farm, job_ids)
    assert all(job.state == "succeeded" for job, _ in jobs), [job.error for job, _ in jobs]
    settle_references(stack.farm, job_ids)
    first = min(timestamp(job.created_at) for job, _ in jobs)
    last = max(visible for _, visible in jobs)
    makespan = last - first
    per_job = []
    for job, visible in jobs:
        recorded = recorded_phases(stack.farm, job)
        child = job.compile_seconds + job.export_seconds
        per_job.append(
            {
                "worker": job.worker,
                "queue_wait": timestamp(job.started_at) - timestamp(job.created_at),
                "model_fetch": recorded["fetch"],
                "compile_child": recorded["compile"],
                "child_startup_and_read": recorded["compile"] - child,
                "compile": job.compile_seconds,
                "export": job.export_seconds,
                "blob_upload": recorded["upload"],
                "record": recorded["record"],
                "reference": recorded.get("reference", 0.0),
                "run": visible - timestamp(job.started_at),
            }
        )
    return {
        "makespan": makespan,
        "jobs_per_hour": len(jobs) / makespan * 3600,
        "jobs": per_job,
    }


def settle_references(farm, job_ids: list[int], timeout: float = 300) -> None:
    """Wait until the jobs' blobs have their reference runs done (recorded by the worker
    after each job's record, as the tail of its task)."""
    deadline = time.monotonic() + timeout
    with farm.engine.connect() as connection:
        while time.monotonic() < deadline:
            pending = connection.execute(
                select(func.count())
                .select_from(Blob)
                .where(Blob.job_id.in_(job_ids), Blob.reference_state == "pending")
            ).scalar_one()
            connection.rollback()  # a new snapshot for the next read
            if not pending:
                return
            time.sleep(0.05)
    raise TimeoutError(f"reference runs of jobs {job_ids} did not end")


def direct_baselines(root: Path, models: list[Path]) -> dict:
    """The same compiles in one warm process, and a few in a fresh process each."""
    warm = probe("direct_compile_many", xmls=[str(m) for m in models], out_dir=str(root / "d"))
    fresh = []
    for xml in models[:FRESH_SAMPLES]:
        started = time.perf_counter()  # a whole process: interpreter, imports, compile
        probe("direct_compile_many", xmls=[str(xml)], out_dir=str(root / "f"))
        fresh.append(time.perf_counter() - started)
    return {
        "warm_seconds_per_job": warm["seconds"] / len(models),
        "fresh_process_seconds_per_job": statistics.median(fresh),
    }


def summarize(runs: list[dict]) -> dict:
    one = stats([r[1]["jobs_per_hour"] for r in runs])
    two = stats([r[2]["jobs_per_hour"] for r in runs])
    scaling = stats([r[2]["jobs_per_hour"] / r[1]["jobs_per_hour"] for r in runs])
    warm = stats([3600 / r["direct"]["warm_seconds_per_job"] for r in runs])
    fresh = stats([3600 / r["direct"]["fresh_process_seconds_per_job"] for r in runs])

    def phase_medians(workers: int) -> dict:
        jobs = [job for r in runs for job in r[workers]["jobs"]]
        return {
            name: statistics.median(j[name] for j in jobs) for name in jobs[0] if name != "worker"
        }

    return {
        "title": f"batches of {BATCH} small conv nets on CPU",
        "comparisons": [
            comparison(
                "jobs per hour, 1 worker process",
                "direct, fresh process per model",
                fresh["median"],
                one["median"],
                "jobs/h",
            ),
            comparison(
                "jobs per hour, 2 worker processes",
                "1 worker process",
                one["median"],
                two["median"],
                "jobs/h",
            ),
            comparison(
                "jobs per hour, 1 worker process",
                "direct, one warm process",
                warm["median"],
                one["median"],
                "jobs/h",
            ),
        ],
        "jobs_per_hour": {
            "1_worker": one,
            "2_workers": two,
            "direct_warm_process": warm,
            "direct_fresh_process": fresh,
        },
        "scaling_2_over_1": scaling,
        "median_phase_seconds_per_job": {
            "1_worker": phase_medians(1),
            "2_workers": phase_medians(2),
        },
        "runs": runs,
        "targets": [
            target(
                "scaling, jobs per hour 2 workers / 1 worker (no number in the issue; "
                "1.0 = no gain)",
                ratio(two["median"], one["median"]),
                1.0,
                at_most=False,
                unit="x",
            )
        ],
        "notes": (
            "One machine with 2 cores runs both workers, their compile children, the API, "
            "PostgreSQL, Redis and SeaweedFS: 2x is out of reach by construction; the phases "
            "show where each job's time goes."
        ),
    }


if __name__ == "__main__":
    write_result(NAME, main())
