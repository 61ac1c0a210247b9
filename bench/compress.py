"""Weight compression on the farm (issue 27): the compressed sizes, and the farm's compress
stage against `nncf.compress_weights` called directly on the same model.

- size: the weights file after `int8` and `int4-sym` over the FP32 weights of the matmul chain
  (`tests/models.py` `large_net`), targets ≤ 0.27x and ≤ 0.15x;
- time and peak RSS: the farm's stage (`farm.server.stages.compress.run_stage`: read the IR,
  run the uncompressed model once, NNCF, save, run the compressed model once and measure the
  drift) against the direct call a user would write (`read_model`, `compress_weights`,
  `save_model`), each in a fresh child process, interleaved run by run; targets ≤ 1.1x.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
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


def _child(kind: str, xml: Path, mode: str, out: Path) -> dict[str, Any]:
    """One measured compression in a fresh process (`python -m bench.compress --child ...`)."""
    result = subprocess.run(
        [sys.executable, "-m", "bench.compress", "--child", kind, str(xml), mode, str(out)],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"{kind} compression failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def _run_child(kind: str, xml: str, mode: str, out: str) -> dict[str, Any]:
    from farm.core.compression import COMPRESS, compress_args

    from .probes import Measured

    if kind == "farm":
        from farm.server.stages.compress import run_stage

        with Measured() as measured:
            result = run_stage(COMPRESS, compress_args(mode), Path(xml), Path(out), seed="bench")
        return {**measured.as_dict(), "metrics": result.metrics}
    import openvino as ov

    if kind == "compile":
        from farm.core.reference import seeded_inputs
        from farm.server.stages.compress import _input_specs

        with Measured() as measured:
            core = ov.Core()
            model = core.read_model(xml)
            compiled = core.compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
            compiled(seeded_inputs("bench", _input_specs(model)))
        return measured.as_dict()
    import nncf

    args = compress_args(mode)
    settings = {k: v for k, v in args.items() if k != "mode"}
    with Measured() as measured:
        model = ov.Core().read_model(xml)
        compressed = nncf.compress_weights(
            model, mode=nncf.CompressWeightsMode(args["mode"]), **settings
        )
        Path(out).mkdir(parents=True, exist_ok=True)
        ov.save_model(compressed, Path(out) / "model.xml", compress_to_fp16=False)
    return measured.as_dict()


def main() -> None:
    with scratch("compress") as folder:
        log(f"building a {MEGABYTES} MB FP32 matmul chain")
        xml = build_large_model(folder, MEGABYTES)
        fp32 = xml.with_suffix(".bin").stat().st_size
        sizes = {}
        for mode in ("int8", "int4-sym"):
            measured = _child("farm", xml, mode, folder / f"size-{mode}")
            sizes[mode] = measured["metrics"]["size_after"]
            log(f"{mode}: {sizes[mode] / MB:.1f} MB of {fp32 / MB:.1f} MB")
        farm: dict[str, list[float]] = {"seconds": [], "rss": []}
        direct: dict[str, list[float]] = {"seconds": [], "rss": []}
        compile_fp32: dict[str, list[float]] = {"seconds": [], "rss": []}
        for run in range(RUNS):
            for kind, into in (("direct", direct), ("farm", farm), ("compile", compile_fp32)):
                measured = _child(kind, xml, TIMED_MODE, folder / f"{kind}-{run}")
                into["seconds"].append(measured["seconds"])
                into["rss"].append(measured["peak_rss_bytes"] / MB)
            log(
                f"run {run + 1}/{RUNS}: direct {direct['seconds'][-1]:.2f} s "
                f"{direct['rss'][-1]:.0f} MB, farm {farm['seconds'][-1]:.2f} s "
                f"{farm['rss'][-1]:.0f} MB"
            )
    measured = (("d", direct), ("f", farm), ("c", compile_fp32))
    seconds = {name: stats(d["seconds"])["median"] for name, d in measured}
    rss = {name: stats(d["rss"])["median"] for name, d in measured}
    write_result(
        "compress",
        {
            "title": f"{MEGABYTES} MB FP32 matmul chain, {TIMED_MODE} timed",
            "fp32_weights_bytes": fp32,
            "compressed_bytes": sizes,
            "direct": {key: stats(values) for key, values in direct.items()},
            "farm": {key: stats(values) for key, values in farm.items()},
            "compile_fp32": {key: stats(values) for key, values in compile_fp32.items()},
            "comparisons": [
                comparison(
                    f"{TIMED_MODE} compression time",
                    "nncf.compress_weights direct",
                    seconds["d"],
                    seconds["f"],
                    "s",
                ),
                comparison(
                    f"{TIMED_MODE} compression peak RSS",
                    "nncf.compress_weights direct",
                    rss["d"],
                    rss["f"],
                    "MB",
                ),
                # The drift needs the uncompressed model's outputs: one CPU compile of it.
                comparison(
                    f"{TIMED_MODE} compression peak RSS",
                    "CPU compile of the FP32 model (the drift's reference run)",
                    rss["c"],
                    rss["f"],
                    "MB",
                ),
            ],
            "targets": [
                target("int8 weights / FP32 weights", sizes["int8"] / fp32, 0.27, unit="x"),
                target("int4-sym weights / FP32 weights", sizes["int4-sym"] / fp32, 0.15, unit="x"),
                target("compression time, farm / direct", ratio(seconds["f"], seconds["d"]), 1.1),
                target("peak RSS, farm / direct", ratio(rss["f"], rss["d"]), 1.1),
            ],
        },
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        print(json.dumps(_run_child(*sys.argv[2:6])))
    else:
        main()
