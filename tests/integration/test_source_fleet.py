"""Sources on a served farm with real worker processes (docs/architecture.md §15):

- the edge SDK (`farm.edge.compile_model`) and `farm agent sync` take any source format, with
  its example inputs and task, in a `farm[edge]`-only virtualenv (no torch, tensorflow, paddle,
  transformers or optimum): the key they compute offline is the farm's, and the blob imports;
- identical concurrent submits of one source with two compile specs, taken by two workers at
  once, convert it once (single flight across processes), and both blobs exist.

Sources are built by the frameworks in subprocesses (tests/make_sources.py); nothing downloaded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import select

from farm.server.db.models import Blob, Job, StageOutput
from tests.integration.conftest import edge_environment
from tests.integration.served import wait_until
from tests.integration.test_sources import frameworks, make_source  # noqa: F401

pytestmark = pytest.mark.slow
F32 = "INFERENCE_PRECISION_HINT=f32"
HF_SHAPES = [f"{name}[1,8]" for name in ("input_ids", "attention_mask", "token_type_ids")]
EDGE_SOURCES = {
    # name: (tests.make_sources kind, what it writes, example inputs, task, shapes)
    "pt2": ("pt2", "model.pt2", [], None, []),
    "torchscript": ("torchscript", "script.pt", ["x[1,3,8,8]:f32"], None, []),
    "tflite": ("tflite", "model.tflite", [], None, []),
    "paddle": ("paddle", "paddle", [], None, []),
    "paddle3": ("paddle3", "paddle3", [], None, []),
    "savedmodel": ("savedmodel", "saved", [], None, []),
    "huggingface": ("hf", "bert", [], "text-classification", HF_SHAPES),
}

EDGE_SDK = """
import json, sys
import farm.edge
cases = json.loads(sys.argv[1])
done = {}
for name, case in cases.items():
    compiled = farm.edge.compile_model(
        case["path"], "CPU", example_input=case["example_input"], task=case["task"],
        shapes=case["shapes"] or None, config=case.get("config"),
    )
    done[name] = sorted(p.get_any_name() for p in compiled.inputs)
    if case.get("config"):
        precision = compiled.get_property("INFERENCE_PRECISION_HINT")
        done[name + " precision"] = precision.get_type_name()
frameworks = ("torch", "tensorflow", "paddle", "transformers", "optimum")
print(json.dumps({"inputs": done, "frameworks": [m for m in frameworks if m in sys.modules]}))
"""
"""The edge app: one compile_model per source, pulling the farm's blob (no fallback)."""


@pytest.fixture(scope="module")
def built(frameworks, tmp_path_factory) -> dict[str, Path]:  # noqa: F811
    folder = tmp_path_factory.mktemp("fleet-sources")
    return {name: make_source(case[0], folder / case[1]) for name, case in EDGE_SOURCES.items()}


def submit_flags(name: str) -> list[str]:
    _, _, examples, task, shapes = EDGE_SOURCES[name]
    flags = [f"--example-input={e}" for e in examples] + [f"--shape={s}" for s in shapes]
    return [*flags, f"--task={task}"] if task else flags


