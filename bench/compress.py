"""Weight compression on the farm (issue 27): the compressed sizes, and compression through the
farm against `nncf.compress_weights` called directly on the same model.

- size: the weights file after `int8` and `int4-sym` over the FP32 weights of the matmul chain
  (`tests/models.py` `large_net`), targets ≤ 0.27x and ≤ 0.15x;
- time and peak RSS, targets ≤ 1.1x, interleaved run by run (the order alternating):
  - farm: `farm submit model.xml --device CPU --compress int4-sym` on a fresh embedded farm;
    the span is the job's `compress` phase as the runner records it (`job_phases`), what the
    farm runs to compress: the sandboxed stage child started, OpenVINO and NNCF imported, the
    IR read, NNCF, the IR saved, the child ended, the output hashed, stored and registered.
    Peak RSS: the compression child's VmHWM over its work (`stage_outputs.metrics
    .peak_rss_bytes`, reset after imports);
  - direct: a fresh `python` process doing what a user would write: import OpenVINO and NNCF,
    `read_model`, `nncf.compress_weights`, `save_model`, timed as its parent sees it, from its
    start to its exit (the farm's span holds its child's whole life too: the interpreter's
    start, the imports, the exit); timed inside it from before its imports is shown beside (it
    leaves out the interpreter's start and exit, which the farm's span holds). Peak RSS: VmHWM
    over read + compress + save (reset after the imports, like the stage child's). torch is
    kept out of this process as it is out of the stage child: a `farm[compress]` worker has no
    torch, and NNCF imports it whenever it is installed (`direct (torch imported)` shows that
    case, not a target).
- beside them, not compared: the drift step (issue 27 item 4, a measurement of the compressed
  model, not part of compressing it), the job's `drift` phase: its own sandboxed child after
  the compression's, OpenVINO imported, the uncompressed and the compressed model each compiled
  and run once on CPU f32 (`drift_seconds`), its peak (`drift_peak_rss_bytes`), then the stage
  recorded done.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .common import (
    MB,
    REPO,
    RUNS,
    build_large_model,
    child_env,
    comparison,
    log,
    ratio,
    scaled,
    scratch,
    stats,
    target,
    write_result,
)

MEGABYTES = int(os.environ.get("FARM_BENCH_COMPRESS_MB", str(scaled(128, 8))))
"""FP32 weights of the benchmark's matmul chain: 8 layers of 2048x2048 at the default."""
TIMED_MODE = "int4-sym"
"""The mode timed against NNCF direct: the NPU LLM form, the slowest data-free one."""


def _direct(xml: Path, mode: str, out: Path, torch: bool) -> dict[str, Any]:
    """One direct compression in a fresh process (`python -m bench.compress --child ...`):
    what it measured in itself, and its whole life as its parent saw it (`process_seconds`)."""
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "bench.compress", "--child", str(xml), mode, str(out), str(torch)],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    process_seconds = time.perf_counter() - started
    if result.returncode != 0:
        raise RuntimeError(f"direct compression failed:\n{result.stderr[-4000:]}")
    return {
        **json.loads(result.stdout.strip().splitlines()[-1]),
        "process_seconds": process_seconds,
    }


def _direct_child(xml: str, mode: str, out: str, torch: str) -> dict[str, Any]:
    """The direct call, timed from before the imports."""
    started = time.perf_counter()
    if torch != "True":
        sys.modules["torch"] = None  # type: ignore[assignment]  # as on a farm[compress] worker
    os.environ.setdefault("NNCF_CI", "1")  # no telemetry, as in the stage child
    import nncf
    import openvino as ov

    from farm.core.compression import compress_args

    from .probes import Measured

    imports = time.perf_counter() - started
    args = compress_args(mode)
    settings = {k: v for k, v in args.items() if k != "mode"}
    with Measured() as measured:
        model = ov.Core().read_model(xml)
        compressed = nncf.compress_weights(
            model, mode=nncf.CompressWeightsMode(args["mode"]), **settings
        )
        Path(out).mkdir(parents=True, exist_ok=True)
        ov.save_model(compressed, Path(out) / "model.xml", compress_to_fp16=False)
    return {
        **measured.as_dict(),
        "seconds": time.perf_counter() - started,
        "imports_seconds": imports,
        "work_seconds": measured.seconds,
        "torch_imported": sys.modules.get("torch") is not None,
    }


def _farm(xml: Path, mode: str, home: Path) -> dict[str, Any]:
    """`farm submit --compress` on a fresh embedded farm: the job's compress phase and the
    stage's recorded metrics."""
    env = {
        "FARM_HOME": str(home),
        "FARM_CACHE_DIR": str(home / "cache"),
        "FARM_REFERENCE_OUTPUTS": "false",
        # The child stays the worker's user, as with a launcher (the Docker image): no warm-up
        # compression of farm's own before switching user (`compress.prepare`).
        "FARM_COMPILE_USER": "root",
    }
    command = ["submit", str(xml), "--device", "CPU", "--compress", mode, "--json"]
    done = subprocess.run(
        [sys.executable, "-m", "farm", *command],
        env=child_env(env),
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"farm submit --compress failed:\n{done.stderr[-4000:]}")
    job = json.loads(done.stdout)["job"]
    assert job["state"] == "succeeded", job
    with sqlite3.connect(home / "farm.db") as db:
        phases = dict(
            db.execute("SELECT phase, seconds FROM job_phases WHERE job_id = ?", (job["id"],))
        )
        (metrics,) = db.execute("SELECT metrics FROM stage_outputs").fetchone()
    metrics = json.loads(metrics)
    return {
        "seconds": phases["compress"],
        "phases": phases,
        "peak_rss_bytes": metrics["peak_rss_bytes"],
        "stage_seconds": metrics["seconds"],
        "drift_phase_seconds": phases["drift"],
        "drift_seconds": metrics["drift_seconds"],
        "drift_peak_rss_bytes": metrics["drift_peak_rss_bytes"],
        "size_after": metrics["size_after"],
    }


