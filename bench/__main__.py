"""``python -m bench [NAME ...]``: run benchmarks one at a time, each in its own process, then
rewrite the results section of bench/README.md from bench/results/*.json.

    bench/run                 all of them (about 20 minutes on 2 cores)
    bench/run edge hashing    only these
    bench/run --list          their names
    bench/run --report        only rewrite the README section from the results already there
    bench/run --smoke         every benchmark end to end on tiny inputs, one run each (a few
                              minutes; scripts/test runs it so no benchmark rots); its figures go
                              to a scratch folder and mean nothing
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile

from .common import REPO, child_env, log
from .report import update_readme
from .tune import held

BENCHMARKS = {
    "edge": "edge time-to-ready, peak RSS, download vs boto3 (issue 5 item 9)",
    "overhead": "submit -> succeeded by phase through the served stack (issue 7.1)",
    "dedup": "200 concurrent identical submits; cache-hit latency (issue 7.2)",
    "hashing": "sha256 vs hashlib on 1 GB; unchanged re-submit with the digest cache (7.3)",
    "worker_memory": "worker peak RSS during a compile vs the same compile direct (7.4)",
    "scaleout": "small-model jobs per hour with 1 and 2 worker processes (7.5)",
    "startup": "read commands' start vs a bare process of their path's libraries (17.15, 30.4)",
    "verify": "farm verify vs a plain import + one inference of the same blob (issue 16)",
    "submit_overhead": "embedded submit of a 512 MB IR vs direct compile + one sha256 (17.16)",
    "channels": "no-change channel sync x20 edges; a 500-edge staged rollout (issue 29)",
    "compress": "int8/int4 sizes; compress stage vs nncf.compress_weights direct (issue 27)",
    "convert": "a .pt2 converted + compiled through the farm vs directly; 2nd spec; RSS (26)",
    "pipelines": "edge opening a pulled CPU LLM bundle vs a warm CACHE_DIR build (issue 28)",
}
ON_DEMAND = {
    "catalog": "the catalog at production scale: 1M blobs, 5M pulls (issue 18; hours, by name)",
}
"""Benchmarks run only when named (or by --smoke, on a tiny scale)."""
SMOKE_ARGS = {"catalog": ["--scale", "0.0002"]}
"""Arguments that make a benchmark tiny under --smoke (the others read FARM_BENCH_SMOKE)."""


def main(argv: list[str]) -> int:
    known = {**BENCHMARKS, **ON_DEMAND}
    if "--list" in argv:
        for name, what in known.items():
            print(f"{name:<16} {what}")
        return 0
    if "--report" in argv:
        update_readme()
        return 0
    smoke = "--smoke" in argv
    names = [name for name in argv if name != "--smoke"] or list(BENCHMARKS)
    if smoke and not [name for name in argv if name != "--smoke"]:
        names = list(known)
    unknown = [name for name in names if name not in known]
    if unknown:
        print(f"unknown benchmark(s) {', '.join(unknown)}; known: {', '.join(known)}")
        return 2
    env = child_env()
    if smoke:
        env["FARM_BENCH_SMOKE"] = "1"
        env["FARM_BENCH_RESULTS"] = tempfile.mkdtemp(prefix="farm-bench-smoke-")
    failed = []
    with contextlib.nullcontext(False) if smoke else held() as steady:
        if not smoke:
            held_or_not = "held" if steady else "as the machine has it"
            log(f"free page reporting {held_or_not} (bench/tune.py)")
        for name in names:
            log(f"=== {name}{' (smoke)' if smoke else ''}: {known[name]}")
            args = SMOKE_ARGS.get(name, []) if smoke else []
            result = subprocess.run(
                [sys.executable, "-m", f"bench.{name}", *args], cwd=REPO, env=env, check=False
            )
            if result.returncode != 0:
                failed.append(name)
                log(f"{name} failed (exit {result.returncode})")
    if not smoke:
        update_readme()
    elif not os.environ.get("FARM_BENCH_KEEP"):
        import shutil

        shutil.rmtree(env["FARM_BENCH_RESULTS"], ignore_errors=True)
    if failed:
        log(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
