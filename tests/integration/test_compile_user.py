"""A worker that is not root, set up as the Docker image sets it up (docker/compile-sandbox.sh:
its own user, a compile user, the setpriv launcher with file capabilities), runs a model whose
compile takes over the child (tests/exploit: a stand-in for a model-reader bug). The child
cannot read the signing key, the worker's environment, another submitter's cached model, nor
run the launcher; the worker still compiles, signs and stores the blob.

Needs root to create the users (tests run as root here and in CI); elsewhere it is skipped.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from farm.core.hashing import sha256_file
from farm.core.signing import create_key_pair
from tests import models

ROOT = Path(__file__).resolve().parents[2]
SETUP = ROOT / "docker" / "compile-sandbox.sh"
EXPLOIT = ROOT / "tests" / "exploit"

if os.geteuid() != 0:
    if os.environ.get("CI") == "true":
        pytest.fail("tests/integration/test_compile_user.py needs root in CI (it adds users)")
    pytestmark = pytest.mark.skip(reason="needs root: it adds two users and a launcher")
elif not (shutil.which("setcap") and shutil.which("setpriv") and shutil.which("useradd")):
    # scripts/test installs libcap2-bin where it can; util-linux and passwd are Debian's base.
    if os.environ.get("CI") == "true":
        pytest.fail("test_compile_user.py needs setpriv, setcap (libcap2-bin) and useradd in CI")
    pytestmark = pytest.mark.skip(reason="needs setpriv, setcap (libcap2-bin) and useradd")


@dataclass(frozen=True)
class Users:
    worker: pwd.struct_passwd
    compile: pwd.struct_passwd
    launcher: Path
    home: Path
    """The worker's own folder (0700): its keys, FARM_HOME, FARM_CACHE_DIR."""


@pytest.fixture
def users() -> Iterator[Users]:
    suffix = secrets.token_hex(3)
    worker, compile_user = f"farmw-{suffix}", f"farmc-{suffix}"
    tools = Path(tempfile.mkdtemp(prefix="farm-launcher-"))
    tools.chmod(0o755)
    launcher = tools / "libexec" / "compile-launcher"
    subprocess.run(
        ["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", worker], check=True
    )
    try:
        subprocess.run([str(SETUP), worker, compile_user, str(launcher)], check=True)
        home = Path(tempfile.mkdtemp(prefix="farm-worker-"))
        entry = pwd.getpwnam(worker)
        os.chown(home, entry.pw_uid, entry.pw_gid)
        users = Users(entry, pwd.getpwnam(compile_user), launcher, home)
        yield users
        shutil.rmtree(home, ignore_errors=True)
    finally:
        for name in (worker, compile_user):
            with contextlib.suppress(KeyError):  # what a failed test left running as them
                for pid in _pids_of(pwd.getpwnam(name).pw_uid):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            subprocess.run(["userdel", name], check=False, capture_output=True)
            subprocess.run(["groupdel", name], check=False, capture_output=True)
        shutil.rmtree(tools, ignore_errors=True)


@dataclass(frozen=True)
class Python:
    executable: str
    env: dict[str, str]


@pytest.fixture(scope="module")
def python() -> Iterator[Python]:
    folder = Path(tempfile.mkdtemp(prefix="farm-python-"))
    folder.chmod(0o755)
    yield python_for_every_user(folder)
    shutil.rmtree(folder, ignore_errors=True)


