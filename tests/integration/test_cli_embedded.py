"""The embedded farm through the real `farm` command: submit → pull → run, hits, bad input."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import openvino as ov
import pytest

from tests import models

FARM = [sys.executable, "-m", "farm"]


@pytest.fixture
def farm_home(tmp_path) -> Path:
    return tmp_path / "farm-home"


def farm(farm_home: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "FARM_HOME": str(farm_home)}
    for name in ("FARM_DATABASE_URL", "FARM_STORAGE_URL"):
        env.pop(name, None)
    result = subprocess.run(
        [*FARM, *args], capture_output=True, text=True, env=env, timeout=300, check=False
    )
    if check and result.returncode != 0:
        raise AssertionError(f"farm {' '.join(args)} exited {result.returncode}:\n{result.stderr}")
    return result


def farm_json(farm_home: Path, *args: str) -> dict:
    return json.loads(farm(farm_home, *args, "--json").stdout)


def stored_files(farm_home: Path) -> list[str]:
    store = farm_home / "store"
    return sorted(str(p.relative_to(store)) for p in store.rglob("*") if p.is_file())


def row_count(farm_home: Path, table: str) -> int:
    import sqlite3

    db = farm_home / "farm.db"
    if not db.exists():
        return 0
    with sqlite3.connect(db) as connection:
        return connection.execute(f"SELECT count(*) FROM {table}").fetchone()[0]


def compile_children_started_ahead() -> list[int]:
    """Running compile children started ahead of a job (their command names the target) that
    outlived their `farm` command. Those of a command still running (another test's, on the
    other test process) are not counted: it may still take or end them."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            command = (entry / "cmdline").read_bytes().split(b"\0")
            state, parent = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:2]
            parent_command = Path("/proc", parent, "cmdline").read_bytes()
        except (OSError, IndexError):
            continue
        ahead = b"farm.server.jobs.sandbox" in command and command[-2:] == [b"CPU", b""]
        if ahead and state not in ("Z", "X") and b"farm" not in parent_command:
            found.append(int(entry.name))
    return found


@pytest.fixture
def conv_xml(tmp_path) -> Path:
    return models.save_ir(models.conv_net(), tmp_path / "model" / "conv.xml")


def test_submit_pull_run_and_a_second_submit_is_a_hit(farm_home, conv_xml, tmp_path):
    first = farm_json(farm_home, "submit", str(conv_xml), "--device", "CPU")
    assert first["outcome"] == "queued"
    assert first["job"]["state"] == "succeeded"
    assert first["job"]["compile_seconds"] > 0
    key = first["cache_key"]
    assert len(key) == 64

    second = farm_json(farm_home, "submit", str(conv_xml), "--device", "cpu")
    assert second == {"outcome": "hit", "cache_key": key}
    assert row_count(farm_home, "jobs") == 1  # the hit compiled nothing
    models_stored = [name for name in stored_files(farm_home) if name.startswith("models/")]
    assert len(models_stored) == 2  # by digest; and no partial copies anywhere:
    assert not any(Path(name).name.startswith(".") for name in stored_files(farm_home))
    # A copy elsewhere is new to the digest cache: hashed, and copied to the store meanwhile,
    # until its digests show the store has it.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for file in (conv_xml, conv_xml.with_suffix(".bin")):
        (elsewhere / file.name).write_bytes(file.read_bytes())
    third = farm_json(farm_home, "submit", str(elsewhere / conv_xml.name), "--device", "CPU")
    assert third == {"outcome": "hit", "cache_key": key}
    assert [name for name in stored_files(farm_home) if name.startswith("models/")] == models_stored
    assert not any(Path(name).name.startswith(".") for name in stored_files(farm_home))
    # Its compile child, started beside the hash, was ended when no job took it.
    assert not compile_children_started_ahead()

    by_key = tmp_path / "by-key.blob"  # the plain export_model() bytes
    pulled = farm_json(farm_home, "pull", key, "-o", str(by_key))
    assert pulled["sha256"] and pulled["output_format"] == "blob"
    assert by_key.stat().st_size == pulled["size_bytes"] - pulled["payload_offset"]
    # What every OpenVINO user does with a .blob opens it, no farm code needed.
    plain = ov.Core().import_model(by_key.read_bytes(), "CPU")
    assert [port.get_any_name() for port in plain.inputs] == ["x"]

    entry = tmp_path / "entry.blob"  # OpenVINO's cache entry: its header, then those bytes
    farm(farm_home, "pull", key, "-o", str(entry), "--format", "cache-entry")
    assert hashlib.sha256(entry.read_bytes()).hexdigest() == pulled["sha256"]
    assert entry.read_bytes()[pulled["payload_offset"] :] == by_key.read_bytes()

    by_model = tmp_path / "by-model.blob"
    farm(farm_home, "pull", str(conv_xml), "--device", "CPU", "-o", str(by_model))
    assert by_model.read_bytes() == by_key.read_bytes()

    for blob in (by_key, entry):  # `farm run` takes either form
        ran = farm_json(farm_home, "run", str(blob), "--device", "CPU")
        assert ran["outputs"] == {"output0": [1, 8]} or list(ran["outputs"].values()) == [[1, 8]]
        assert ran["import_seconds"] > 0

    human = farm(farm_home, "run", str(by_key), "--device", "CPU").stdout
    assert "imported by-key.blob on CPU in" in human

    status = farm_json(farm_home, "status", key)
    assert status["blob"]["cache_key"] == key and status["job"]["state"] == "succeeded"
    assert farm_json(farm_home, "status", str(first["job"]["id"]))["state"] == "succeeded"
    listed = json.loads(farm(farm_home, "blobs", "--json").stdout)
    assert [row["cache_key"] for row in listed] == [key]


