"""Worker memory (issue 7, target 4): a `farm worker`'s peak RSS while it fetches, compiles,
uploads and records a 512 MB model, against the same compile done directly in one process.

The worker's whole process tree (Celery main process, its pool process that runs the job,
the compile child) is sampled every 10 ms (`bench.observe.TreeSampler`): the peak of their
summed RSS, and each one's own peak (VmHWM). The direct compile is
`farm.compiler.compile_to_file` (read the model, `compile_model` with CACHE_DIR +
CACHE_BLOB_ID) in a fresh process, peak RSS from reading the model to the blob written.

Target: worker peak RSS <= 1.2x the direct compile's.
"""

from __future__ import annotations

import shutil

from farm.client import FarmClient
from farm.core.identity import ModelRef

from .common import (
    MB,
    RUNS,
    build_large_model,
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
from .observe import TreeSampler
from .overhead import body_for, wait_final
from .stack import served_stack

NAME = "worker_memory"
MODEL_MB = scaled(512, 8)


def main() -> dict:
    from farm.core.spec import CompileSpec

    spec = CompileSpec.create("CPU")
    runs = []
    with scratch(NAME) as root, served_stack(root) as stack:
        worker = stack.farm.start_worker("w1")
        client = FarmClient(stack.api.url, stack.tokens["submit"])
        with TreeSampler(worker.pid) as sampler:
            for run in range(RUNS):
                log(f"run {run + 1}/{RUNS}: building a {MODEL_MB} MB model")
                model_dir = root / f"model-{run}"
                xml = build_large_model(model_dir, MODEL_MB, seed=300 + run)
                ref = ModelRef.from_path(xml)
                for role, sha in ref.identity.items():
                    client.upload(sha, ref.files[role])
                sampler.reset()
                answer = client.submit(**body_for(ref, spec))["results"][0]
                job, _ = wait_final(stack.farm, answer["job"]["id"])
                assert job.state == "succeeded", job.error
                farm = {
                    "tree_peak_bytes": sampler.peak_total,
                    "tree_peak_anon_bytes": sampler.peak_total_anon,
                    "by_process": {
                        f"{pid}: {sampler.names.get(pid, '?')}": peak
                        for pid, peak in sampler.peak_by_pid.items()
                    },
                    "pss_at_peak": {
                        f"{pid}: {sampler.names.get(pid, '?')}": pss
                        for pid, pss in sampler.at_peak.items()
                    },
                    "compile_child_reported_bytes": job.peak_rss_bytes,
                }
                direct = probe(
                    "direct_compile",
                    xml=str(xml),
                    out_dir=str(root / "direct"),
                    blob_id=job.cache_key,
                )
                shutil.rmtree(root / "direct")
                shutil.rmtree(model_dir)
                runs.append({"farm": farm, "direct": direct})
                log(
                    f"  worker tree {farm['tree_peak_bytes'] / MB:.0f} MB, "
                    f"direct {direct['peak_rss_bytes'] / MB:.0f} MB"
                )
        client.close()
    return summarize(runs)


def summarize(runs: list[dict]) -> dict:
    tree = stats([r["farm"]["tree_peak_bytes"] / MB for r in runs])
    direct = stats([r["direct"]["peak_rss_bytes"] / MB for r in runs])
    child = stats(
        [
            max(
                peak
                for name, peak in r["farm"]["by_process"].items()
                if "farm.server.jobs.sandbox" in name
            )
            / MB
            for r in runs
        ]
    )
    reported = stats([r["farm"]["compile_child_reported_bytes"] / MB for r in runs])
    others = stats(
        [
            sum(peak for name, peak in r["farm"]["by_process"].items() if "sandbox" not in name)
            / MB
            for r in runs
        ]
    )
    return {
        "title": f"{MODEL_MB} MB model on CPU, one worker process",
        "comparisons": [
            comparison(
                "worker peak memory (process tree, summed PSS)",
                "direct compile",
                direct["median"],
                tree["median"],
                "MB",
            ),
            comparison(
                "compile child's own peak RSS",
                "direct compile",
                direct["median"],
                child["median"],
                "MB",
            ),
        ],
        "worker_tree_peak_mb": tree,
        "compile_child_peak_mb": child,
        "compile_child_reported_peak_mb": reported,
        "worker_processes_but_the_child_peak_mb": others,
        "direct_compile_peak_mb": direct,
        "runs": runs,
        "targets": [
            target(
                "worker peak memory (process tree PSS) / direct compile peak RSS",
                ratio(tree["median"], direct["median"]),
                1.2,
                unit="x",
            )
        ],
        "notes": (
            "tree = the sampled peak of Celery's main process + its pool process (fetch, "
            "upload, record) + the compile child, summed at one instant as PSS (pages the "
            "forked pool shares with its parent counted once). The direct compile "
            "and the compile child run the same function; the child's VmHWM covers its "
            "whole life (interpreter, OpenVINO import, read_model, compile, blob write). "
            "compile_child_reported = the job row's peak_rss_bytes (VmHWM reset just before "
            "compile_model)."
        ),
    }


if __name__ == "__main__":
    write_result(NAME, main())
