"""Bundle parts with real OpenVINO GenAI on CPU (docs/architecture.md §17, "Parts"): a tiny
Stable Diffusion pipeline built here (tests/genai_models.py) compiles as three parts — text
encoder, UNet, VAE decoder, each with GenAI's own class — whose cache entries the pipeline then
loads; the same VAE in two pipelines compiles once."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("openvino_genai")
pytest.importorskip("diffusers")

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from farm.core.bundles import CACHE_FOLDER
from farm.core.errors import CompileError
from farm.core.pipelines import PipelineFolder, detect
from farm.core.signing import Signer, TrustedKeys
from farm.core.spec import Target
from farm.edge.bundle import FolderSource, cache_state, open_bundle, pull, verify_bundle
from farm.genai import REFERENCE_IMAGE, REFERENCE_PROMPT, open_pipeline, toolchain
from farm.server.bundles.parts import (
    Part,
    PartOutput,
    build_parts,
    check_parts,
    in_process,
    plan_parts,
    sandboxed_check,
    sandboxed_part,
)
from farm.server.bundles.service import build_bundle, key_of, options_for
from farm.server.jobs.runner import RunLimits
from farm.server.storage.local import LocalStore

ROOT = Path(__file__).resolve().parents[2]
CPU = Target.parse("CPU")
pytestmark = pytest.mark.slow


def _build(out: Path, seed: int) -> Path:
    made = subprocess.run(
        [sys.executable, "-m", "tests.genai_models", "text2image", str(out), str(seed)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"},
        check=False,
    )
    assert made.returncode == 0, made.stderr[-3000:]
    return out


@pytest.fixture(scope="session")
def two_pipelines(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two text-to-image folders of different text encoders and UNets and the same VAE."""
    base = tmp_path_factory.mktemp("text2image")
    first, second = _build(base / "first", 0), _build(base / "second", 1)
    shutil.rmtree(second / "vae_decoder")
    shutil.copytree(first / "vae_decoder", second / "vae_decoder")
    return first, second


@pytest.fixture
def signer() -> Signer:
    return Signer(Ed25519PrivateKey.generate())


def _image(pipeline: object) -> bytes:
    image = pipeline.generate(REFERENCE_PROMPT, **REFERENCE_IMAGE)  # type: ignore[attr-defined]
    return bytes(image.data)


Compile = Callable[[PipelineFolder, object, Part, Path], PartOutput]


def _counting(compile: Compile, names: list[str]) -> Compile:
    def run(folder: PipelineFolder, options: object, part: Part, work: Path) -> PartOutput:
        names.append(part.name)
        return compile(folder, options, part, work)

    return run


def test_sub_models_compile_apart_and_the_pipeline_opens_with_nothing_compiled(
    two_pipelines: tuple[Path, Path], signer: Signer, tmp_path: Path
) -> None:
    first, _ = two_pipelines
    pipeline = detect(first)
    options = options_for(pipeline, CPU)
    parts = plan_parts(first, None, CPU, options, toolchain(CPU))
    assert [p.name for p in parts] == ["text_encoder", "unet", "vae_decoder"]
    assert sorted(parts[2].files) == [
        "vae_decoder/config.json",
        "vae_decoder/openvino_model.bin",
        "vae_decoder/openvino_model.xml",
    ]
    compiled: list[str] = []
    store = LocalStore(tmp_path / "store")
    signed = build_bundle(store, signer, pipeline, options, _counting(in_process, compiled))
    assert compiled == ["text_encoder", "unet", "vae_decoder"]
    key = key_of(pipeline, options)
    assert signed["manifest"]["bundle_key"] == key
    ready = tmp_path / "ready"
    manifest = pull(
        FolderSource(tmp_path / "store"),
        key,
        ready,
        TrustedKeys({}).with_key(signer.public_key),
        local=first,
    )
    entries = [f.path for f in manifest.files if f.path.startswith(f"{CACHE_FOLDER}/")]
    assert len(entries) == 3  # one per sub-model; GenAI caches no tokenizer
    before = cache_state(ready / CACHE_FOLDER)
    opened = open_bundle(ready)
    # Each part's entry, compiled apart by its GenAI class, is the pipeline's: nothing written.
    assert cache_state(ready / CACHE_FOLDER) == before
    direct = open_pipeline("text2image", first, "CPU", options.properties())
    assert _image(opened) == _image(direct)  # the same image from the same seed
    report = verify_bundle(ready)
    assert report["compiled_on_open"] == [] and report["got"] == manifest.reference


