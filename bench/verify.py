"""Verify: what `farm verify` costs over the least an edge does with a blob (issue 16).

Side by side in one run, each in a fresh process, on a 256 MB CPU model compiled by the
embedded farm (which also stored its reference outputs):
- baseline: memory-map the cached blob, `import_model`, one inference on the reference inputs;
- farm: `farm verify KEY --runs 1` in process: resolve the key, re-check the cached blob's
  signed manifest, fetch and check the signed reference file, import, one warm-up and one timed
  inference, compare every output, report the verification to the farm (SQLite).
- and with `--runs 10`, the default, to show what the timing itself costs.

No target in the issue: the figure to know is the ratio (verification runs once per blob and
device, `farm agent sync --verify`).
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from .common import (
    RUNS,
    build_large_model,
    child_env,
    comparison,
    log,
    probe,
    scaled,
    scratch,
    stats,
    write_result,
)

NAME = "verify"
MODEL_MB = scaled(256, 8)
REFERENCE_TIMEOUT = 600.0
"""How long the run waits, untimed, for the blob's reference outputs."""


def main() -> dict:
    with scratch(NAME) as root:
        log(f"building a {MODEL_MB} MB model")
        xml = build_large_model(root / "model", MODEL_MB)
        env = {"FARM_HOME": str(root / "farm"), "FARM_CACHE_DIR": str(root / "cache")}
        log("farm submit (embedded: compile and reference outputs)")
        submitted = _farm(env, "submit", str(xml), "--device", "CPU")
        key = submitted["cache_key"]
        _farm(env, "pull", key)  # into the edge cache: both sides start from the cached blob
        blob = root / "cache" / "blobs" / f"{key}.blob"
        digest = _settled_reference(root / "farm" / "farm.db", key)
        reference = root / "farm" / "store" / "references" / key / f"{digest}.npz"
        runs: dict[str, list[dict]] = {"baseline": [], "verify_1": [], "verify_10": []}
        for number in range(RUNS):
            log(f"run {number + 1}/{RUNS}")
            runs["baseline"].append(
                probe("import_and_infer_once", blob=str(blob), reference=str(reference))
            )
            runs["verify_1"].append(probe("farm_verify", env=env, key=key, runs=1))
            runs["verify_10"].append(probe("farm_verify", env=env, key=key, runs=10))
    seconds = {name: stats([r["seconds"] for r in rows]) for name, rows in runs.items()}
    peaks = {name: stats([r["peak_rss_bytes"] for r in rows]) for name, rows in runs.items()}
    baseline = seconds["baseline"]["median"]
    return {
        "model_mb": MODEL_MB,
        "seconds": seconds,
        "peak_rss_bytes": peaks,
        "comparisons": [
            comparison(
                "farm verify --runs 1",
                "import + 1 inference",
                baseline,
                seconds["verify_1"]["median"],
                "s",
            ),
            comparison(
                "farm verify --runs 10",
                "import + 1 inference",
                baseline,
                seconds["verify_10"]["median"],
                "s",
            ),
            comparison(
                "peak RSS, farm verify --runs 1",
                "import + 1 inference",
                peaks["baseline"]["median"],
                peaks["verify_1"]["median"],
                "bytes",
            ),
        ],
        "targets": [],
    }


def _settled_reference(database: Path, key: str) -> str:
    """The blob's reference digest once its reference run (detached, after the blob is
    recorded: docs §14) has stored it."""
    deadline = time.monotonic() + REFERENCE_TIMEOUT
    with sqlite3.connect(database) as db:
        while True:
            state, digest = db.execute(
                "SELECT reference_state, reference_sha256 FROM blobs WHERE cache_key = ?", (key,)
            ).fetchone()
            if state != "pending" or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    assert state == "ready", f"the reference run ended {state}"
    return str(digest)


def _farm(env: dict[str, str], *args: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "farm", *args, "--json"],
        env=child_env(env),
        capture_output=True,
        text=True,
        timeout=1800,
        check=True,
    )
    return json.loads(done.stdout)


if __name__ == "__main__":
    write_result(NAME, main())
