"""Convert: a PyTorch source converted and compiled through the farm vs directly (issue 26).

Side by side in one run, interleaved (the order alternating run by run), each side in fresh
processes, on a torch.export program (.pt2) of a Linear chain with MODEL_MB of FP32 weights
(built by torch here, never downloaded):
- direct: one fresh process imports torch and OpenVINO, `torch.export.load` +
  `ov.convert_model`, then compiles the converted model for CPU with the farm's compile
  properties, OpenVINO writing the blob file (as the farm's compile does). Timed from before
  the imports to the blob written. Not part of the span: saving the IR (measured after it, as
  `ir_save_seconds`: the farm saves it because it caches the conversion);
- farm: `farm submit model.pt2 --device CPU` on a fresh embedded farm (reference outputs off:
  they are a further torch and CPU run, not conversion; FARM_COMPILE_USER=root: the child does
  not switch user, so it needs no warm-up conversion of farm's own, docs/architecture.md §15).
  The span is the job's `fetch` + `convert+compile` phases as the runner records them
  (`job_phases`): the one child started, torch and OpenVINO imported, load, convert, compile
  the converted model while the IR is saved and hashed beside it, the blob written, the child
  ended. Storing the IR (the store checking the child's digests) and recording the stage run
  beside storing the blob, in the job's `upload` phase: shown with it (`farm_to_blob_stored`,
  the span + `upload`), not in the target. The submitter's own work before the job (hashing
  and storing the 512 MB source) is shown as the whole `farm submit`, not the target;
- second spec of the same source: 0 conversions, counted in `stage_outputs` (not timed);
- peak RSS of the conversion child (its VmHWM over load + convert + save, reset after its
  imports) vs the same conversion's in the direct process (load + convert, reset after the
  imports).
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .common import (
    REPO,
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
FARM_SPAN = ("fetch", "convert+compile")
"""The job's phases that make "conversion + compile through the farm": one child converts and
compiles (docs/architecture.md §15), its phase `convert+compile`."""


def _direct(pt2: Path, out: Path) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "bench.convert", "--child", str(pt2), str(out)],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"direct conversion failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _direct_child(pt2: str, out_dir: str) -> dict[str, Any]:
    """The direct way, in one process, timed from before the imports."""
    started = time.perf_counter()
    import openvino as ov
    import torch

    from farm.core.spec import CompileSpec
    from farm.toolchain import cache_properties, compile_properties, written_blob

    from .probes import Measured

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with Measured() as conversion:
        model = ov.convert_model(torch.export.load(pt2))
    properties = {
        **compile_properties(CompileSpec.create("CPU")),
        **cache_properties(out, "direct"),
    }
    compiling = time.perf_counter()
    ov.Core().compile_model(model, "CPU", properties)
    blob = written_blob(out, out / "direct.blob")
    ended = time.perf_counter()
    ov.save_model(model, out / "model.xml", compress_to_fp16=False)
    return {
        "seconds": ended - started,
        "conversion_seconds": conversion.seconds,
        "compile_seconds": ended - compiling,
        "conversion_peak_rss_bytes": conversion.peak_rss,
        "blob_bytes": blob.stat().st_size,
        "ir_save_seconds": time.perf_counter() - ended,
    }


def _farm(pt2: Path, home: Path, *extra: str) -> dict[str, Any]:
    env = {
        "FARM_HOME": str(home),
        "FARM_CACHE_DIR": str(home / "cache"),
        "FARM_REFERENCE_OUTPUTS": "false",
        "FARM_COMPILE_USER": "root",
    }
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "farm", "submit", str(pt2), "--device", "CPU", *extra, "--json"],
        env=child_env(env),
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"farm submit failed:\n{done.stderr[-4000:]}")
    job = json.loads(done.stdout)["job"]
    assert job["state"] == "succeeded", job
    with sqlite3.connect(home / "farm.db") as db:
        phases = dict(
            db.execute("SELECT phase, seconds FROM job_phases WHERE job_id = ?", (job["id"],))
        )
        compiling = db.execute(
            "SELECT compile_seconds + export_seconds FROM jobs WHERE id = ?", (job["id"],)
        ).fetchone()[0]
    return {"job_id": job["id"], "submit_seconds": wall, "phases": phases, "compiling": compiling}


def main() -> dict:
    with scratch(NAME) as root:
        pt2 = root / "model.pt2"
        log(f"building a {MODEL_MB} MB torch.export program")
        probe("build_pt2", path=str(pt2), megabytes=MODEL_MB)
        direct: list[dict[str, Any]] = []
        farm: list[dict[str, Any]] = []
        conversions_second_spec = []
        for number in range(RUNS):
            order = ("direct", "farm") if number % 2 == 0 else ("farm", "direct")
            for side in order:
                if side == "direct":
                    direct.append(_direct(pt2, root / f"d{number}"))
                    continue
                home = root / f"farm{number}"
                first = _farm(pt2, home)
                _farm(pt2, home, "--config", "INFERENCE_PRECISION_HINT=f32")  # a second spec
                with sqlite3.connect(home / "farm.db") as db:
                    rows = db.execute("SELECT job_id, metrics FROM stage_outputs").fetchall()
                assert len(rows) == 1 and rows[0][0] == first["job_id"], rows
                conversions_second_spec.append(len(rows) - 1)
                assert "compile" not in first["phases"], first  # one child did both
                first["seconds"] = sum(first["phases"][phase] for phase in FARM_SPAN)
                first["to_blob_stored"] = first["seconds"] + first["phases"]["upload"]
                metrics = json.loads(rows[0][1])
                first["conversion_peak_rss_bytes"] = metrics["peak_rss_bytes"]
                # The child's timed conversion and IR save (the save overlaps the compile).
                first["stage_seconds"] = metrics["seconds"]
                farm.append(first)
            phases = " · ".join(f"{k} {v:.1f}" for k, v in farm[-1]["phases"].items())
            log(
                f"run {number + 1}/{RUNS}: direct {direct[-1]['seconds']:.1f} s, farm "
                f"{farm[-1]['seconds']:.1f} s ({phases}), whole submit "
                f"{farm[-1]['submit_seconds']:.1f} s"
            )
    seconds = {
        "direct": stats([run["seconds"] for run in direct]),
        "farm": stats([run["seconds"] for run in farm]),
        "farm_submit": stats([run["submit_seconds"] for run in farm]),
        "farm_to_blob_stored": stats([run["to_blob_stored"] for run in farm]),
        "direct_with_ir_saved": stats([run["seconds"] + run["ir_save_seconds"] for run in direct]),
    }
    rss = {
        side: stats([run["conversion_peak_rss_bytes"] for run in runs])
        for side, runs in (("direct", direct), ("farm", farm))
    }
    for key in ("stage_seconds", "compiling"):
        seconds[key] = stats([run[key] for run in farm])
    for key in ("conversion_seconds", "compile_seconds", "ir_save_seconds"):
        seconds[f"direct_{key}"] = stats([run[key] for run in direct])
    median = {name: values["median"] for name, values in seconds.items()}
    time_ratio = median["farm"] / median["direct"]
    rss_ratio = rss["farm"]["median"] / rss["direct"]["median"]
    return {
        "title": f"a {MODEL_MB} MB torch.export program (.pt2) to a CPU blob",
        "model_mb": MODEL_MB,
        "seconds": seconds,
        "conversion_peak_rss_bytes": rss,
        "runs": {"direct": direct, "farm": farm},
        "conversions_by_second_spec": conversions_second_spec,
        "comparisons": [
            comparison(
                "the job's fetch + convert+compile phases (one child)",
                "torch.export.load + ov.convert_model + compile, one fresh process",
                median["direct"],
                median["farm"],
                "s",
            ),
            comparison(
                "the job's fetch + convert+compile phases (one child)",
                "the same, direct, with the IR saved too",
                median["direct_with_ir_saved"],
                median["farm"],
                "s",
            ),
            comparison(
                "the job's fetch + convert+compile + upload (blob and IR stored)",
                "torch.export.load + ov.convert_model + compile, one fresh process",
                median["direct"],
                median["farm_to_blob_stored"],
                "s",
            ),
            comparison(
                "the whole farm submit (hash + store the source, job, store the blob)",
                "torch.export.load + ov.convert_model + compile, one fresh process",
                median["direct"],
                median["farm_submit"],
                "s",
            ),
            comparison(
                "peak RSS of the conversion child",
                "the same conversion, direct",
                rss["direct"]["median"] / 2**20,
                rss["farm"]["median"] / 2**20,
                "MB",
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


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        print(json.dumps(_direct_child(*sys.argv[2:4])))
    else:
        write_result(NAME, main())