def test_a_vae_shared_by_two_pipelines_compiles_once(
    two_pipelines: tuple[Path, Path], signer: Signer, tmp_path: Path
) -> None:
    first, second = two_pipelines
    store = LocalStore(tmp_path / "store")
    compiled: list[str] = []
    compile = _counting(sandboxed_part(RunLimits(max_run_seconds=600)), compiled)
    bundles = []
    for folder in (first, second):
        pipeline = detect(folder)
        bundles.append(build_bundle(store, signer, pipeline, options_for(pipeline, CPU), compile))
    # The embedded farm's sandboxed children compiled the VAE for the first pipeline only.
    assert compiled == ["text_encoder", "unet", "vae_decoder", "text_encoder", "unet"]
    stored_parts = sorted((tmp_path / "store" / "bundle-parts").iterdir())
    assert len(stored_parts) == 5
    caches = [
        {f["path"]: f["sha256"] for f in b["manifest"]["files"] if f["path"].startswith("cache/")}
        for b in bundles
    ]
    shared = set(caches[0].items()) & set(caches[1].items())
    assert len(shared) == 1  # the VAE's entry, listed by both bundles
    ready = tmp_path / "second"
    pull(
        FolderSource(tmp_path / "store"),
        bundles[1]["manifest"]["bundle_key"],
        ready,
        TrustedKeys({}).with_key(signer.public_key),
    )
    assert verify_bundle(ready)["compiled_on_open"] == []


def test_the_assembled_pipeline_is_opened_in_the_sandboxed_child_under_its_limits(
    two_pipelines: tuple[Path, Path], signer: Signer, tmp_path: Path
) -> None:
    """The last step of a bundle of sub-model parts opens the whole pipeline on the parts' cache
    entries: in a child with the compile's limits (never in the process that holds the signing
    key), with the same reference run as in this process."""
    first, _ = two_pipelines
    pipeline = detect(first)
    options = options_for(pipeline, CPU)
    store = LocalStore(tmp_path / "store")
    built = build_parts(store, pipeline, options, toolchain(CPU), signer)  # checked in process
    in_child = sandboxed_check(RunLimits(max_run_seconds=600))
    assert check_parts(store, pipeline, options, built.files, in_child) == built.reference
    assert len(built.reference["image_sha256"]) == 64
    # Under the compile's memory limit: one too small to open the pipeline in fails the check.
    starved = sandboxed_check(RunLimits(max_run_seconds=600, memory_bytes=256 << 20))
    with pytest.raises(CompileError, match="memory limit"):
        check_parts(store, pipeline, options, built.files, starved)
    # A part's entry missing: the child's pipeline compiles it on open, and says so.
    entries = [f for f in built.files if f.path.startswith(f"{CACHE_FOLDER}/")]
    with pytest.raises(CompileError, match="on open although each part was compiled apart"):
        check_parts(store, pipeline, options, entries[1:], in_child)


def test_embedded_submit_pull_verify_a_text_to_image_folder(
    two_pipelines: tuple[Path, Path], tmp_path: Path
) -> None:
    """`farm submit` on the embedded farm compiles each part in its sandboxed child, checks the
    pipeline loads them all, and records the image; the pulled folder opens compiling nothing."""
    import json

    folder, _ = two_pipelines
    home = tmp_path / "home"
    env = {**os.environ, "FARM_HOME": str(home), "FARM_CACHE_DIR": str(home / "edge-cache")}
    for name in ("FARM_DATABASE_URL", "FARM_STORAGE_URL", "FARM_API_URL"):
        env.pop(name, None)

    def farm(*args: str) -> dict:
        done = subprocess.run(
            [sys.executable, "-m", "farm", *args, "--json"],
            capture_output=True,
            text=True,
            env=env,
            timeout=900,
            check=False,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return dict(json.loads(done.stdout))

    key = farm("submit", str(folder), "--device", "CPU")["bundle_key"]
    stored = sorted(p.name for p in home.rglob("bundle-parts/*.json"))
    assert len(stored) == 3
    ready = tmp_path / "ready"
    assert farm("pull", str(folder), "--device", "CPU", "-o", str(ready))["bundle_key"] == key
    report = farm("verify", str(ready))
    assert report["compiled_on_open"] == []
    assert len(report["got"]["image_sha256"]) == 64 and report["got"] == report["expected"]
