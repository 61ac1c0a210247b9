"""The fleet as a test lab, for real on CPU: workers store reference outputs beside each blob,
an edge verifies blobs through the API (IR, and an ONNX model the onnx package ships), and a
genuinely divergent blob (compiled from a model whose weights differ from its reference) fails,
is quarantined, is refused by edges, and is replaced by a rebuild, its history kept.

The reference follows the blob (the embedded `farm submit` returns when the blob is stored; a
detached process computes it): `farm verify` waits while it is pending, and past `--wait` it
has not judged the blob (exit 4, nothing reported); the reconciler runs a lost one again."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import time
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
from tests.integration.test_edge_trust import _BLOB, SwappingProxy

SQUEEZENET = Path(onnx.__file__).parent / "backend/test/data/light/light_squeezenet.onnx"


@pytest.fixture
def lab(tmp_path):
    home = tmp_path / "farm"
    farm_env = {"FARM_HOME": str(home)}
    pull = ok_json(farm_env, "token", "create", "--name", "edge", "--role", "pull")["token"]
    # /metrics right after a change: no per-process cache (it is computed as the API starts).
    api_env = {**farm_env, "FARM_METRICS_CACHE_SECONDS": "0"}
    api = ApiServer(api_env, tmp_path / "api.log").start()
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


def submit(farm_env: dict, model: Path, *extra: str, settle: bool = True) -> str:
    """The model's cache key, its job succeeded; `settle`: once its reference run (which
    follows the blob, in a process of its own) has ended."""
    answer = ok_json(farm_env, "submit", str(model), "--device", "CPU", *extra)
    assert answer["job"]["state"] == "succeeded", answer
    if settle:
        settled(Path(farm_env["FARM_HOME"]), answer["cache_key"])
    return answer["cache_key"]


def settled(home: Path, key: str, timeout: float = 120) -> str:
    """The blob's reference state once it is no longer pending."""
    deadline = time.monotonic() + timeout
    while True:
        ((state,),) = sql(home, "SELECT reference_state FROM blobs WHERE cache_key = ?", key)
        if state != "pending":
            return state
        assert time.monotonic() < deadline, f"blob {key}'s reference still pending"
        time.sleep(0.1)


def test_blobs_of_ir_and_onnx_models_verify_on_this_cpu(lab, tmp_path):
    home, farm_env, edge_env, _ = lab
    onnx_model = shutil.copy(SQUEEZENET, tmp_path / "squeezenet.onnx")
    ir_model = models.save_ir(models.conv_net(seed=3), tmp_path / "ir" / "conv.xml")
    # The onnx package's SqueezeNet (random weights) computed in bf16 on this input is another
    # classifier (next test): pinned to f32 it verifies on every CPU.
    for model, extra in ((ir_model, ()), (Path(onnx_model), ("--config", F32))):
        key = submit(farm_env, model, *extra, settle=False)
        # Verified at once: the edge waits for the reference, which follows the blob.
        verified = ok_json(edge_env, "verify", key, "--runs", "5")
        (digest, size, signed, note, state) = sql(
            home,
            "SELECT reference_sha256, reference_size_bytes, reference_signature, reference_note, "
            "reference_state FROM blobs WHERE cache_key = ?",
            key,
        )[0]
        assert len(digest) == 64 and size > 0 and signed and note is None and state == "ready"
        phases = sql(
            home,
            "SELECT phase FROM job_phases WHERE job_id = (SELECT job_id FROM blobs "
            "WHERE cache_key = ?) ORDER BY id",
            key,
        )
        assert [p for (p,) in phases] == ["fetch", "compile", "upload", "record", "reference"]
        assert verified["passed"] is True and verified["farm"]["quarantined"] is False
        assert verified["tolerance"] == _tolerance_of_this_cpu("f32" if extra else None)
        assert verified["min_cosine"] >= verified["tolerance"]["min_cosine"]
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


F32 = "INFERENCE_PRECISION_HINT=f32"


