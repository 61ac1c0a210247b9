"""``python -m bench [NAME ...]``: run benchmarks one at a time, each in its own process, then
rewrite the results section of bench/README.md from bench/results/*.json.

    bench/run                 all of them (about 20 minutes on 2 cores)
    bench/run edge hashing    only these
    bench/run --list          their names
    bench/run --report        only rewrite the README section from the results already there
"""

from __future__ import annotations

import subprocess
import sys

from .common import REPO, child_env, log
from .report import update_readme

BENCHMARKS = {
    "edge": "edge time-to-ready, peak RSS, download vs boto3 (issue 5 item 9)",
    "overhead": "submit -> succeeded by phase through the served stack (issue 7.1)",
    "dedup": "200 concurrent identical submits; cache-hit latency (issue 7.2)",
    "hashing": "sha256 vs hashlib on 1 GB; unchanged re-submit with the digest cache (7.3)",
    "worker_memory": "worker peak RSS during a compile vs the same compile direct (7.4)",
    "scaleout": "small-model jobs per hour with 1 and 2 worker processes (7.5)",
    "startup": "read-only commands' start: embedded before/after, and through the API (17.15)",
    "verify": "farm verify vs a plain import + one inference of the same blob (issue 16)",
    "submit_overhead": "embedded submit of a 512 MB IR vs direct compile + one sha256 (17.16)",
    "pipelines": "edge opening a pulled CPU LLM bundle vs a warm CACHE_DIR build (issue 28)",
}


def main(argv: list[str]) -> int:
    if "--list" in argv:
        for name, what in BENCHMARKS.items():
            print(f"{name:<14} {what}")
        return 0
    if "--report" in argv:
        update_readme()
        return 0
    names = argv or list(BENCHMARKS)
    unknown = [name for name in names if name not in BENCHMARKS]
    if unknown:
        print(f"unknown benchmark(s) {', '.join(unknown)}; known: {', '.join(BENCHMARKS)}")
        return 2
    failed = []
    for name in names:
        log(f"=== {name}: {BENCHMARKS[name]}")
        result = subprocess.run(
            [sys.executable, "-m", f"bench.{name}"], cwd=REPO, env=child_env(), check=False
        )
        if result.returncode != 0:
            failed.append(name)
            log(f"{name} failed (exit {result.returncode})")
    update_readme()
    if failed:
        log(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