def test_different_specs_are_different_blobs(farm_home, tmp_path):
    xml = models.save_ir(models.dynamic_net(), tmp_path / "dyn" / "dyn.xml")
    a = farm_json(farm_home, "submit", str(xml), "-d", "CPU", "--shape", "image[1,3,16,16]")
    b = farm_json(farm_home, "submit", str(xml), "-d", "CPU", "--batch", "2", "--layout", "NCHW")
    assert a["cache_key"] != b["cache_key"]
    assert a["job"]["state"] == b["job"]["state"] == "succeeded"
    assert row_count(farm_home, "blobs") == 2


def test_npu_submit_names_the_missing_compiler_and_stores_nothing(farm_home, conv_xml):
    result = farm(farm_home, "submit", str(conv_xml), "-d", "4000", "--tiles", "2", check=False)
    assert result.returncode == 4
    assert "libopenvino_intel_npu_compiler_loader.so" in result.stderr
    assert row_count(farm_home, "jobs") == 0 and row_count(farm_home, "blobs") == 0
    assert stored_files(farm_home) == []


def _bad_inputs(tmp_path: Path, conv_xml: Path) -> dict[str, tuple[list[str], str]]:
    no_bin = models.save_ir(models.conv_net(), tmp_path / "nobin" / "m.xml")
    no_bin.with_suffix(".bin").unlink()
    truncated = models.save_ir(models.conv_net(), tmp_path / "trunc" / "m.xml")
    weights = truncated.with_suffix(".bin")
    weights.write_bytes(weights.read_bytes()[:100])
    malformed = models.save_ir(models.conv_net(), tmp_path / "malformed" / "m.xml")
    malformed.write_text("<net><layers><layer id='0'")
    not_model = tmp_path / "notes.txt"
    not_model.write_text("hello")
    fake_onnx = tmp_path / "fake.onnx"
    fake_onnx.write_bytes(os.urandom(256))
    model = str(conv_xml)
    return {
        "missing .bin": ([str(no_bin), "-d", "CPU"], "weights file does not exist"),
        "truncated .bin": ([str(truncated), "-d", "CPU"], "Incorrect weights in bin file"),
        "malformed xml": ([str(malformed), "-d", "CPU"], "cannot read model"),
        "not a model": ([str(not_model), "-d", "CPU"], "not a model"),
        "garbage onnx": ([str(fake_onnx), "-d", "CPU"], "cannot read model"),
        "unknown device": ([model, "-d", "GPU"], "known devices: NPU.3720"),
        "tiles over max": ([model, "-d", "4000", "--tiles", "7"], "1 to 6"),
        "malformed shape": ([model, "-d", "CPU", "--shape", "x[1,three]"], "positive integer"),
        "unknown input": ([model, "-d", "CPU", "--shape", "y[1,3,32,32]"], "no input 'y'"),
        "unknown compiler parameter": (
            [model, "-d", "4000", "--compiler-params", "turbo=on"],
            "unknown compiler parameter 'turbo'",
        ),
        "unknown property": ([model, "-d", "CPU", "--config", "NUM_STREAM=2"], "not allowed"),
    }