def _precision_of_this_cpu() -> str | None:
    """What this CPU computes a default CPU blob in: f32, or bf16 on a CPU with AMX or
    AVX512-BF16 (OpenVINO's default there)."""
    import openvino as ov
    from openvino import opset13 as ops

    from farm.edge.verify import precision_name

    x = ops.parameter([4], ov.Type.f32, name="x")
    compiled = ov.Core().compile_model(ov.Model([ops.relu(x)], [x]), "CPU")
    return precision_name(compiled.get_property("INFERENCE_PRECISION_HINT"))


def _tolerance_of_this_cpu(precision: str | None = None) -> dict:
    """The tolerance row of `precision` (default: what this CPU computes a default blob in)."""
    import dataclasses

    from farm.core.tolerance import default_tolerance

    return dataclasses.asdict(default_tolerance("CPU", precision or _precision_of_this_cpu()))


def test_a_model_that_bf16_changes_fails_verification_on_a_bf16_cpu(lab, tmp_path):
    """On a CPU that computes in bf16 by default (AMX Xeons), the onnx package's SqueezeNet
    gives another answer than its f32 reference (its softmax flattens): the edge's verification
    says so and the blob is quarantined, though nothing in it is corrupt. Pinned to f32, the
    same model's blob verifies (previous test)."""
    if _precision_of_this_cpu() != "bf16":
        pytest.skip("this CPU computes a default blob in f32")
    _, farm_env, edge_env, _ = lab
    # Fixed inputs (the seeded ones follow the key, hence the CPU and the release): bf16
    # flattens the softmax on this one, not on every input.
    image = np.random.default_rng(0).uniform(-1, 1, (1, 3, 224, 224)).astype(np.float32)
    np.savez(tmp_path / "inputs.npz", data_0=image)
    model = Path(shutil.copy(SQUEEZENET, tmp_path / "squeezenet.onnx"))
    key = submit(farm_env, model, "--inputs", str(tmp_path / "inputs.npz"))
    failed = run_farm(edge_env, "verify", key, "--json")
    assert failed.returncode == 9, failed.stderr
    report = json.loads(failed.stdout)
    assert report["passed"] is False and report["farm"]["quarantined"] is True
    assert report["tolerance"] == _tolerance_of_this_cpu("bf16")
    [output] = report["outputs"]
    assert output["name"] == "softmaxout_1" and output["passed"] is False


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
    fresh = {**edge_env, "FARM_CACHE_DIR": str(tmp_path / "fresh-cache")}
    withheld = run_farm(fresh, "pull", key_a, "--allow-quarantined", "--json")
    assert withheld.returncode == 9 and "hands it to no edge" in withheld.stderr
    admin = ok_json(farm_env, "token", "create", "--name", "root", "--role", "admin")["token"]
    as_admin = {**fresh, "FARM_TOKEN": admin}
    anyway = run_farm(as_admin, "pull", key_a, "--allow-quarantined", "--import", "--json")
    assert anyway.returncode == 0, anyway.stderr  # its ok pull report is refused, not its import
    assert sql(home, "SELECT count(*) FROM pulls WHERE cache_key = ? AND ok", key_a) == [(0,)]
    assert "QUARANTINED" in run_farm(farm_env, "status", key_a).stdout
    metrics = httpx.get(
        f"{api.url}/metrics", headers={"Authorization": f"Bearer {edge_env['FARM_TOKEN']}"}
    )
    assert 'farm_verifications_total{result="failed",target="CPU"} 1.0' in metrics.text
    assert 'farm_blobs_quarantined{target="CPU"} 1.0' in metrics.text

    # CPU compiles are deterministic: the rebuild makes the same bytes, which stay quarantined.
    assert submit(farm_env, model_a, "--rebuild") == key_a
    ((reason,),) = sql(home, "SELECT quarantine_reason FROM blobs WHERE cache_key = ?", key_a)
    assert reason.startswith("rebuilt into the same bytes as the blob quarantined before it")
    still = run_farm(edge_env, "verify", key_a)
    assert still.returncode == 9 and "quarantined" in still.stderr
    ok_json(farm_env, "blobs", "release", key_a)  # only an admin lifts it
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
        settled(home, key)
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
    assert settled(home, key) == "skipped"
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


