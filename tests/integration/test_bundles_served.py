"""Pipeline bundles on the served farm (§17), with the real parts: PostgreSQL, Redis, SeaweedFS,
`farm api` and a `farm worker` with OpenVINO GenAI. A tiny LLM folder goes through the API as
a submitter holding only a submit token; its part compiles on the worker in the sandboxed
child; an edge holding only a pull token runs `farm pull FOLDER`, and the ready folder opens
with GenAI without compiling anything and generates the tokens a pipeline built from the
folder generates."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest

pytest.importorskip("openvino_genai")
pytest.importorskip("optimum.intel")

from sqlalchemy import select

from farm.client import FarmClient
from farm.core.bundles import CACHE_FOLDER
from farm.core.clock import now
from farm.core.errors import ApiError
from farm.core.hashing import sha256_file
from farm.core.pipelines import detect, identity
from farm.core.signing import TrustedKeys
from farm.core.spec import Target
from farm.edge.bundle import cache_state, open_bundle, open_properties, read_manifest
from farm.genai import open_pipeline, reference_run, toolchain
from farm.server.bundles.storage import file_storage_key, manifest_storage_key
from farm.server.db.models import BundleBuild, BundlePart
from farm.server.routing import bundle_queue

ROOT = Path(__file__).resolve().parents[2]
CPU = Target.parse("CPU")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def tiny_llm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("llm") / "llm"
    made = subprocess.run(
        [sys.executable, "-m", "tests.genai_models", "llm", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"},
        check=False,
    )
    assert made.returncode == 0, made.stderr[-3000:]
    return out


def _cli(env: dict[str, str], *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """`farm ... --json` as a host holding only `env` (an API URL and a token: no database,
    broker or storage credentials)."""
    result = subprocess.run(
        [sys.executable, "-m", "farm", *args, "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    if check:
        assert result.returncode == 0, result.stderr[-3000:]
    return result


def _env(api, served, home: Path, role: str) -> dict[str, str]:
    return {
        "PATH": os.environ["PATH"],
        "HOME": str(home),
        "FARM_HOME": str(home / "farm"),
        "FARM_API_URL": api.url,
        "FARM_TOKEN": api.tokens[role],
        "FARM_TRUSTED_KEYS": served.env["FARM_TRUSTED_KEYS"],
        "HF_HUB_OFFLINE": "1",
    }


def _parts(served) -> list[BundlePart]:
    with served.sessions() as session:
        return list(session.scalars(select(BundlePart).order_by(BundlePart.id)))


def _build_state(served) -> str | None:
    with served.sessions() as session:
        return session.scalar(select(BundleBuild.state))


def test_a_folder_submitted_through_the_api_is_compiled_by_a_worker_and_pulled_by_an_edge(
    served, api, tiny_llm: Path, tmp_path: Path
) -> None:
    served.start_worker("w1")
    submitter = _env(api, served, tmp_path / "submitter", "submit")
    edge = _env(api, served, tmp_path / "edge", "pull")

    built = json.loads(_cli(submitter, "submit", str(tiny_llm), "--device", "CPU", "--wait").stdout)
    assert built["state"] == "done", built
    [part] = built["parts"]
    assert part["state"] == "done" and part["worker"] == "w1"
    assert part["queue"] == bundle_queue(CPU, toolchain(CPU))
    assert part["queue"].endswith(".with-genai")
    key = built["bundle_key"]
    # The key the farm computed is the one the edge computes offline from its own folder.
    status = json.loads(_cli(edge, "status", key).stdout)
    assert status["state"] == "done" and status["bundle_key"] == key

    ready = tmp_path / "ready"
    pulled = json.loads(
        _cli(edge, "pull", str(tiny_llm), "--device", "CPU", "-o", str(ready)).stdout
    )
    assert pulled["bundle_key"] == key
    with served.sessions() as session:  # the fetch of its manifest is what farm gc reads
        assert session.scalar(select(BundleBuild.pulled_at)) is not None
    trusted = TrustedKeys.from_files([Path(served.env["FARM_TRUSTED_KEYS"])])
    manifest = read_manifest(ready, trusted)
    entries = [f.path for f in manifest.files if f.path.startswith(f"{CACHE_FOLDER}/")]
    assert len(entries) == 1
    # Every file of the manifest is in the store under its sha256, the folder's own included.
    for entry in manifest.files:
        assert served.store.exists(file_storage_key(entry.sha256)), entry.path

    before = cache_state(ready / CACHE_FOLDER)
    pipeline = open_bundle(ready, trusted)
    assert cache_state(ready / CACHE_FOLDER) == before  # nothing compiled on open
    from_bundle = reference_run("llm", pipeline)
    properties = {**open_properties(ready, manifest), "CACHE_DIR": str(tmp_path / "cold")}
    direct = open_pipeline("llm", tiny_llm, "CPU", properties)
    assert sorted(cache_state(tmp_path / "cold")) == [Path(e).name for e in entries]
    assert from_bundle == reference_run("llm", direct) == manifest.reference
    assert len(from_bundle["tokens"]) == 16

    # A second submit of the same folder compiles nothing: the same part row, one attempt.
    stored = served.store.stat(manifest_storage_key(key))
    again = json.loads(_cli(submitter, "submit", str(tiny_llm), "--device", "CPU").stdout)
    assert again["state"] == "done" and again["bundle_key"] == key
    [row] = _parts(served)
    assert row.attempts == 1 and row.state == "done"
    assert served.store.stat(manifest_storage_key(key)) == stored


def _request(folder: Path, **overrides) -> tuple[dict, dict]:
    pipeline = detect(folder)
    files = {path: (sha, pipeline.files[path]) for path, sha in identity(pipeline).items()}
    body = {"pipeline": "llm", "target": "CPU", "options": {}, "toolchain": toolchain(CPU)}
    return files, {**body, **overrides}


def test_the_api_refuses_what_the_embedded_farm_refuses_naming_it(
    served, api, tiny_llm: Path, tmp_path: Path
) -> None:
    client = FarmClient(api.url, api.tokens["submit"])
    try:
        files, body = _request(tiny_llm, options={"max_prompt_len": 256})
        with pytest.raises(ApiError, match="--max-prompt-len applies to NPU targets only"):
            client.submit_bundle(files, body)

        # A folder without its detokenizer (the names as uploaded, without the file).
        files, body = _request(tiny_llm)
        lacking = {p: f for p, f in files.items() if not p.startswith("openvino_detokenizer")}
        with pytest.raises(ApiError, match="openvino_detokenizer"):
            client.submit_bundle(lacking, body)

        # Files never uploaded (a folder whose config differs by a byte): 409 naming them.
        fresh = tmp_path / "fresh"
        shutil.copytree(tiny_llm, fresh)
        with open(fresh / "config.json", "a") as config:
            config.write("\n")
        files, body = _request(fresh)
        with pytest.raises(ApiError) as raised:
            client._call(
                "POST", "/v1/bundles", json={**body, "files": {p: s for p, (s, _) in files.items()}}
            )
        assert raised.value.code == "model_missing"
        assert raised.value.status == 409
        assert sha256_file(fresh / "config.json") in str(raised.value)

        # A toolchain without GenAI's release: the key could not be opened by any edge.
        files, body = _request(tiny_llm)
        partial = {k: v for k, v in toolchain(CPU).items() if k != "openvino_genai"}
        with pytest.raises(ApiError, match="openvino_genai"):
            client.submit_bundle(files, {**body, "toolchain": partial})
    finally:
        client.close()
    assert _parts(served) == []
    with served.sessions() as session:
        assert session.scalar(select(BundleBuild)) is None


def test_a_pipeline_no_live_worker_can_hold_is_refused_naming_both_figures(
    served, api, tiny_llm: Path, tmp_path: Path
) -> None:
    served.start_worker("small", env={"FARM_WORKER_MEMORY_BYTES": str(256 << 20)})
    submitter = _env(api, served, tmp_path / "submitter", "submit")
    refused = _cli(submitter, "submit", str(tiny_llm), "--device", "CPU", check=False)
    assert refused.returncode != 0
    assert "needs about 0.5 GiB" in refused.stderr, refused.stderr
    assert "(small) has 0.2 GiB" in refused.stderr
    assert _parts(served) == []


def test_a_failed_part_fails_its_bundle_with_the_reason(
    served, api, tiny_llm: Path, tmp_path: Path
) -> None:
    served.start_worker("w1")
    broken = tmp_path / "broken"
    shutil.copytree(tiny_llm, broken)
    # Weights of the right name that are not the model's: the compile fails on the worker.
    weights = broken / "openvino_model.bin"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    submitter = _env(api, served, tmp_path / "submitter", "submit")
    failed = _cli(submitter, "submit", str(broken), "--device", "CPU", "--wait", check=False)
    assert failed.returncode != 0
    build = json.loads(failed.stdout)
    assert build["state"] == "failed"
    assert build["error"].startswith("part pipeline ")
    [row] = _parts(served)
    assert row.state == "failed" and row.error
    assert build["error"].endswith(row.error[-200:])


def test_gc_removes_stale_manifests_then_the_files_no_bundle_lists(
    served, api, tiny_llm: Path, tmp_path: Path
) -> None:
    served.start_worker("w1")
    submitter = _env(api, served, tmp_path / "submitter", "submit")
    built = json.loads(_cli(submitter, "submit", str(tiny_llm), "--device", "CPU", "--wait").stdout)
    assert built["state"] == "done", built
    key = built["bundle_key"]
    manifest = json.loads(served.store.open_read(manifest_storage_key(key)).read())["manifest"]
    listed = {entry["sha256"] for entry in manifest["files"]}
    stray = tmp_path / "stray"
    stray.write_bytes(b"no bundle lists this")
    served.store.put_file(file_storage_key(sha256_file(stray)), stray)
    no_grace = {"FARM_MODEL_GRACE_SECONDS": "0"}

    # Fresh (pulled or submitted within a day): the manifest and what it lists stay.
    report = served.farm_json("gc", "--unpulled-days", "1", env=no_grace)
    assert report["bundles"] == []
    assert [f["sha256"] for f in report["bundle_files"]] == [sha256_file(stray)]
    assert not served.store.exists(file_storage_key(sha256_file(stray)))
    assert all(served.store.exists(file_storage_key(sha)) for sha in listed)

    # Unused for 0 days: a dry run lists it and changes nothing.
    dry = served.farm_json("gc", "--unpulled-days", "0", "--dry-run", env=no_grace)
    assert [b["bundle_key"] for b in dry["bundles"]] == [key]
    assert {f["sha256"] for f in dry["bundle_files"]} == listed
    assert served.store.exists(manifest_storage_key(key))

    report = served.farm_json("gc", "--unpulled-days", "0", env=no_grace)
    assert [b["bundle_key"] for b in report["bundles"]] == [key]
    assert {f["sha256"] for f in report["bundle_files"]} == listed
    assert not served.store.exists(manifest_storage_key(key))
    assert not any(served.store.exists(file_storage_key(sha)) for sha in listed)
    with served.sessions() as session:
        build = session.scalar(select(BundleBuild))
        assert build.state == "failed" and build.error.startswith("removed by farm gc")
    [row] = _parts(served)
    assert row.state == "failed"

    # Submitted again: compiled again (the folder's files uploaded again), published again.
    again = json.loads(_cli(submitter, "submit", str(tiny_llm), "--device", "CPU", "--wait").stdout)
    assert again["state"] == "done" and again["bundle_key"] == key
    [row] = _parts(served)
    assert row.state == "done" and row.attempts == 1
    # Every file the new manifest lists is stored (a CPU compile is not byte-for-byte
    # repeatable: its cache entries may differ from the first build's).
    manifest = json.loads(served.store.open_read(manifest_storage_key(key)).read())["manifest"]
    assert all(served.store.exists(file_storage_key(e["sha256"])) for e in manifest["files"])


def test_a_lost_part_message_and_a_dead_workers_part_are_sent_again(served, tiny_llm: Path) -> None:
    from farm.core.pipelines import GenAIOptions, context_length
    from farm.server.bundles import builds
    from farm.server.jobs.dispatch import StubDispatcher
    from tests.integration.faults import TcpProxy
    from tests.integration.served import wait_until

    pipeline = detect(tiny_llm)
    options = GenAIOptions.create("llm", CPU, context_length=context_length(pipeline))
    with served.sessions() as session:  # committed, its message never sent (a lost message)
        built = builds.submit_folder(
            session, served.store, served.settings, StubDispatcher(), pipeline, options
        )
    [row] = _parts(served)
    assert row.state == "queued"
    # w1's store stops answering once w1 is up, so the part it claims stays running until it is
    # killed: a tiny pipeline otherwise compiles in about a second, and a full suite's load
    # once let the claim and the result fall between two polls.
    store = TcpProxy(int(urlsplit(served.env["FARM_S3_ENDPOINT_URL"]).port or 80))
    store.start()
    try:
        served.start_worker("w1", env={"FARM_S3_ENDPOINT_URL": f"http://127.0.0.1:{store.port}"})
        store.stalled.set()
        report = served.farm_json("reconcile", env={"FARM_RESEND_AFTER_SECONDS": "0"})
        assert report["bundle_parts"]["resent"] == [row.id]
        # 180 s: a claim took over 60 s once, in the first minutes of a full suite on 2 cores.
        wait_until(lambda: _parts(served)[0].state == "running", 180, "w1 to claim the part")
        served.kill_worker("w1")  # SIGKILL to the worker, its pool and the compile child
    finally:
        store.cut()
    assert _parts(served)[0].state == "running"  # nobody told the database
    served.start_worker("w2")
    wait_until(lambda: _parts(served)[0].lease_expires_at < now(), 30, "the lease to expire")
    report = served.farm_json("reconcile")
    assert report["bundle_parts"]["taken_back"] == [row.id]
    assert report["bundle_parts"]["resent"] == [row.id]
    wait_until(lambda: _build_state(served) == "done", 120, "w2 to compile and publish")
    [row] = _parts(served)
    assert (row.worker, row.attempts) == ("w2", 2)
    assert served.store.exists(manifest_storage_key(built["bundle_key"]))


@pytest.fixture(scope="session")
def two_text2image(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two Stable Diffusion folders of different text encoders and UNets and the same VAE."""
    pytest.importorskip("diffusers")
    base = tmp_path_factory.mktemp("text2image")
    built = []
    for name, seed in (("first", "0"), ("second", "1")):
        out = base / name
        made = subprocess.run(
            [sys.executable, "-m", "tests.genai_models", "text2image", str(out), seed],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=900,
            env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"},
            check=False,
        )
        assert made.returncode == 0, made.stderr[-3000:]
        built.append(out)
    first, second = built
    shutil.rmtree(second / "vae_decoder")
    shutil.copytree(first / "vae_decoder", second / "vae_decoder")
    return first, second