def python_for_every_user(folder: Path) -> Python:
    """An interpreter a user without a home may run, with this test's packages: this one if
    every folder above it is open, else a copy of its installation (the standard library; this
    host's Python lives under /root) in `folder`, which adds this one's site-packages."""
    real = Path(sys.executable).resolve()
    site = Path(sysconfig.get_paths()["purelib"])
    if all(os.stat(p).st_mode & 0o005 == 0o005 for p in [real, *real.parents, *site.parents]):
        return Python(sys.executable, {})
    base, version = (
        Path(sys.base_prefix),
        f"python{sys.version_info.major}.{sys.version_info.minor}",
    )
    copy = folder / "python"
    (copy / "bin").mkdir(parents=True)
    shutil.copy2(base / "bin" / version, copy / "bin" / version)
    shutil.copytree(
        base / "lib", copy / "lib", ignore=shutil.ignore_patterns("site-packages", "test")
    )
    own_site = copy / "lib" / version / "site-packages"
    own_site.mkdir()
    (own_site / "farm-test.pth").write_text(f"import site; site.addsitedir({str(site)!r})\n")
    # Its library path names the original's folder: the copy's own libpython comes first.
    return Python(str(copy / "bin" / version), {"LD_LIBRARY_PATH": str(copy / "lib")})


def hostile_ir(path: Path, targets: dict) -> Path:
    """A valid IR whose XML carries the exploit's marker (a comment; OpenVINO ignores it)."""
    xml = models.save_ir(models.conv_net(seed=7), path)
    head, rest = xml.read_text().split("\n", 1)
    xml.write_text(f"{head}\n<!-- farm-test-exploit {json.dumps(targets)} -->\n{rest}")
    return xml


def test_a_compile_that_takes_over_its_child_gets_no_secret_from_a_non_root_worker(
    users, python, served, tmp_path
):  # `served` after `users`: its workers stop before the users are removed
    worker_uid, worker_gid = users.worker.pw_uid, users.worker.pw_gid
    keys = users.home / "keys"
    key = keys / "signing.pem"
    public = Path(f"{key}.pub")
    create_key_pair(key)
    for path in (users.home, keys, key, public):
        os.chown(path, worker_uid, worker_gid)
    assert key.stat().st_mode & 0o777 == 0o600
    cache_dir = users.home / "cache"
    env = {
        "HOME": str(users.home),
        "TMPDIR": "/tmp",
        "FARM_HOME": str(users.home / "farm"),
        "FARM_CACHE_DIR": str(cache_dir),
        "FARM_SIGNING_KEY": str(key),
        "FARM_TRUSTED_KEYS": str(public),
        # As docker/Dockerfile sets them.
        "FARM_COMPILE_USER": users.compile.pw_name,
        "FARM_COMPILE_LAUNCHER": str(users.launcher),
        "PYTHONPATH": str(EXPLOIT),  # the child keeps PYTHONPATH
        **python.env,
    }
    # Root → the worker's user, with its groups (the compile user's among them), as `USER farm`.
    as_worker = ["setpriv", f"--reuid={worker_uid}", f"--regid={worker_gid}", "--init-groups"]
    worker = served.start_worker("w1", env=env, prefix=as_worker, python=python.executable)
    assert "FARM_COMPILE_LAUNCHER is unset" not in served.worker_log("w1")

    # Another submitter's model, compiled first: its files stay in the worker's model cache.
    victim = models.save_ir(models.conv_net(seed=1), tmp_path / "victim" / "victim.xml")
    done = json.loads(
        served.farm("submit", str(victim), "-d", "CPU", "--wait", "--json", check=False).stdout
    )
    assert done["job"]["state"] == "succeeded", served.farm_json("logs", str(done["job"]["id"]))[
        "log"
    ]
    cached = cache_dir / "models" / f"{sha256_file(victim.with_suffix('.bin'))}.blob"
    assert cached.is_file()

    targets = {
        "files": [str(key), str(cached)],
        "dirs": [str(cache_dir / "models"), str(keys)],
        "pids": [worker.pid],
        "commands": [[str(users.launcher), f"--reuid={worker_uid}", "--", "/bin/true"]],
        "linger": True,
    }
    hostile = hostile_ir(tmp_path / "hostile" / "hostile.xml", targets)
    job = served.farm_json("submit", str(hostile), "-d", "CPU", "--wait")["job"]
    log = served.farm_json("logs", str(job["id"]))["log"]
    lines = [line for line in log.splitlines() if line.startswith("farm-test-exploit ")]
    assert len(lines) == 1, log  # the exploit ran, once, in the compile child
    report = json.loads(lines[0].removeprefix("farm-test-exploit "))

    assert report.pop("uids") == [users.compile.pw_uid] * 3
    assert report.pop("own_model") == "read:"  # it can read what its job needs
    environ = {name: report.pop(name) for name in list(report) if name.startswith("environ ")}
    # Its parent (the pool process that runs the job) and the worker's main process.
    assert f"environ {worker.pid}" in environ and len(environ) in (1, 2)
    assert set(environ.values()) == {"refused: Permission denied"}
    assert report == {
        f"file {key}": "refused: Permission denied",
        f"file {cached}": "refused: Permission denied",
        f"dir {cache_dir / 'models'}": "refused: Permission denied",
        f"dir {keys}": "refused: Permission denied",
        f"run {' '.join(targets['commands'][0])}": "refused: Permission denied",
    }
    # The worker itself was unharmed: it compiled, signed and stored the hostile model's blob.
    assert job["state"] == "succeeded", job
    assert key.read_text() not in log
    assert served.settings.s3_secret_access_key not in log
    [blob] = [b for b in served.blobs() if b.cache_key == job["cache_key"]]
    assert blob.signature
    # What it left running in its process group was killed with it (by the compile user).
    assert _processes_of(users.compile.pw_uid) == []