def test_bad_input_is_one_clear_line_a_nonzero_exit_and_nothing_stored(
    farm_home, conv_xml, tmp_path
):
    for case, (args, message) in _bad_inputs(tmp_path, conv_xml).items():
        result = farm(farm_home, "submit", *args, check=False)
        assert result.returncode == 2, (case, result.returncode, result.stderr)
        assert message in result.stderr, (case, result.stderr)
        assert result.stderr.startswith("farm: error: "), (case, result.stderr)
        assert "Traceback" not in result.stderr, case
    assert row_count(farm_home, "jobs") == 0
    assert row_count(farm_home, "models") == 0
    assert stored_files(farm_home) == []


def test_pull_of_an_unknown_key_is_not_found(farm_home, tmp_path):
    result = farm(farm_home, "pull", "a" * 64, "-o", str(tmp_path / "x.blob"), check=False)
    assert result.returncode == 3
    assert "no blob for cache key" in result.stderr
    assert not (tmp_path / "x.blob").exists()


def test_status_of_garbage_is_bad_input(farm_home):
    result = farm(farm_home, "status", "not-a-key", check=False)
    assert result.returncode == 2 and "neither a job number nor" in result.stderr


def test_run_refuses_a_file_that_is_not_a_blob(farm_home, tmp_path):
    junk = tmp_path / "junk.blob"
    junk.write_bytes(b"\x00" * 64)
    result = farm(farm_home, "run", str(junk), "--device", "CPU", check=False)
    assert result.returncode == 2
    assert "neither an exported blob nor an OpenVINO cache entry" in result.stderr
    assert result.stderr.count("\n") == 1  # one line, not OpenVINO's stack


def test_jobs_since_filters_by_creation_time_in_utc(farm_home, conv_xml):
    from datetime import UTC, datetime, timedelta

    job = farm_json(farm_home, "submit", str(conv_xml), "-d", "CPU")["job"]
    today = datetime.now(UTC)
    before = (today - timedelta(days=1)).strftime("%Y-%m-%d")
    after = (today + timedelta(days=1)).strftime("%Y-%m-%dT%H:%M:%S")
    assert [j["id"] for j in farm_json(farm_home, "jobs", "--since", before)] == [job["id"]]
    assert farm_json(farm_home, "jobs", "--since", after) == []
    human = farm(farm_home, "jobs", "--since", before, "--state", "succeeded").stdout
    assert "succeeded" in human
    # --state filters: the succeeded job is not listed among the failed ones.
    assert "succeeded" not in farm(farm_home, "jobs", "--since", before, "--state", "failed").stdout


def reference_settled(farm_home: Path, key: str) -> dict:
    """The blob's status once its reference run (detached after the submit, docs §6) ended."""
    deadline = time.monotonic() + 120
    while True:
        blob = farm_json(farm_home, "status", key)["blob"]
        if blob["reference_state"] != "pending" or time.monotonic() > deadline:
            return blob
        time.sleep(0.5)


def test_db_upgrade_and_logs_answer_in_json(farm_home, conv_xml):
    from alembic.script import ScriptDirectory

    from farm.server.db.session import alembic_config

    url = f"sqlite:///{farm_home / 'farm.db'}"
    head = ScriptDirectory.from_config(alembic_config(url)).get_current_head()
    upgraded = farm_json(farm_home, "db", "upgrade")
    assert upgraded == {"database": url, "revision": head}
    assert f"database at head ({head})" in farm(farm_home, "db", "upgrade").stdout

    submitted = farm_json(farm_home, "submit", str(conv_xml), "-d", "CPU", "--quiet")
    job = submitted["job"]
    reference_settled(farm_home, submitted["cache_key"])  # its run adds a line to the log
    log = farm_json(farm_home, "logs", str(job["id"]))
    assert log["id"] == job["id"] and log["state"] == "succeeded"
    assert "toolchain=" in log["log"]
    assert farm(farm_home, "logs", str(job["id"])).stdout.strip() == log["log"].strip()