def test_sub_model_parts_compile_in_parallel_on_two_workers_and_a_shared_vae_once(
    served, api, two_text2image: tuple[Path, Path], tmp_path: Path
) -> None:
    from farm.edge.bundle import verify_bundle

    first, second = two_text2image
    served.start_worker("w1")
    served.start_worker("w2")
    submitter = _env(api, served, tmp_path / "submitter", "submit")
    built = json.loads(_cli(submitter, "submit", str(first), "--device", "CPU", "--wait").stdout)
    assert built["state"] == "done", built
    assert [p["name"] for p in built["parts"]] == ["text_encoder", "unet", "vae_decoder"]
    # One compile at a time per worker, one message held each: both workers took parts.
    assert {p["worker"] for p in built["parts"]} == {"w1", "w2"}

    again = json.loads(_cli(submitter, "submit", str(second), "--device", "CPU", "--wait").stdout)
    assert again["state"] == "done", again
    rows = _parts(served)
    assert len(rows) == 5  # the VAE decoder's part is the first bundle's
    keys = [{p["name"]: p["part_key"] for p in b["parts"]} for b in (built, again)]
    assert keys[0]["vae_decoder"] == keys[1]["vae_decoder"]
    assert keys[0]["unet"] != keys[1]["unet"]
    assert all(row.attempts == 1 for row in rows)

    edge = _env(api, served, tmp_path / "edge", "pull")
    ready = tmp_path / "ready"
    _cli(edge, "pull", str(second), "--device", "CPU", "-o", str(ready))
    trusted = TrustedKeys.from_files([Path(served.env["FARM_TRUSTED_KEYS"])])
    report = verify_bundle(ready, trusted)
    assert report["compiled_on_open"] == []  # the parts' entries are the pipeline's
    assert report["got"] == read_manifest(ready, trusted).reference