def _silero_vad() -> Path:
    """The voice-activity model the `silero-vad` wheel ships (installed with --no-deps by
    scripts/test: only its model file is used): a scalar int64 `sr`, a recurrent `state`."""
    import importlib.util

    found = importlib.util.find_spec("silero_vad")  # not imported: it imports torch
    if found is None or not found.submodule_search_locations:
        if os.environ.get("CI") == "true":
            raise AssertionError("silero-vad is not installed: pip install --no-deps silero-vad")
        pytest.skip("pip install --no-deps silero-vad (scripts/test does)")
    return Path(found.submodule_search_locations[0]) / "data" / "silero_vad_op18_ifless.onnx"


def test_scalar_int64_and_recurrent_state_inputs_verify_and_keep_their_shapes(lab, tmp_path):
    home, farm_env, edge_env, _ = lab
    model = models.save_ir(models.stateful_scalar_net(), tmp_path / "vad" / "vad.xml")
    key = submit(farm_env, model)  # seeded inputs, a 0-d gain and sample rate among them
    (digest,) = sql(home, "SELECT reference_sha256 FROM blobs WHERE cache_key = ?", key)[0]
    reference = Reference.load(home / "store" / "references" / key / f"{digest}.npz")
    shapes = {name: (value.shape, value.dtype.name) for name, value in reference.inputs.items()}
    assert shapes == {
        "input": ((1, 16), "float32"),
        "gain": ((), "float32"),
        "sr": ((), "int64"),
        "state": ((2, 1, 8), "float32"),
    }
    assert list(reference.outputs) == ["prob", "stateN"]
    verified = ok_json(edge_env, "verify", key)
    assert verified["passed"] is True and verified["outcome"] == "passed"
    assert [o["name"] for o in verified["outputs"]] == ["prob", "stateN"]
    assert verified["tolerance"]["atol"] <= 4e-2  # f32 or bf16 on this CPU, never looser

    # --inputs on a hit: not silently ignored.
    inputs = tmp_path / "vad-inputs.npz"
    np.savez(
        inputs,
        input=np.full((1, 16), 0.25, np.float32),
        gain=np.float32(2.0),
        sr=np.int64(8000),
        state=np.zeros((2, 1, 8), np.float32),
    )
    hit = ok_json(farm_env, "submit", str(model), "-d", "CPU", "--inputs", str(inputs))
    assert hit["outcome"] == "hit" and "--inputs not used" in hit["reason"]
    said = run_farm(farm_env, "submit", str(model), "-d", "CPU", "--inputs", str(inputs))
    assert said.returncode == 0 and "inputs seeded from the cache key" in said.stdout


def test_a_real_speech_model_with_a_scalar_sample_rate_verifies_with_0_d_inputs(lab, tmp_path):
    """The trial's model: a third-party voice-activity ONNX model (scalar int64 `sr`, dynamic
    audio, recurrent state) whose blob was bit-identical to a direct compile and yet failed
    verification and was quarantined. Its reference inputs are the submitter's (0-d `sr`)."""
    home, farm_env, edge_env, _ = lab
    model = Path(shutil.copy(_silero_vad(), tmp_path / "silero_vad.onnx"))
    inputs = tmp_path / "speech.npz"
    audio = np.sin(np.linspace(0, 200, 512, dtype=np.float32))[None, :] * 0.3
    np.savez(inputs, input=audio, sr=np.int64(16000), state=np.zeros((2, 1, 128), np.float32))
    key = submit(farm_env, model, "--inputs", str(inputs))
    (digest, note) = sql(
        home, "SELECT reference_sha256, reference_note FROM blobs WHERE cache_key = ?", key
    )[0]
    assert digest and note is None, note
    reference = Reference.load(home / "store" / "references" / key / f"{digest}.npz")
    assert reference.inputs["sr"].shape == () and int(reference.inputs["sr"]) == 16000
    verified = ok_json(edge_env, "verify", key, "--runs", "3")
    assert verified["passed"] is True, verified
    assert {o["name"] for o in verified["outputs"]} == {"output", "stateN"}
    assert sql(home, "SELECT quarantined_at FROM blobs WHERE cache_key = ?", key) == [(None,)]


