"""The fleet as a test lab, for real on CPU: workers store reference outputs beside each blob,
an edge verifies blobs through the API (IR, and an ONNX model the onnx package ships), and a
genuinely divergent blob (compiled from a model whose weights differ from its reference) fails,
is quarantined, is refused by edges, and is replaced by a rebuild, its history kept."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import onnx
import pytest

from farm.core.reference import Reference
from farm.core.signing import Signer
from tests import models
from tests.integration.served import ApiServer
from tests.integration.test_edge import ok_json, run_farm

SQUEEZENET = Path(onnx.__file__).parent / "backend/test/data/light/light_squeezenet.onnx"


@pytest.fixture
def lab(tmp_path):
    home = tmp_path / "farm"
    farm_env = {"FARM_HOME": str(home)}
    pull = ok_json(farm_env, "token", "create", "--name", "edge", "--role", "pull")["token"]
    api = ApiServer(farm_env, tmp_path / "api.log").start()
    edge_env = {
        "FARM_API_URL": api.url,
        "FARM_TOKEN": pull,
        "FARM_CACHE_DIR": str(tmp_path / "edge-cache"),
        "FARM_HOME": str(tmp_path / "edge-home"),
        "FARM_AGENT_ID": "edge-7",
        "FARM_TRUSTED_KEYS": str(home / "keys" / "signing.pem.pub"),
    }
    yield home, farm_env, edge_env, api
    api.stop()


def sql(home: Path, query: str, *params) -> list[tuple]:
    with sqlite3.connect(home / "farm.db") as connection:
        return connection.execute(query, params).fetchall()


def submit(farm_env: dict, model: Path, *extra: str) -> str:
    answer = ok_json(farm_env, "submit", str(model), "--device", "CPU", *extra)
    assert answer["job"]["state"] == "succeeded", answer
    return answer["cache_key"]


def test_blobs_of_ir_and_onnx_models_verify_on_this_cpu(lab, tmp_path):
    home, farm_env, edge_env, _ = lab
    onnx_model = shutil.copy(SQUEEZENET, tmp_path / "squeezenet.onnx")
    ir_model = models.save_ir(models.conv_net(seed=3), tmp_path / "ir" / "conv.xml")
    for model in (ir_model, Path(onnx_model)):
        key = submit(farm_env, model)
        (digest, size, signed, note) = sql(
            home,
            "SELECT reference_sha256, reference_size_bytes, reference_signature, reference_note "
            "FROM blobs WHERE cache_key = ?",
            key,
        )[0]
        assert len(digest) == 64 and size > 0 and signed and note is None
        verified = ok_json(edge_env, "verify", key, "--runs", "5")
        assert verified["passed"] is True and verified["farm"]["quarantined"] is False
        assert verified["max_abs_error"] <= 1e-4 and verified["min_cosine"] >= 0.99999
        assert (
            verified["runs"] == 5 and 0 < verified["latency_min_ms"] <= verified["latency_p50_ms"]
        )
        assert verified["import_seconds"] > 0 and verified["peak_rss_bytes"] > 0
    rows = sql(
        home,
        "SELECT cache_key, agent_id, device_name, passed, runs, blob_id IS NOT NULL "
        "FROM verifications ORDER BY id",
    )
    assert [(r[1], r[3], r[4], r[5]) for r in rows] == [("edge-7", 1, 5, 1)] * 2
    assert all(r[2] for r in rows)  # the CPU's full name
    never = sql(home, "SELECT cache_key FROM blob_verifications WHERE verifications = 0")
    assert never == []
    latency = sql(home, "SELECT target, blobs, verifications FROM device_latency")
    assert latency == [("CPU", 2, 2)]


def test_a_divergent_blob_fails_is_quarantined_refused_and_rebuilt(lab, tmp_path):
    home, farm_env, edge_env, api = lab
    model_a = models.save_ir(models.conv_net(seed=1), tmp_path / "a" / "net.xml")
    model_b = models.save_ir(models.conv_net(seed=2), tmp_path / "b" / "net.xml")
    key_a, key_b = submit(farm_env, model_a), submit(farm_env, model_b)
    _give_reference_of(home, key_b, to=key_a)  # blob A against outputs of B's weights

    failed = run_farm(edge_env, "verify", key_a, "--json")
    assert failed.returncode == 9, failed.stderr
    report = json.loads(failed.stdout)
    assert report["passed"] is False and report["farm"]["quarantined"] is True
    assert report["max_abs_error"] > 1e-2 and not report["outputs"][0]["passed"]
    (reason,) = sql(home, "SELECT quarantine_reason FROM blobs WHERE cache_key = ?", key_a)[0]
    assert "outside tolerance" in reason and "(edge-7)" in reason

    refused = run_farm(edge_env, "pull", key_a)
    assert refused.returncode == 9 and "quarantined" in refused.stderr
    assert not list((tmp_path / "edge-cache").glob(f"**/{key_a}.blob.partial"))
    anyway = run_farm(edge_env, "pull", key_a, "--allow-quarantined", "--json")
    assert anyway.returncode == 0, anyway.stderr
    assert "QUARANTINED" in run_farm(farm_env, "status", key_a).stdout
    metrics = httpx.get(
        f"{api.url}/metrics", headers={"Authorization": f"Bearer {edge_env['FARM_TOKEN']}"}
    )
    assert 'farm_verifications_total{result="failed",target="CPU"} 1.0' in metrics.text
    assert 'farm_blobs_quarantined{target="CPU"} 1.0' in metrics.text

    assert submit(farm_env, model_a, "--rebuild") == key_a
    passed = ok_json(edge_env, "verify", key_a)
    assert passed["passed"] is True
    history = sql(
        home,
        "SELECT passed, blob_id IS NULL FROM verifications WHERE cache_key = ? ORDER BY id",
        key_a,
    )
    assert history == [(0, 1), (1, 0)]  # the failed run outlives the blob it failed
    (deleted,) = sql(home, "SELECT reason FROM blob_deletions WHERE cache_key = ?", key_a)[0]
    assert deleted.startswith("rebuilt after quarantine")
    assert sql(home, "SELECT count(*) FROM jobs WHERE cache_key = ?", key_a) == [(2,)]
    refused_again = run_farm(farm_env, "submit", str(model_b), "--device", "CPU", "--rebuild")
    assert refused_again.returncode == 2 and "not quarantined" in refused_again.stderr


def _give_reference_of(home: Path, source: str, to: str) -> None:
    """Store blob `source`'s reference outputs as blob `to`'s, signed by the farm's own key:
    what a worker that ran the reference on the wrong weights would have recorded."""
    store = home / "store" / "references"
    ((digest, size),) = sql(
        home, "SELECT reference_sha256, reference_size_bytes FROM blobs WHERE cache_key = ?", source
    )
    (store / to).mkdir(exist_ok=True)
    shutil.copyfile(store / source / f"{digest}.npz", store / to / f"{digest}.npz")
    ((blob_sha,),) = sql(home, "SELECT sha256 FROM blobs WHERE cache_key = ?", to)
    signer = Signer.from_file(home / "keys" / "signing.pem")
    signature = signer.sign_reference(to, blob_sha, digest, size)
    with sqlite3.connect(home / "farm.db") as connection:
        connection.execute(
            "UPDATE blobs SET reference_sha256 = ?, reference_size_bytes = ?, "
            "reference_signature = ? WHERE cache_key = ?",
            (digest, size, signature, to),
        )


def test_the_submitters_inputs_make_the_reference_through_the_api_and_directly(lab, tmp_path):
    home, farm_env, edge_env, _ = lab
    submit_token = ok_json(farm_env, "token", "create", "--name", "ci", "--role", "submit")
    over_api = {**edge_env, "FARM_TOKEN": submit_token["token"]}
    inputs = tmp_path / "inputs.npz"
    pixels = np.linspace(-2, 2, 3 * 32 * 32, dtype=np.float32).reshape(1, 3, 32, 32)
    np.savez(inputs, x=pixels)
    for number, env in enumerate((over_api, farm_env)):
        model = models.save_ir(models.conv_net(seed=10 + number), tmp_path / f"m{number}" / "m.xml")
        answer = ok_json(env, "submit", str(model), "-d", "CPU", "--inputs", str(inputs), "--wait")
        key = answer["cache_key"]
        (digest,) = sql(home, "SELECT reference_sha256 FROM blobs WHERE cache_key = ?", key)[0]
        reference = Reference.load(home / "store" / "references" / key / f"{digest}.npz")
        assert np.array_equal(reference.inputs["x"], pixels)
        assert ok_json(edge_env, "verify", key)["passed"] is True
    (stored,) = sql(
        home, "SELECT DISTINCT reference_inputs FROM jobs WHERE reference_inputs IS NOT NULL"
    )
    assert (home / "store" / "models" / stored[0]).exists()

    wrong = tmp_path / "wrong.npz"
    np.savez(wrong, pixels=pixels, other=pixels)
    model = models.save_ir(models.conv_net(seed=20), tmp_path / "w" / "m.xml")
    key = ok_json(farm_env, "submit", str(model), "-d", "CPU", "--inputs", str(wrong))["cache_key"]
    ((note,),) = sql(home, "SELECT reference_note FROM blobs WHERE cache_key = ?", key)
    assert "no array for the model's input 'x'" in note
    refused = run_farm(edge_env, "verify", key)
    assert refused.returncode == 3 and "no reference outputs" in refused.stderr

    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"not an npz")
    bad = run_farm(farm_env, "submit", str(model), "-d", "CPU", "--inputs", str(garbage))
    assert bad.returncode == 2 and "not a readable .npz" in bad.stderr


def test_sync_and_the_sdk_verify_once_per_device_and_refusals_report_nothing(lab, tmp_path):
    home, farm_env, edge_env, _ = lab
    model = models.save_ir(models.conv_net(seed=5), tmp_path / "fleet" / "net.xml")
    other = models.save_ir(models.conv_net(seed=6), tmp_path / "other" / "net.xml")
    key, other_key = submit(farm_env, model), submit(farm_env, other)
    manifest = tmp_path / "fleet" / "fleet.toml"
    manifest.write_text('[[model]]\npath = "net.xml"\ndevice = "CPU"\n')
    count = "SELECT count(*) FROM verifications WHERE cache_key = ?"
    for _ in range(2):  # the second pass finds this device's stamp
        (entry,) = ok_json(edge_env, "agent", "sync", str(manifest), "--verify")
        assert (entry["status"], entry["cache_key"]) == ("ready", key)
    assert sql(home, count, key) == [(1,)]
    assert sql(home, "SELECT count(*) FROM pulls WHERE cache_key = ?", key) == [
        (1,)
    ]  # the download

    on_npu = run_farm(edge_env, "verify", key, "--device", "NPU")
    assert on_npu.returncode == 4 and "cannot run on NPU" in on_npu.stderr
    assert sql(home, count, key) == [(1,)]  # not the blob's failure: nothing reported

    _give_reference_of(home, other_key, to=key)  # now key's blob diverges from its reference
    sdk = (
        "import sys, farm.edge\n"
        "try:\n"
        "    farm.edge.compile_model(sys.argv[1], device='CPU', verify=True)\n"
        "except farm.edge.VerificationFailed as error:\n"
        "    print('refused:', error)\n"
    )
    fresh_cache = {**edge_env, "FARM_CACHE_DIR": str(tmp_path / "sdk-cache")}
    done = subprocess.run(
        [sys.executable, "-c", sdk, str(model)],
        env={**os.environ, **fresh_cache},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "refused: blob" in done.stdout and "outside tolerance" in done.stdout
    assert sql(home, "SELECT quarantined_at IS NOT NULL FROM blobs WHERE cache_key = ?", key) == [
        (1,)
    ]
