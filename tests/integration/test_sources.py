"""Sources converted on the farm as a cached stage, with real frameworks (docs/architecture.md
§15): models built by torch, TensorFlow and Paddle themselves (tests/make_sources.py), nothing
downloaded. Each is submitted through the API to a real worker, converted once (a second spec
converts nothing: counted in `stage_outputs`), compiled for CPU, pulled and verified on an edge
install with `farm[edge]` only (no torch, no tensorflow), its outputs equal to the source
framework's within the CPU tolerance. Hostile sources are refused with the file and the reason,
and nothing half-converted is recorded.

The frameworks come from the reused virtualenv `scripts/frameworks` links in; without them these
tests skip locally and fail in CI.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import select

from farm.core.spec import CompileSpec
from farm.server.db.models import Job, StageOutput
from farm.server.jobs.runner import run_job
from farm.server.jobs.service import submit
from tests.conftest import service_missing
from tests.integration.conftest import edge_cli, edge_environment

ROOT = Path(__file__).resolve().parents[2]
FRAMEWORKS = ("torch", "tensorflow", "paddle", "transformers", "optimum.intel")
HF_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
SOURCES = {
    "tflite": ("tflite", "model.tflite", []),
    "paddle": ("paddle", "paddle", []),
    "savedmodel": ("savedmodel", "saved", []),
    "pt2": ("pt2", "model.pt2", []),
    "torchscript": ("torchscript", "script.pt", ["--example-input", "x[1,3,8,8]:f32"]),
    "huggingface": ("hf", "bert", [f"--shape={name}[1,8]" for name in HF_INPUTS]),
}
"""Source kind -> (tests.make_sources kind, what it writes, the submit flags it needs)."""

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def frameworks() -> None:
    missing = [name for name in FRAMEWORKS if importlib.util.find_spec(name) is None]
    if missing:
        service_missing(
            "the converter frameworks", RuntimeError(f"{missing} (run scripts/frameworks)")
        )


def make_source(kind: str, out: Path) -> Path:
    """Build a source in a subprocess: TensorFlow, torch and Paddle stay out of this process."""
    env = {**os.environ, "FLAGS_enable_pir_api": "0"}  # Paddle: the .pdmodel OpenVINO reads
    made = subprocess.run(
        [sys.executable, "-m", "tests.make_sources", kind, str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
        check=False,
    )
    assert made.returncode == 0, made.stderr[-3000:]
    return Path(made.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def built(frameworks, tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("sources")
    return {
        name: make_source(kind, folder / written) for name, (kind, written, _) in SOURCES.items()
    }


def test_sources_convert_once_compile_and_verify_on_an_edge_install(
    built, edge_venv, served, api, tmp_path
):
    served.start_worker("w1")
    with served.sessions() as session:
        from farm.server.db.models import Worker

        worker = session.get(Worker, "w1")
        assert set(worker.converters) >= {"torch", "optimum"}
        assert worker.converters["torch"]["torch"].startswith("2.13.0")
        assert any(queue.endswith(".with-torch") for queue in worker.queues)
    submitter = {"FARM_API_URL": api.url, "FARM_TOKEN": api.tokens["submit"]}
    edge_env = edge_environment(api, served, tmp_path / "edge-home", "edge-sources")
    edge = edge_cli(edge_venv, edge_env)

    for name, path in built.items():
        flags = SOURCES[name][2]
        first = served.farm_json("submit", str(path), "-d", "CPU", *flags, "--wait", env=submitter)
        assert first["job"]["state"] == "succeeded", (name, first)
        second = served.farm_json(
            "submit",
            str(path),
            "-d",
            "CPU",
            "--config",
            "INFERENCE_PRECISION_HINT=f32",
            *flags,
            "--wait",
            env=submitter,
        )
        assert second["job"]["state"] == "succeeded", (name, second)
        assert second["cache_key"] != first["cache_key"]
        with served.sessions() as session:
            job = session.get_one(Job, first["job"]["id"])
            later = session.get_one(Job, second["job"]["id"])
            stages = session.scalars(
                select(StageOutput).where(StageOutput.stage_key == job.stage_key)
            ).all()
        # Converted once: one row, built by the first job; the second spec reused it.
        assert later.stage_key == job.stage_key
        assert [(s.kind, s.state, s.job_id) for s in stages] == [("convert", "done", job.id)]
        assert stages[0].tool_versions["openvino"].startswith("2026.4.1")
        if name in ("pt2", "torchscript"):
            assert stages[0].tool_versions["torch"].startswith("2.13.0")
            assert job.queue.endswith(".with-torch")
        if name == "huggingface":  # task from config.json: text-classification
            assert stages[0].args == {"format": "huggingface", "task": "text-classification"}
            assert stages[0].tool_versions["optimum-intel"]
            assert job.queue.endswith(".with-optimum")

        # The edge: farm[edge] only; it computes the key from the source file offline.
        pulled = edge("pull", str(path), "--device", "CPU", *flags, "--import")
        assert pulled["cache_key"] == first["cache_key"], name
        verified = edge("verify", str(path), "--device", "CPU", *flags)
        # Within the CPU tolerance (docs §14): this CPU infers in bf16 by default.
        assert verified["passed"], (name, verified)
        assert verified["max_abs_error"] <= 0.01, (name, verified)
        if name == "pt2":  # the converted IR itself, for compiling on the device
            ir = edge("pull", str(path), "--ir", str(tmp_path / "ir"))
            assert ir["stage_key"] == job.stage_key
            assert sorted(Path(p).name for p in ir["files"].values()) == ["model.bin", "model.xml"]

    # No framework on the edge: the keys above came from farm.core alone.
    names = [name.split(".")[0] for name in FRAMEWORKS]
    probe = f"import importlib.util as u; print([m for m in {names!r} if u.find_spec(m)])"
    found = subprocess.run(
        [str(edge_venv / "bin" / "python"), "-c", probe], capture_output=True, text=True, check=True
    )
    assert found.stdout.strip() == "[]"


def embedded(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "FARM_HOME": str(tmp_path / "farm-home")}
    return subprocess.run(
        [sys.executable, "-m", "farm", *args, "--json"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
        check=False,
    )


def test_hostile_sources_are_refused_and_nothing_half_converted_is_recorded(built, tmp_path):
    pickled = make_source("pickle", tmp_path / "pickled.pt")
    refused = embedded(tmp_path, "submit", str(pickled), "-d", "CPU")
    assert refused.returncode == 2, refused.stderr
    error = json.loads(refused.stderr)
    assert "pickled.pt: a pickled PyTorch object" in error["message"]
    assert "torch.export.save" in error["message"]

    truncated_archive = tmp_path / "cut.pt2"
    truncated_archive.write_bytes(built["pt2"].read_bytes()[:2000])
    cut = embedded(tmp_path, "submit", str(truncated_archive), "-d", "CPU")
    assert cut.returncode == 2
    assert "cut.pt2: a truncated or corrupt PyTorch archive" in json.loads(cut.stderr)["message"]

    truncated = tmp_path / "half.tflite"
    truncated.write_bytes(built["tflite"].read_bytes()[:300])
    failed = embedded(tmp_path, "submit", str(truncated), "-d", "CPU")
    answer = json.loads(failed.stdout)
    assert answer["job"]["state"] == "failed"
    assert answer["job"]["error"].startswith("cannot convert half.tflite (tflite): OpenVINO:")

    from farm.core.config import Settings
    from farm.server.context import FarmContext

    farm = FarmContext.open(Settings(home=tmp_path / "farm-home"))
    try:
        with farm.session() as session:
            rows = session.scalars(select(StageOutput)).all()
            assert [(r.state, r.output_model_id) for r in rows] == [("failed", None)]
            assert "half.tflite" in rows[0].error
    finally:
        farm.sessions.kw["bind"].dispose()


def test_a_converted_model_for_npu_is_converted_then_stops_at_the_missing_compiler(built, tmp_path):
    """No NPU compiler here: the conversion runs, the compile fails naming what is missing."""
    from farm.core import sources, stages
    from farm.core.config import Settings
    from farm.core.identity import ModelRef
    from farm.server.context import FarmContext
    from farm.server.jobs.service import upload_model_files
    from farm.toolchain import host_toolchain

    farm = FarmContext.open(Settings(home=tmp_path / "farm-home"))
    try:
        path = built["pt2"]
        ref = ModelRef.from_source(path).with_recipe(stages.recipe_for(sources.detect(path)))
        with farm.session() as session:
            upload_model_files(farm.store, ref)
            spec = CompileSpec.create("4000")
            wanted = host_toolchain(spec.target)
            submitted = submit(session, farm.store, ref.info, spec, wanted)
        job = run_job(farm.sessions, farm.store, submitted.job_id, limits=farm.run_limits)
        assert job is not None and job.state == "failed"
        assert "NPU compiler" in job.error and "install-npu-compiler" in job.error
        with farm.session() as session:
            stage = session.scalars(select(StageOutput)).one()
            assert (stage.state, stage.job_id) == ("done", job.id)
    finally:
        farm.sessions.kw["bind"].dispose()


def test_a_hugging_face_folder_with_its_own_code_is_refused_unless_the_admin_allows_it(
    built, tmp_path
):
    import shutil

    folder = tmp_path / "custom"
    shutil.copytree(built["huggingface"], folder)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoModel": "modeling_custom.CustomModel"}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "modeling_custom.py").write_text("raise SystemExit('never run')\n")
    shapes = SOURCES["huggingface"][2]
    answer = json.loads(embedded(tmp_path, "submit", str(folder), "-d", "CPU", *shapes).stdout)
    assert answer["job"]["state"] == "failed"
    assert "custom: this Hugging Face folder has its own code" in answer["job"]["error"]
    assert "FARM_ALLOW_REMOTE_CODE=true" in answer["job"]["error"]


def test_a_converting_job_compiles_in_its_converting_child_the_blob_a_reused_stage_makes(
    built, tmp_path
):
    """A job that runs its one convert stage compiles in that same child (docs §15): one
    `convert+compile` phase, no compile child; the stage recorded as always. Its blob,
    compiled from the model in memory while the IR was saved, computes what the usual way
    makes from the stored IR (the compile child of a job that reuses the stage) computes."""
    first = embedded(tmp_path, "submit", str(built["pt2"]), "-d", "CPU")
    assert first.returncode == 0, first.stderr
    job_id = json.loads(first.stdout)["job"]["id"]
    second = embedded(
        tmp_path, "submit", str(built["pt2"]), "-d", "CPU", "--config",
        "INFERENCE_PRECISION_HINT=f32",
    )  # fmt: skip
    assert second.returncode == 0, second.stderr
    reused_id = json.loads(second.stdout)["job"]["id"]

    from farm.core.config import Settings
    from farm.server.context import FarmContext
    from farm.server.db.models import Blob, JobPhase
    from farm.server.jobs.sandbox import compile_in_child
    from farm.server.storage import blob_storage_key, model_storage_key

    farm = FarmContext.open(Settings(home=tmp_path / "farm-home"))
    try:
        with farm.session() as session:
            phases = {
                job: [
                    p.phase for p in session.scalars(select(JobPhase).where(JobPhase.job_id == job))
                ]
                for job in (job_id, reused_id)
            }
            job = session.get_one(Job, job_id)
            stage = session.scalars(select(StageOutput)).one()
            blob = session.scalars(select(Blob).where(Blob.job_id == job_id)).one()
        assert "convert+compile" in phases[job_id] and "compile" not in phases[job_id]
        assert "compile" in phases[reused_id] and "convert+compile" not in phases[reused_id]
        assert (stage.state, stage.job_id) == ("done", job_id)
        assert stage.tool_versions["torch"] and stage.metrics["peak_rss_bytes"] > 0
        assert set(stage.output_files) == {"xml", "bin"}

        # The usual way from the stored IR: the compile child, the same spec and blob id.
        ir = {role: tmp_path / f"model.{role}" for role in ("xml", "bin")}
        for role, path in ir.items():
            farm.store.get_file(model_storage_key(stage.output_files[role]), path)
        spec = CompileSpec.from_canonical(job.target, job.spec)
        again, _ = compile_in_child(
            ir, spec, tmp_path / "again", job.cache_key, timeout_seconds=300
        )
        one_child = tmp_path / "one-child.blob"
        farm.store.get_file(blob_storage_key(job.cache_key), one_child)
        assert one_child.stat().st_size == blob.size_bytes
        # Not byte for byte: two compiles of one IR on this CPU plugin differ in a few bytes
        # (measured). Both import, and compute the same outputs on the same inputs.
        import numpy as np

        from farm.edge.importer import import_blob

        feed = np.random.default_rng(7).standard_normal((1, 3, 8, 8)).astype(np.float32)
        outputs = [
            import_blob(path, "CPU").compiled({0: feed})[0] for path in (one_child, again.blob_path)
        ]
        assert outputs[0].shape == outputs[1].shape
        assert np.array_equal(outputs[0], outputs[1])
    finally:
        farm.sessions.kw["bind"].dispose()


def test_a_weightless_converting_job_compiles_the_ir_read_back(built, tmp_path):
    """A weightless blob leaves weights out by their offsets in the IR's `.bin`, which a model in
    memory does not have: the converting child saves the IR first and compiles the files (docs
    §15). Its blob is smaller than the full one by about the weights; compiled from memory it
    held them all."""
    weightless = embedded(tmp_path, "submit", str(built["pt2"]), "-d", "CPU", "--weightless")
    assert weightless.returncode == 0, weightless.stderr
    full = embedded(tmp_path, "submit", str(built["pt2"]), "-d", "CPU")  # reuses the stage
    assert full.returncode == 0, full.stderr
    ids = [json.loads(done.stdout)["job"]["id"] for done in (weightless, full)]

    from farm.core.config import Settings
    from farm.server.context import FarmContext
    from farm.server.db.models import Blob, JobPhase

    farm = FarmContext.open(Settings(home=tmp_path / "farm-home"))
    try:
        with farm.session() as session:
            first_phases = session.scalars(select(JobPhase.phase).where(JobPhase.job_id == ids[0]))
            assert "convert+compile" in list(first_phases)  # the one child made it
            sizes = [
                session.scalars(select(Blob.size_bytes).where(Blob.job_id == job)).one()
                for job in ids
            ]
            weights = session.scalars(select(StageOutput)).one().output_files["bin"]
    finally:
        farm.sessions.kw["bind"].dispose()
    bin_bytes = (tmp_path / "farm-home" / "store" / "models" / weights).stat().st_size
    assert sizes[0] < sizes[1] - bin_bytes // 2, (sizes, bin_bytes)