def _processes_of(uid: int) -> list[str]:
    found = []
    for pid in _pids_of(uid):
        with contextlib.suppress(OSError):
            found.append(Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"))
    return found


def _pids_of(uid: int) -> list[int]:
    """Live processes of `uid`: a zombie (killed, not yet reaped by whoever inherited it; no
    memory, no files, nothing it can do) is not one."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        if f"\nUid:\t{uid}\t" in status and "\nState:\tZ" not in status:
            found.append(int(entry))
    return found


STOPPED_IN_TIME = """
import sys, time
from pathlib import Path
from farm.core.errors import CompileTimeout
from farm.core.hashing import model_files
from farm.core.spec import CompileSpec
from farm.server.jobs import sandbox
started = time.monotonic()
try:
    sandbox.compile_in_child(
        model_files(Path(sys.argv[1])), CompileSpec.create("CPU"), Path(sys.argv[2]), "k",
        timeout_seconds=1, compile_user=sys.argv[3], compile_launcher=Path(sys.argv[4]),
    )
except CompileTimeout:
    print(f"stopped after {time.monotonic() - started:.1f} s")
"""


def test_a_non_root_worker_stops_its_compile_child_of_another_uid_at_its_time_limit(
    users, python, tmp_path
):
    worker_uid, worker_gid = users.worker.pw_uid, users.worker.pw_gid
    xml = hostile_ir(users.home / "m" / "hangs.xml", {"hang": 600})  # the compile never ends
    for path in (users.home, xml.parent, xml, xml.with_suffix(".bin")):
        os.chown(path, worker_uid, worker_gid)
    as_worker = ["setpriv", f"--reuid={worker_uid}", f"--regid={worker_gid}", "--init-groups"]
    done = subprocess.run(
        [
            *as_worker,
            python.executable,
            "-c",
            STOPPED_IN_TIME,
            str(xml),
            str(users.home / "out"),
            users.compile.pw_name,
            str(users.launcher),
        ],
        capture_output=True,
        text=True,
        env={
            **os.environ,
            **python.env,
            "HOME": str(users.home),
            "TMPDIR": "/tmp",
            "PYTHONPATH": str(EXPLOIT),
        },
        cwd="/",
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("stopped after "), done.stdout + done.stderr
    assert float(done.stdout.split()[2]) < 30
    assert _processes_of(users.compile.pw_uid) == []  # killed, through the launcher
