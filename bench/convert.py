"""Convert: a PyTorch source converted and compiled through the farm vs directly (issue 26).

Side by side in one run, each in fresh processes, on a torch.export program (.pt2) of a Linear
chain with MODEL_MB of FP32 weights (built by torch here, never downloaded):
- baseline: one process imports torch and OpenVINO, `torch.export.load` + `ov.convert_model`
  + save the IR, then compiles it for CPU writing the blob (`compile_to_file`);
- farm: `farm submit model.pt2 --device CPU` on a fresh embedded farm: hash, record, the stage
  child converts (sandboxed, its own process), the compile child compiles, store, record.
  Reference outputs off (FARM_REFERENCE_OUTPUTS=false: they are a further torch and CPU run,
  not conversion) and FARM_COMPILE_USER=root (the child does not switch user, so it needs no
  warm-up conversion of farm's own: see docs/architecture.md §15).
- second spec of the same source: 0 conversions, counted in `stage_outputs` (not timed);
- peak RSS of the conversion child (its recorded VmHWM, reset before the conversion) vs the
  same conversion's in the direct process.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import time

from .common import (
    RUNS,
    child_env,
    comparison,
    log,
    probe,
    scaled,
    scratch,
    stats,
    target,
    write_result,
)

NAME = "convert"
MODEL_MB = scaled(512, 8)


def main() -> dict:
    with scratch(NAME) as root:
        pt2 = root / "model.pt2"
        log(f"building a {MODEL_MB} MB torch.export program")
        probe("build_pt2", path=str(pt2), megabytes=MODEL_MB)
        runs: dict[str, list[float]] = {"baseline": [], "farm": []}
        peaks: dict[str, list[float]] = {"baseline": [], "farm": []}
        conversions_second_spec = []
        for number in range(RUNS):
            log(f"run {number + 1}/{RUNS}")
            direct = probe("direct_convert_compile", pt2=str(pt2), out_dir=str(root / f"d{number}"))
            runs["baseline"].append(direct["seconds"])
            peaks["baseline"].append(direct["conversion_peak_rss_bytes"])
            home = root / f"farm{number}"
            env = {
                "FARM_HOME": str(home),
                "FARM_CACHE_DIR": str(root / f"cache{number}"),
                "FARM_REFERENCE_OUTPUTS": "false",
                "FARM_COMPILE_USER": "root",
            }
            started = time.perf_counter()
            first = _farm(env, "submit", str(pt2), "--device", "CPU")
            runs["farm"].append(time.perf_counter() - started)
            assert first["job"]["state"] == "succeeded", first
            second = _farm(env, "submit", str(pt2), "--device", "CPU", "--config",
                           "INFERENCE_PRECISION_HINT=f32")  # fmt: skip
            assert second["job"]["state"] == "succeeded", second
            with sqlite3.connect(home / "farm.db") as db:
                rows = db.execute("SELECT job_id, metrics FROM stage_outputs").fetchall()
            assert len(rows) == 1 and rows[0][0] == first["job"]["id"], rows
            conversions_second_spec.append(len(rows) - 1)
            peaks["farm"].append(json.loads(rows[0][1])["peak_rss_bytes"])
    seconds = {name: stats(values) for name, values in runs.items()}
    rss = {name: stats(values) for name, values in peaks.items()}
    time_ratio = seconds["farm"]["median"] / seconds["baseline"]["median"]
    rss_ratio = rss["farm"]["median"] / rss["baseline"]["median"]
    return {
        "model_mb": MODEL_MB,
        "seconds": seconds,
        "conversion_peak_rss_bytes": rss,
        "conversions_by_second_spec": conversions_second_spec,
        "comparisons": [
            comparison(
                "farm submit .pt2 (convert + compile)",
                "torch.export.load + ov.convert_model + compile, one process",
                seconds["baseline"]["median"],
                seconds["farm"]["median"],
                "s",
            ),
            comparison(
                "peak RSS of the conversion child",
                "the same conversion, direct",
                rss["baseline"]["median"],
                rss["farm"]["median"],
                "bytes",
            ),
        ],
        "targets": [
            target("conversion + compile through the farm / direct", time_ratio, 1.1),
            target(
                "conversions by a second spec of the same source", max(conversions_second_spec), 0
            ),
            target("peak RSS of the conversion child / direct", rss_ratio, 1.1),
        ],
    }


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