def test_doctor_on_a_healthy_host_reports_openvino_devices_npu_libraries_and_targets(
    farm_home, openvino_libs_alone
):
    import openvino as ov

    from farm.core.spec import KNOWN_TARGETS
    from farm.toolchain import COMPILER_SOURCES, NPU_COMPILER_LIBRARY

    libs = openvino_libs_alone
    found = {
        library: (libs / library).exists()
        for library in ("libopenvino_intel_npu_plugin.so", NPU_COMPILER_LIBRARY)
    }
    signing = next(c for c in farm_json(farm_home, "doctor") if c["check"] == "signing")
    assert signing == {
        "check": "signing",
        "ok": True,
        "detail": f"{farm_home.resolve()}/keys/signing.pem (created on the first compile)",
    }
    human = farm(farm_home, "doctor")  # exit 0: every configured service answers
    text = human.stdout
    assert f"ok      openvino: {ov.get_version()}" in text
    assert f"ok      devices: {', '.join(ov.Core().available_devices)}" in text
    for library, present in found.items():
        assert f"{'ok     ' if present else 'missing'} {library}: " in text, library
    assert "ok      compile CPU: compiles here" in text
    assert "ok      database: sqlite:///" in text and "ok      storage: " in text

    checks = {c["check"]: c for c in farm_json(farm_home, "doctor")}
    assert checks["openvino"] == {"check": "openvino", "ok": True, "detail": ov.get_version()}
    for library, present in found.items():
        assert checks[library]["ok"] is present
        if present:
            assert checks[library]["detail"] == str(libs / library)
        elif library == NPU_COMPILER_LIBRARY:  # where the compiler comes from, and where it goes
            assert checks[library]["detail"] == "missing: " + COMPILER_SOURCES.format(libs=libs)
        else:
            assert checks[library]["detail"] == "missing"
    assert {f"compile {t}" for t in KNOWN_TARGETS} <= set(checks)
    assert checks["compile CPU"] == {"check": "compile CPU", "ok": True, "detail": "compiles here"}
    for target in KNOWN_TARGETS:
        if target != "CPU" and not found[NPU_COMPILER_LIBRARY]:
            check = checks[f"compile {target}"]
            assert check["ok"] is False and NPU_COMPILER_LIBRARY in check["detail"], target
            assert f"missing compile {target}: cannot compile for {target}" in text


def test_a_matrix_with_a_target_this_host_cannot_compile_compiles_the_rest(farm_home, conv_xml):
    result = farm(farm_home, "submit", str(conv_xml), "-d", "4000,CPU", "--json", check=False)
    assert result.returncode == 4, result.stderr  # the worst of the specs' outcomes
    npu, cpu = json.loads(result.stdout)["results"]
    assert (npu["outcome"], npu["job"]) == ("unavailable", None)
    assert "libopenvino_intel_npu_compiler_loader.so" in npu["reason"]
    assert cpu["job"]["state"] == "succeeded"
    assert row_count(farm_home, "jobs") == 1 and row_count(farm_home, "blobs") == 1
    human = farm(farm_home, "submit", str(conv_xml), "-d", "CPU,4000", check=False)
    assert human.returncode == 4
    lines = human.stdout.splitlines()  # piped: one line per fact, never wrapped
    assert lines[0] == f"cache key  {cpu['cache_key']}  (CPU)"
    assert lines[1] == "outcome    hit (the blob exists; nothing compiled)"
    assert lines[3].startswith("outcome    unavailable (no job): cannot compile for NPU.4000: ")


def test_run_says_what_a_blob_needs_to_import(farm_home, conv_xml, tmp_path):
    weightless = farm_json(farm_home, "submit", str(conv_xml), "-d", "CPU", "--weightless")
    blob = tmp_path / "weightless.blob"
    farm(farm_home, "pull", weightless["cache_key"][:12], "-o", str(blob))
    bare = farm(farm_home, "run", str(blob), "--device", "CPU", check=False)
    assert bare.returncode == 2
    assert f"{blob} is a weightless blob (compiled with --weightless): import it with " in (
        bare.stderr
    )
    assert "--weights MODEL.bin" in bare.stderr and bare.stderr.count("\n") == 1
    weights = str(conv_xml.with_suffix(".bin"))
    assert farm_json(farm_home, "run", str(blob), "-d", "CPU", "--weights", weights)["outputs"]
    key = weightless["cache_key"]
    pulled = farm(farm_home, "pull", key, "--import", check=False)
    assert pulled.returncode == 2
    assert f"blob {key} is weightless: import it with --weights MODEL.bin" in pulled.stderr

    # A CPU blob on an NPU: this host cannot import it (README: exit 4), not bad input.
    on_npu = farm(farm_home, "run", str(blob), "--device", "4000", "--json", check=False)
    assert on_npu.returncode == 4
    error = json.loads(on_npu.stderr)
    assert error["code"] == "incompatible" and error["exit"] == 4
    assert error["message"].startswith(f"cannot import {blob} on NPU.4000: it is not a blob for")