def test_the_edge_sdk_and_agent_sync_take_any_source_and_compute_the_farms_key(
    built, edge_venv, served, api, tmp_path
):
    served.start_worker("w1")
    submitter = {"FARM_API_URL": api.url, "FARM_TOKEN": api.tokens["submit"]}
    keys = {}
    for name, path in built.items():
        answer = served.farm_json(
            "submit", str(path), "-d", "CPU", *submit_flags(name), "--wait", env=submitter
        )
        assert answer["job"]["state"] == "succeeded", (name, answer)
        keys[name] = answer["cache_key"]
    # A converted source's blob pinned to f32: its key holds its last stage, so the record's spec
    # cannot be checked against it; the SDK imports it with the spec it computed the key from.
    pinned = served.farm_json(
        "submit", str(built["pt2"]), "-d", "CPU", "--config", F32, "--wait", env=submitter
    )
    assert pinned["job"]["state"] == "succeeded", pinned

    env = edge_environment(api, served, tmp_path / "edge-home", "edge-fleet")
    env["FARM_CACHE_DIR"] = str(tmp_path / "edge-cache")
    cases = {
        name: {
            "path": str(path),
            "example_input": EDGE_SOURCES[name][2],
            "task": EDGE_SOURCES[name][3],
            "shapes": EDGE_SOURCES[name][4],
        }
        for name, path in built.items()
    }
    cases["pt2 f32"] = {**cases["pt2"], "config": [F32]}
    sdk = subprocess.run(
        [str(edge_venv / "bin" / "python"), "-c", EDGE_SDK, json.dumps(cases)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
        check=False,
    )
    assert sdk.returncode == 0, sdk.stderr[-3000:]
    answer = json.loads(sdk.stdout.strip().splitlines()[-1])
    assert answer["frameworks"] == []
    assert answer["inputs"]["huggingface"] == ["attention_mask", "input_ids", "token_type_ids"]
    assert answer["inputs"]["torchscript"] == ["x"]
    assert answer["inputs"]["pt2 f32 precision"] == "f32"  # bf16 on an AMX CPU, imported bare
    assert set(answer["inputs"]) == {*built, "pt2 f32", "pt2 f32 precision"}

    # farm agent sync: a manifest of sources, paths relative to it; each entry's key is the
    # farm's, and its blob imports.
    manifest = tmp_path / "fleet.toml"
    tables = []
    for name, path in built.items():
        _, _, examples, task, shapes = EDGE_SOURCES[name]
        table = [f"path = {json.dumps(os.path.relpath(path, tmp_path))}", 'device = "CPU"']
        if examples:
            table.append(f"example_input = {json.dumps(examples)}")
        if task:
            table.append(f"task = {json.dumps(task)}")
        if shapes:
            table.append(f"shapes = {json.dumps(shapes)}")
        tables.append("[[model]]\n" + "\n".join(table))
    manifest.write_text("\n\n".join(tables) + "\n")
    env["FARM_CACHE_DIR"] = str(tmp_path / "sync-cache")  # a second edge: downloads afresh
    synced = subprocess.run(
        [str(edge_venv / "bin" / "farm"), "agent", "sync", str(manifest), "--import", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert synced.returncode == 0, synced.stderr[-3000:]
    results = json.loads(synced.stdout)
    assert [r["status"] for r in results] == ["ready"] * len(built), results
    assert [r["downloaded"] for r in results] == [True] * len(built)
    assert [r["cache_key"] for r in results] == [keys[name] for name in built]

    # A source whose example input differs is another key: the farm has no blob for it.
    manifest.write_text(
        f"[[model]]\npath = {json.dumps(str(built['torchscript']))}\ndevice = 'CPU'\n"
        "example_input = 'x[1,3,16,16]:f32'\n"
    )
    missing = subprocess.run(
        [str(edge_venv / "bin" / "farm"), "agent", "sync", str(manifest), "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert missing.returncode == 3, missing.stderr
    assert json.loads(missing.stdout)[0]["status"] == "missing"


def test_identical_concurrent_submits_to_two_workers_convert_once(built, served, api, tmp_path):
    for name in ("w1", "w2"):
        served.start_worker(name)
    submitter = {**os.environ, **served.env, "FARM_API_URL": api.url}
    submitter["FARM_TOKEN"] = api.tokens["submit"]
    path = built["pt2"]
    specs = (["-d", "CPU"], ["-d", "CPU", "--config", "INFERENCE_PRECISION_HINT=f32"])
    # Two farm submit processes at once, the same source, two compile specs.
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "farm", "submit", str(path), *spec, "--wait", "--json"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=submitter,
        )
        for spec in specs
    ]
    answers = []
    for process in processes:
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0, err[-3000:]
        answers.append(json.loads(out))
    assert [a["job"]["state"] for a in answers] == ["succeeded", "succeeded"], answers
    assert answers[0]["cache_key"] != answers[1]["cache_key"]

    with served.sessions() as session:
        jobs = [session.get_one(Job, a["job"]["id"]) for a in answers]
        stages = session.scalars(select(StageOutput)).all()
        blobs = session.scalars(select(Blob)).all()
    # Both jobs were in flight at once, each on its own worker process.
    assert {job.worker for job in jobs} == {"w1", "w2"}
    assert jobs[0].stage_key == jobs[1].stage_key
    # One conversion: one stage row, done, built by one of the two jobs...
    assert len(stages) == 1
    stage = stages[0]
    assert stage.state == "done" and stage.job_id in {job.id for job in jobs}
    assert all(job.started_at < stage.finished_at for job in jobs), (jobs, stage.finished_at)
    # ...and one stage run among both workers' logs (the other job waited for it, then reused).
    ran = wait_until(
        lambda: [
            line
            for worker in ("w1", "w2")
            for line in served.worker_log(worker).splitlines()
            if "ran stage" in line
        ],
        10,
        "the worker's line about its stage run",
    )
    assert len(ran) == 1, ran
    assert f"job {stage.job_id} ran stage convert" in ran[0]
    # Both blobs exist, recorded and stored.
    assert sorted(b.cache_key for b in blobs) == sorted(a["cache_key"] for a in answers)
    for blob in blobs:
        assert served.store.exists(blob.storage_key)
