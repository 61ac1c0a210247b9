"""Compression through the served farm: the CLI over HTTP (calibration files uploaded, the
drift bound in the submission, the stage output fetched with `farm pull --ir`), a real Celery
worker with NNCF running the stage in its sandboxed child, PostgreSQL and S3."""

from __future__ import annotations

import numpy as np
import pytest

from tests.integration.test_api import cli_env
from tests.integration.test_compress_stage import cnn_classifier, matmul_chain, save

pytest.importorskip("nncf")


def test_quantize_and_compress_over_http_with_a_real_worker(served, api, tmp_path):
    served.start_worker("w1")
    (worker,) = served.farm_json("workers")
    assert any(queue.endswith(".with-nncf") for queue in worker["queues"])
    env = cli_env(api)
    cnn = save(cnn_classifier(), tmp_path / "cnn" / "cnn.xml")
    calibration = tmp_path / "calibration"
    calibration.mkdir()
    rng = np.random.default_rng(5)
    for index in range(12):
        np.save(calibration / f"{index:02}.npy", rng.standard_normal((1, 3, 16, 16)).astype("f4"))
    quantized = served.farm_json(
        "submit", str(cnn), "-d", "CPU", "--quantize", "int8", "--calibration", str(calibration),
        "--wait", env=env,
    )  # fmt: skip
    assert quantized["job"]["state"] == "succeeded", quantized["job"].get("error")
    assert api.requests_logged("PUT /v1/models/") >= 14  # 12 samples, the .xml and the .bin
    blob = served.farm_json("status", quantized["cache_key"], env=env)["blob"]
    assert blob["compression"]["kind"] == "quantize"
    assert blob["compression"]["metrics"]["resolved"]["calibration_samples"] == 12
    assert blob["compression"]["metrics"]["drift"]["top1_agreement"] is not None

    chain = save(matmul_chain(), tmp_path / "chain" / "chain.xml")
    bounded = served.farm(
        "submit", str(chain), "-d", "CPU", "--compress", "int4-sym", "--max-drift", "1e-9",
        "--wait", "--json", env=env, check=False,
    )  # fmt: skip
    assert bounded.returncode == 1
    assert "drifts past --max-drift max-abs=1e-09" in bounded.stdout
    assert len(served.blobs()) == 1  # the quantized one: nothing published past the bound

    # The same compression without a bound: the stage recorded above is reused, not rerun.
    plain = served.farm_json(
        "submit", str(chain), "-d", "CPU", "--compress", "int4-sym", "--wait", env=env
    )
    assert plain["job"]["state"] == "succeeded"
    out = tmp_path / "ir"
    pulled = served.farm_json(
        "pull", str(chain), "--compress", "int4-sym", "--ir", str(out), env=env
    )
    assert pulled["kind"] == "compress" and (out / "model.bin").stat().st_size < (
        chain.with_suffix(".bin").stat().st_size * 0.2
    )
    log = served.worker_log("w1")
    assert log.count("ran stage") == 2  # quantize once, compress once (the retry reused it)