def test_status_shows_where_the_jobs_time_went(farm_home, conv_xml):
    submitted = farm_json(farm_home, "submit", str(conv_xml), "--device", "CPU")
    job_id = submitted["job"]["id"]
    status = farm_json(farm_home, "status", str(job_id))
    phases = [p["phase"] for p in status["phases"]]
    # The reference run follows the record, detached (docs §6): it may not have ended yet.
    assert phases in (
        ["queued", "fetch", "compile", "upload", "record"],
        ["queued", "fetch", "compile", "upload", "record", "reference"],
    )
    deadline = time.monotonic() + 120
    while phases[-1] != "reference" and time.monotonic() < deadline:
        time.sleep(0.5)
        status = farm_json(farm_home, "status", str(job_id))
        phases = [p["phase"] for p in status["phases"]]
    assert phases == ["queued", "fetch", "compile", "upload", "record", "reference"]
    seconds = {p["phase"]: p["seconds"] for p in status["phases"]}
    assert seconds["compile"] >= status["compile_seconds"] > 0  # the child's whole life
    assert all(value >= 0 for value in seconds.values())
    text = farm(farm_home, "status", str(job_id)).stdout
    assert "phases     queued " in text and ", compile " in text
    assert row_count(farm_home, "job_phases") == 5


def test_a_new_model_the_compile_child_may_read_is_compiled_where_it_is(farm_home, monkeypatch):
    """The store's copy of a model the compile child reads where it is goes around the page
    cache: the user's file, just hashed, is in memory already (bench/README.md
    "submit_overhead"). The copy is the model's bytes all the same, and the blob is its."""
    from farm.server.jobs.compile_user import compile_identity
    from farm.server.jobs.sandbox import readable_in_place
    from tests.pagecache import cached_pages, direct_io_here

    monkeypatch.setenv("FARM_REFERENCE_OUTPUTS", "0")  # a reference run would read the copy
    folder = Path(tempfile.mkdtemp(prefix="farm-user-model-"))
    try:
        folder.chmod(0o755)
        xml = models.save_ir(models.large_net(16), folder / "big.xml")
        weights = xml.with_suffix(".bin")
        if not readable_in_place(weights, compile_identity()):
            pytest.skip("the temporary folder is not open to the compile user here")
        farm_home.mkdir()
        if not direct_io_here(farm_home):
            pytest.skip("no direct I/O where the store is")
        answer = farm_json(farm_home, "submit", str(xml), "--device", "CPU")
        assert answer["job"]["state"] == "succeeded"
        for file in (xml, weights):
            stored = farm_home / "store" / "models" / hashlib.sha256(file.read_bytes()).hexdigest()
            # Written around the cache, and never read since: at most the last partial block.
            assert cached_pages(stored) <= 1
            assert stored.read_bytes() == file.read_bytes()
        blob = farm_home / "store" / "blobs" / f"{answer['cache_key']}.blob"
        assert blob.stat().st_size > weights.stat().st_size
        # Its compile was given its request before the model was hashed, and the blob was
        # copied into the store as that compile ended: stored once, as recorded.
        log = farm_json(farm_home, "logs", str(answer["job"]["id"]))["log"]
        assert "farm: compiled by the child started ahead of this job" in log
        recorded = farm_json(farm_home, "status", answer["cache_key"])["blob"]["sha256"]
        assert hashlib.sha256(blob.read_bytes()).hexdigest() == recorded
        assert stored_files(farm_home) == sorted(
            [f"blobs/{blob.name}", *(f"models/{digest}" for digest in answer_digests(xml))]
        )
    finally:
        shutil.rmtree(folder)


def answer_digests(xml: Path) -> list[str]:
    return [hashlib.sha256(f.read_bytes()).hexdigest() for f in (xml, xml.with_suffix(".bin"))]