def main() -> None:
    with scratch("compress") as folder:
        log(f"building a {MEGABYTES} MB FP32 matmul chain")
        xml = build_large_model(folder, MEGABYTES)
        fp32 = xml.with_suffix(".bin").stat().st_size
        sizes = {}
        for mode in ("int8", "int4-sym"):
            sizes[mode] = _farm(xml, mode, folder / f"size-{mode}")["size_after"]
            log(f"{mode}: {sizes[mode] / MB:.1f} MB of {fp32 / MB:.1f} MB")
        sides: dict[str, list[dict[str, Any]]] = {"direct": [], "farm": [], "direct_torch": []}
        for run in range(RUNS):
            order = ["direct", "farm"] if run % 2 == 0 else ["farm", "direct"]
            for side in [*order, "direct_torch"]:
                out = folder / f"{side}-{run}"
                if side == "farm":
                    measured = _farm(xml, TIMED_MODE, out)
                else:
                    measured = _direct(xml, TIMED_MODE, out, torch=side == "direct_torch")
                sides[side].append(measured)
            log(
                f"run {run + 1}/{RUNS}: direct {sides['direct'][-1]['seconds']:.2f} s "
                f"{sides['direct'][-1]['peak_rss_bytes'] / MB:.0f} MB, farm compress phase "
                f"{sides['farm'][-1]['seconds']:.2f} s "
                f"{sides['farm'][-1]['peak_rss_bytes'] / MB:.0f} MB; drift phase "
                f"{sides['farm'][-1]['drift_phase_seconds']:.2f} s "
                f"{sides['farm'][-1]['drift_peak_rss_bytes'] / MB:.0f} MB"
            )

    def median(side: str, key: str, scale: float = 1.0) -> float:
        return float(stats([m[key] / scale for m in sides[side]])["median"])

    seconds = {side: median(side, "seconds") for side in sides}
    process = {side: median(side, "process_seconds") for side in ("direct", "direct_torch")}
    rss = {side: median(side, "peak_rss_bytes", MB) for side in sides}
    drift = {
        "phase_seconds": median("farm", "drift_phase_seconds"),
        "cpu_runs_seconds": median("farm", "drift_seconds"),
        "peak_rss_mb": median("farm", "drift_peak_rss_bytes", MB),
    }
    write_result(
        "compress",
        {
            "title": f"{MEGABYTES} MB FP32 matmul chain, {TIMED_MODE} timed",
            "fp32_weights_bytes": fp32,
            "compressed_bytes": sizes,
            "runs": sides,
            "drift_step": drift,
            "comparisons": [
                comparison(
                    f"{TIMED_MODE}: the job's compress phase",
                    "nncf.compress_weights direct, a fresh process, its whole life",
                    process["direct"],
                    seconds["farm"],
                    "s",
                ),
                comparison(
                    f"{TIMED_MODE}: the job's compress phase",
                    "the same direct process, timed inside it from before its imports",
                    seconds["direct"],
                    seconds["farm"],
                    "s",
                ),
                comparison(
                    f"{TIMED_MODE}: peak RSS of the compression child",
                    "nncf.compress_weights direct",
                    rss["direct"],
                    rss["farm"],
                    "MB",
                ),
                comparison(
                    f"{TIMED_MODE}: the job's compress phase",
                    "direct with torch imported by NNCF (torch installed)",
                    seconds["direct_torch"],
                    seconds["farm"],
                    "s",
                ),
                comparison(
                    f"{TIMED_MODE}: peak RSS of the compression child",
                    "direct with torch imported by NNCF (torch installed)",
                    rss["direct_torch"],
                    rss["farm"],
                    "MB",
                ),
                comparison(
                    f"{TIMED_MODE}: the job's drift phase (issue 27 item 4, not compressing)",
                    "not compared: a measurement beside the compression",
                    None,
                    drift["phase_seconds"],
                    "s",
                ),
                comparison(
                    f"{TIMED_MODE}: of it, the drift's two CPU compiles and runs",
                    "not compared",
                    None,
                    drift["cpu_runs_seconds"],
                    "s",
                ),
                comparison(
                    f"{TIMED_MODE}: peak RSS of the drift child",
                    "not compared: a measurement beside the compression",
                    None,
                    drift["peak_rss_mb"],
                    "MB",
                ),
            ],
            "targets": [
                target("int8 weights / FP32 weights", sizes["int8"] / fp32, 0.27, unit="x"),
                target("int4-sym weights / FP32 weights", sizes["int4-sym"] / fp32, 0.15, unit="x"),
                target(
                    "compression time, farm compress phase / direct process",
                    ratio(seconds["farm"], process["direct"]),
                    1.1,
                ),
                target(
                    "peak RSS, compression child / direct", ratio(rss["farm"], rss["direct"]), 1.1
                ),
            ],
        },
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        print(json.dumps(_direct_child(*sys.argv[2:6])))
    else:
        main()
