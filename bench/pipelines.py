"""Pipelines: an edge opening a pulled CPU LLM bundle against a warm CACHE_DIR build (issue 28).

Side by side in one run, each in a fresh process, on an LLM built here (tests/genai_models.py,
hidden size 512, 8 layers, random weights) and compiled into a bundle by
`farm.server.bundles.service.build_bundle` in a local store, then pulled with
`farm.edge.bundle.pull`:
- baseline: `openvino_genai.LLMPipeline(folder, "CPU", CACHE_DIR=<warm>, same properties)`;
- farm: `farm.edge.bundle.open_bundle(ready)` on the pulled folder.
Both are checked to compile nothing (their cache entries untouched). Also measured: what GenAI
compiles outside any cache at every start (the tokenizer and detokenizer).
"""

from __future__ import annotations

import json
import subprocess
import sys

from .common import (
    REPO,
    RUNS,
    child_env,
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

NAME = "pipelines"
HIDDEN, LAYERS = scaled(512, 64), scaled(8, 2)


def main() -> dict:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from farm.core.pipelines import detect
    from farm.core.signing import Signer, TrustedKeys
    from farm.core.spec import Target
    from farm.edge.bundle import FolderSource, open_properties, pull
    from farm.server.bundles.service import build_bundle, options_for
    from farm.server.storage.local import LocalStore

    with scratch(NAME) as root:
        log(f"building an LLM (hidden {HIDDEN}, {LAYERS} layers) with optimum-intel")
        folder = root / "llm"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "tests.genai_models",
                "llm",
                str(folder),
                str(HIDDEN),
                str(LAYERS),
            ],
            cwd=REPO,
            env=child_env({"PYTHONWARNINGS": "ignore"}),
            check=True,
            capture_output=True,
        )
        signer = Signer(Ed25519PrivateKey.generate())
        pipeline = detect(folder)
        log("compiling the bundle")
        signed = build_bundle(
            LocalStore(root / "store"), signer, pipeline, options_for(pipeline, Target("CPU"))
        )
        key = signed["manifest"]["bundle_key"]
        ready = root / "ready"
        manifest = pull(
            FolderSource(root / "store"),
            key,
            ready,
            TrustedKeys({}).with_key(signer.public_key),
            local=folder,
        )
        warm = {**open_properties(ready, manifest), "CACHE_DIR": str(root / "warm")}
        # The first build writes the warm cache (a compile, not measured).
        subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys,json; from pathlib import Path; from farm.genai import open_pipeline; "
                "open_pipeline('llm', Path(sys.argv[1]), 'CPU', json.loads(sys.argv[2]))",
                str(folder),
                json.dumps(warm),
            ],
            cwd=REPO,
            env=child_env(),
            check=True,
        )
        runs: dict[str, list[dict]] = {"warm": [], "bundle": [], "tokenizers": []}
        for number in range(RUNS):
            log(f"run {number + 1}/{RUNS}")
            runs["warm"].append(probe("pipeline_open_warm", folder=str(folder), properties=warm))
            runs["bundle"].append(probe("pipeline_open_bundle", ready=str(ready)))
            runs["tokenizers"].append(probe("pipeline_tokenizers", folder=str(folder)))
        weights = (folder / "openvino_model.bin").stat().st_size
        entry = sum(f.size for f in manifest.files if f.path.startswith("cache/"))
    seconds = {name: stats([r["seconds"] for r in rows]) for name, rows in runs.items()}
    peaks = {name: stats([r["peak_rss_bytes"] for r in rows]) for name, rows in runs.items()}
    time_ratio = ratio(seconds["bundle"]["median"], seconds["warm"]["median"])
    rss_ratio = ratio(peaks["bundle"]["median"], peaks["warm"]["median"])
    mb = 2**20
    return {
        "title": (
            f"LLM hidden {HIDDEN}, {LAYERS} layers: weights {weights / mb:.1f} MB, cache entry "
            f"{entry / mb:.1f} MB, CPU"
        ),
        "seconds": seconds,
        "peak_rss_bytes": peaks,
        "comparisons": [
            comparison(
                "time to a ready LLMPipeline",
                "warm CACHE_DIR build",
                seconds["warm"]["median"],
                seconds["bundle"]["median"],
                "s",
            ),
            comparison(
                "peak RSS opening it",
                "warm CACHE_DIR build",
                peaks["warm"]["median"] / mb,
                peaks["bundle"]["median"] / mb,
                "MB",
            ),
            comparison(
                "tokenizer + detokenizer compiled at every start (no cache)",
                "time to ready",
                seconds["bundle"]["median"],
                seconds["tokenizers"]["median"],
                "s",
            ),
        ],
        "targets": [
            target("time-to-ready bundle / warm CACHE_DIR", time_ratio, 1.2, unit="x"),
            target("peak RSS bundle / warm CACHE_DIR", rss_ratio, 1.1, unit="x"),
        ],
    }


if __name__ == "__main__":
    write_result(NAME, main())