def test_a_harness_error_is_reported_as_such_and_never_quarantines(lab, tmp_path):
    """Reference inputs that do not fit the blob (here: another model's) say nothing about its
    numbers: an error of the verification (exit 4, one line), recorded, never a quarantine."""
    home, farm_env, edge_env, _ = lab
    conv = submit(farm_env, models.save_ir(models.conv_net(seed=8), tmp_path / "c" / "c.xml"))
    vad = submit(farm_env, models.save_ir(models.stateful_scalar_net(), tmp_path / "v" / "v.xml"))
    _give_reference_of(home, vad, to=conv)
    done = run_farm(edge_env, "verify", conv, "--json")
    assert done.returncode == 4, done.stderr
    report = json.loads(done.stdout)
    assert report["outcome"] == "error" and report["farm"]["quarantined"] is False
    assert report["error"] == (
        "the reference has 4 inputs (input, gain, sr, state); the blob takes 1 (x)"
    )
    human = run_farm(edge_env, "verify", conv)
    assert "verification ERROR, nothing counted against the blob" in human.stdout
    rows = sql(
        home, "SELECT passed, error IS NOT NULL FROM verifications WHERE cache_key = ?", conv
    )
    assert rows == [(0, 1), (0, 1)]
    assert sql(home, "SELECT quarantined_at FROM blobs WHERE cache_key = ?", conv) == [(None,)]


class RewritingProxy(SwappingProxy):
    """Forwards everything to the API, but passes each blob record through `rewrite`: what a
    man in the middle on plain HTTP can do to the farm's answers."""

    rewrite = staticmethod(lambda record: record)

    def answer(self, request) -> None:
        match = _BLOB.match(request.path)
        if match and not match[2] and request.command == "GET":
            status, headers, body = self.forward("GET", request.path, None, {})
            if status == 200:
                body = json.dumps(self.rewrite(json.loads(body))).encode()
            return self.send(request, status, body, headers)
        return super().answer(request)


def test_a_quarantine_holds_through_a_proxy_and_an_expired_status_is_refused(lab, tmp_path):
    home, farm_env, edge_env, api = lab
    key = submit(farm_env, models.save_ir(models.conv_net(seed=9), tmp_path / "q" / "q.xml"))
    ok_json(farm_env, "blobs", "quarantine", key, "--reason", "crashed an NPU")
    proxy = RewritingProxy(int(api.url.rsplit(":", 1)[1]), edge_env["FARM_TOKEN"])
    through = {**edge_env, "FARM_API_URL": proxy.url}
    try:
        proxy.rewrite = staticmethod(
            lambda r: {**r, "quarantined_at": None, "quarantine_reason": None}
        )
        stripped = run_farm(through, "pull", key)
        assert stripped.returncode == 9 and "quarantined" in stripped.stderr, stripped.stderr
        proxy.rewrite = staticmethod(
            lambda r: {k: v for k, v in r.items() if k not in ("quarantined_at", "status")}
        )
        unsigned = run_farm(through, "pull", key)
        assert unsigned.returncode == 8 and "no signed status" in unsigned.stderr
        # The API itself hands a pull token no download and takes no ok pull of it.
        headers = {"Authorization": f"Bearer {edge_env['FARM_TOKEN']}"}
        download = httpx.get(f"{api.url}/v1/blobs/{key}/download", headers=headers)
        assert (download.status_code, download.json()["code"]) == (409, "quarantined")
        pull = {"agent_id": "edge-7", "ok": True}
        reported = httpx.post(f"{api.url}/v1/blobs/{key}/pulls", json=pull, headers=headers)
        assert reported.status_code == 409

        # An "ok" the farm signed two hours ago, replayed after the quarantine: expired.
        ok_json(farm_env, "blobs", "release", key)
        old = _status_signed(home, key, signed_ago=7200)
        ok_json(farm_env, "blobs", "quarantine", key, "--reason", "crashed an NPU")
        proxy.rewrite = staticmethod(
            lambda r: {**r, "quarantined_at": None, "quarantine_reason": None, "status": old}
        )
        replayed = run_farm(through, "pull", key)
        assert replayed.returncode == 8 and "expired" in replayed.stderr, replayed.stderr
        assert not list((tmp_path / "edge-cache").glob(f"**/{key}.blob"))
    finally:
        proxy.stop()


