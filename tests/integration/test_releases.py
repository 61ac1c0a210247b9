"""A fleet with two OpenVINO releases, for real: two workers on one host, one on the project's
OpenVINO and one on 2025.4.1 (a virtualenv of its own), and two edges likewise. Each edge
computes its key with its own toolchain, the worker with that toolchain compiles it (the other
never sees the job), each edge pulls, verifies and imports its own blob, and plain OpenVINO opens
the file `farm pull -o` wrote. A job for a release no worker has waits, saying so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest
from filelock import FileLock

from farm.toolchain import openvino_release
from tests import models

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
OLD_RELEASE = "2025.4.1"
"""The oldest release `pyproject.toml` admits that the farm is tested with."""


@pytest.fixture(scope="session")
def old_python() -> str:
    """A virtualenv whose own site-packages hold only `openvino==OLD_RELEASE`, and which reads
    everything else (farm, numpy, its dependencies) from this one's: the old OpenVINO comes
    first on the path, so `import openvino` is the old release.

    It lives beside the project's `.venv` (made once, kept: git ignores it), not in pytest's
    private temporary folders: a worker running as root compiles as an unprivileged user, who
    must be able to read this OpenVINO's libraries."""
    folder = REPO / f".venv-openvino-{OLD_RELEASE}"
    python = folder / "bin" / "python"
    with FileLock(f"{folder}.lock"):  # pytest-xdist's processes make it once
        if not python.exists():
            venv.create(folder, with_pip=True)
        subprocess.run(
            [str(python), "-m", "pip", "install", "-q", "--no-deps", f"openvino=={OLD_RELEASE}"],
            check=True,
            capture_output=True,
            timeout=600,
        )
    ours = next(p for p in map(Path, sys.path) if p.name == "site-packages" and p.is_dir())
    own = next((folder / "lib").glob("python3*/site-packages"))
    (own / "zz_farm_base.pth").write_text(f"import site; site.addsitedir({str(ours)!r})\n")
    found = subprocess.run(
        [str(python), "-c", "import openvino, farm; print(openvino.get_version())"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert found.startswith(OLD_RELEASE), found
    return str(python)


def _farm(python: str, env: dict[str, str], *args: str, expect: int = 0) -> dict:
    done = subprocess.run(
        [python, "-m", "farm", *args, "--json"],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=600,
        check=False,
    )
    assert done.returncode == expect, (
        f"farm {' '.join(args)} → {done.returncode}\n{done.stderr}\n{done.stdout[-2000:]}"
    )
    return json.loads(done.stdout)


def _plain_import(python: str, path: Path) -> str:
    """What any OpenVINO user does with a `.blob`: `core.import_model(bytes, "CPU")`."""
    script = (
        "import sys, openvino as ov\n"
        "compiled = ov.Core().import_model(open(sys.argv[1], 'rb').read(), 'CPU')\n"
        "print(compiled.inputs[0].get_any_name())\n"
    )
    done = subprocess.run(
        [python, "-c", script, str(path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_two_releases_each_compile_and_import_their_own_blobs(served, api, tmp_path, old_python):
    new_python = sys.executable
    served.start_worker("new")
    served.start_worker("old", python=old_python)
    workers = {w["name"]: w for w in _farm(new_python, served.env, "workers")}
    assert workers["new"]["toolchains"]["CPU"]["openvino"] == openvino_release()
    assert workers["old"]["toolchains"]["CPU"]["openvino"] == OLD_RELEASE

    xml = models.save_ir(models.conv_net(seed=11), tmp_path / "m" / "m.xml")
    keys = {}
    for release, python in ((openvino_release(), new_python), (OLD_RELEASE, old_python)):
        edge = {
            "FARM_API_URL": api.url,
            "FARM_TOKEN": api.tokens["submit"],
            "FARM_HOME": str(tmp_path / release / "home"),
            "FARM_CACHE_DIR": str(tmp_path / release / "cache"),
            "FARM_TRUSTED_KEYS": served.env["FARM_TRUSTED_KEYS"],
        }
        submitted = _farm(python, edge, "submit", str(xml), "-d", "CPU", "--wait")
        job = submitted["job"]
        assert job["state"] == "succeeded", job
        # The worker with the edge's toolchain compiled it; the other never saw the job.
        assert job["worker"] == ("new" if python == new_python else "old")
        keys[release] = submitted["cache_key"]
        out = tmp_path / release / "model.blob"
        pulled = _farm(python, edge, "pull", str(xml), "-d", "CPU", "--import", "-o", str(out))
        assert pulled["cache_key"] == keys[release] and pulled["import_seconds"] > 0
        assert pulled["toolchain"]["openvino"] == release
        assert _plain_import(python, out) == "x"
    assert keys[openvino_release()] != keys[OLD_RELEASE]

    # A fleet manifest may name another toolchain per model: this machine (the new release)
    # computes the key of those edges' blob and asks the farm for it. It cannot import it.
    old_toolchain = tmp_path / "old.json"
    old_toolchain.write_text(json.dumps(_farm(old_python, {}, "toolchain")))
    manifest = tmp_path / "fleet.toml"
    manifest.write_text(
        f'[[model]]\npath = "{xml}"\ndevice = "CPU"\ntoolchain = "{old_toolchain}"\n'
        f'[[model]]\npath = "{xml}"\ndevice = "CPU"\n'
    )
    pull = {
        "FARM_API_URL": api.url,
        "FARM_TOKEN": api.tokens["pull"],
        "FARM_CACHE_DIR": str(tmp_path / "manager-cache"),
        "FARM_TRUSTED_KEYS": served.env["FARM_TRUSTED_KEYS"],
    }
    old_entry, own_entry = _farm(new_python, pull, "agent", "sync", str(manifest), expect=3)
    assert (old_entry["cache_key"], old_entry["status"]) == (keys[OLD_RELEASE], "incompatible")
    assert (own_entry["cache_key"], own_entry["status"]) == (keys[openvino_release()], "ready")


def test_a_release_no_worker_has_waits_says_so_and_gives_up_without_failing(served, api, tmp_path):
    served.start_worker("new")
    xml = models.save_ir(models.conv_net(seed=12), tmp_path / "m" / "m.xml")
    toolchain = tmp_path / "old-edge.json"
    toolchain.write_text(
        json.dumps({"target": "CPU", "openvino": "2024.6.0", "runtime_requirements": "ov=2024.6.0"})
    )
    edge = {"FARM_API_URL": api.url, "FARM_TOKEN": api.tokens["submit"]}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "farm",
            "submit",
            str(xml),
            "-d",
            "CPU",
            "--toolchain",
            str(toolchain),
            "--wait",
            "--wait-timeout",
            "3",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, **edge},
        timeout=120,
    )
    assert done.returncode == 7, done.stderr  # README: gave up waiting; the job goes on
    # No live worker could take it: given up at once, not after the timeout.
    assert done.stderr.count('no live worker has the toolchain {"openvino": "2024.6.0"') == 1
    assert done.stderr.startswith("farm: error: not waiting for job ")
    (job,) = _farm(sys.executable, {**edge}, "jobs")
    assert job["state"] == "queued" and job["toolchain"]["openvino"] == "2024.6.0"