def _status_signed(home: Path, key: str, signed_ago: int) -> dict:
    """The status the farm's key signed `signed_ago` seconds ago, with the default lifetime."""
    import time

    from farm.core.apikey import ApiSigner
    from farm.core.status import StatusSigner

    ((sha,),) = sql(home, "SELECT sha256 FROM blobs WHERE cache_key = ?", key)
    signer = StatusSigner(ApiSigner(Signer.from_file(home / "keys" / "signing.pem")), 3600)
    return signer.signed(key, sha, False, time.time() - signed_ago)


def test_a_pull_token_resolves_a_key_prefix_on_the_edge(lab, tmp_path):
    _, farm_env, edge_env, api = lab
    key = submit(farm_env, models.save_ir(models.conv_net(seed=12), tmp_path / "p" / "p.xml"))
    prefix = key[:10]
    pulled = ok_json(edge_env, "pull", prefix)
    assert pulled["cache_key"] == key
    assert ok_json(edge_env, "verify", prefix)["cache_key"] == key
    status = ok_json(edge_env, "status", prefix)
    assert status["cache_key"] == key and status["blob"]["cache_key"] == key
    assert status["job"] is None  # a pull token reads no jobs
    headers = {"Authorization": f"Bearer {edge_env['FARM_TOKEN']}"}
    listed = httpx.get(f"{api.url}/v1/cache-keys", params={"prefix": prefix}, headers=headers)
    assert listed.json() == {"cache_keys": [key]}
    short = run_farm(edge_env, "pull", key[:7])
    assert short.returncode == 2 and "too short" in short.stderr


def test_an_api_with_a_certified_status_key_of_its_own_is_trusted_by_edges(lab, tmp_path):
    """`farm keys create-status` where the signing key is, FARM_STATUS_KEY on the API: edges
    that trust only the signing key accept its statuses, through the certificate."""
    home, farm_env, edge_env, _ = lab
    key = submit(farm_env, models.save_ir(models.conv_net(seed=14), tmp_path / "s" / "s.xml"))
    status_key = tmp_path / "api-keys" / "status.pem"
    made = ok_json(farm_env, "keys", "create-status", str(status_key))
    assert made["certified_by"] == Signer.from_file(home / "keys" / "signing.pem").key_id
    again = ok_json(farm_env, "keys", "create-status", str(status_key), "--if-missing")
    assert again["key_id"] == made["key_id"]
    api = ApiServer({**farm_env, "FARM_STATUS_KEY": str(status_key)}, tmp_path / "a2.log")
    api.start()
    try:
        edge = {**edge_env, "FARM_API_URL": api.url}
        headers = {"Authorization": f"Bearer {edge_env['FARM_TOKEN']}"}
        status = httpx.get(f"{api.url}/v1/blobs/{key}", headers=headers).json()["status"]
        assert status["signing_key_id"] == made["key_id"]
        assert status["certificate"]["signer_id"] == made["certified_by"]
        assert status["document"]["expires_at"] - status["document"]["signed_at"] == 3600
        assert ok_json(edge, "pull", key)["cache_key"] == key
    finally:
        api.stop()


def _make_pending(home: Path, key: str, attempts: int, lease: str) -> None:
    """The blob's reference as a run in progress leaves it (`lease`: until when it holds)."""
    with sqlite3.connect(home / "farm.db") as connection:
        connection.execute(
            "UPDATE blobs SET reference_state = 'pending', reference_sha256 = NULL, "
            "reference_size_bytes = NULL, reference_signature = NULL, reference_attempts = ?, "
            "reference_lease_expires_at = ? WHERE cache_key = ?",
            (attempts, lease, key),
        )


def test_a_pending_reference_is_not_judged_and_a_lost_run_is_run_again_or_skipped(lab, tmp_path):
    home, farm_env, edge_env, _ = lab
    key = submit(farm_env, models.save_ir(models.conv_net(seed=15), tmp_path / "r" / "r.xml"))
    ((blob_id, job_id),) = sql(home, "SELECT id, job_id FROM blobs WHERE cache_key = ?", key)
    _make_pending(home, key, 1, "2999-01-01 00:00:00.000000")  # a live run holds it

    waited = run_farm(edge_env, "verify", key, "--wait", "1", "--json")
    assert waited.returncode == 4, waited.stderr
    assert "not judged yet" in waited.stderr and "still being computed" in waited.stderr
    assert sql(home, "SELECT count(*) FROM verifications") == [(0,)]  # nothing reported
    assert sql(home, "SELECT quarantined_at FROM blobs WHERE id = ?", blob_id) == [(None,)]
    assert "reference  outputs pending" in run_farm(farm_env, "status", key).stdout
    quiet = ok_json(farm_env, "reconcile")  # a live lease: not the reconciler's
    assert quiet["references_resent"] == [] and quiet["references_skipped"] == []

    # Its process died: the lease expired. The reconciler runs it again (a detached process
    # here, the embedded farm's), as the blob's second attempt.
    _make_pending(home, key, 1, "2000-01-01 00:00:00.000000")
    again = ok_json(farm_env, "reconcile")
    assert again["references_resent"] == [blob_id]
    assert settled(home, key) == "ready"
    assert sql(home, "SELECT reference_attempts FROM blobs WHERE id = ?", blob_id) == [(2,)]
    assert ok_json(edge_env, "verify", key)["passed"] is True
    phases = sql(
        home, "SELECT count(*) FROM job_phases WHERE phase = 'reference' AND job_id = ?", job_id
    )
    assert phases == [(2,)]  # the first run's and the second's

    # Past its attempts (FARM_MAX_ATTEMPTS, 3): recorded skipped, saying why.
    _make_pending(home, key, 3, "2000-01-01 00:00:00.000000")
    gave_up = ok_json(farm_env, "reconcile")
    assert gave_up["references_skipped"] == [blob_id] and gave_up["references_resent"] == []
    ((state, note),) = sql(
        home, "SELECT reference_state, reference_note FROM blobs WHERE id = ?", blob_id
    )
    assert state == "skipped" and "3 runs ended without a result" in note
    refused = run_farm(edge_env, "verify", key)
    assert refused.returncode == 3 and "no reference outputs" in refused.stderr


def test_embedded_verify_sends_a_lost_reference_run_again_itself(lab, tmp_path):
    """The embedded farm has no reconciler running: `farm verify --wait` on it, finding the
    reference pending, sends a run whose detached process died again; a live one it leaves."""
    home, farm_env, _, _ = lab
    key = submit(farm_env, models.save_ir(models.conv_net(seed=16), tmp_path / "e" / "e.xml"))
    ((blob_id,),) = sql(home, "SELECT id FROM blobs WHERE cache_key = ?", key)

    _make_pending(home, key, 1, "2999-01-01 00:00:00.000000")  # a live run holds it
    waited = run_farm(farm_env, "verify", key, "--wait", "1", "--json")
    assert waited.returncode == 4 and "not judged yet" in waited.stderr, waited.stderr
    assert sql(home, "SELECT reference_attempts FROM blobs WHERE id = ?", blob_id) == [(1,)]

    _make_pending(home, key, 1, "2000-01-01 00:00:00.000000")  # its process died
    verified = ok_json(farm_env, "verify", key, "--wait", "60")
    assert verified["passed"] is True
    assert sql(
        home, "SELECT reference_state, reference_attempts FROM blobs WHERE id = ?", blob_id
    ) == [("ready", 2)]
