"""What the compile child may hold and write (docs/architecture.md §6): an allowlisted
environment with no worker secrets, an unprivileged user when the worker is root, and a blob
size limit that the runner checks again before anything is uploaded."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from sqlalchemy import select

from farm import toolchain
from farm.core import errors
from farm.core.config import Settings
from farm.core.errors import SandboxUnavailable
from farm.server.context import FarmContext
from farm.server.db.models import Blob, Job
from farm.server.jobs import compile_user, runner, sandbox
from farm.server.jobs.compiler import CompileResult
from farm.server.jobs.runner import RunLimits, blob_size_limit, run_job
from farm.server.jobs.service import submit_matrix
from tests.unit.conftest import CPU, TOOLCHAIN, make_ref

WORKER_ENVIRONMENT = {
    "FARM_DATABASE_URL": "postgresql+psycopg://farm:db-password@db/farm",
    "FARM_BROKER_URL": "redis://:broker-password@redis:6379/0",
    "FARM_S3_ACCESS_KEY_ID": "farm",
    "FARM_S3_SECRET_ACCESS_KEY": "s3-secret",
    "FARM_SIGNING_KEY": "/run/secrets/farm-signing.pem",
    "FARM_TOKEN": "token",
    "AWS_SECRET_ACCESS_KEY": "aws-secret",
    "LD_PRELOAD": "/tmp/evil.so",
    "HOME": "/root",
    "TMPDIR": "/var/tmp",
    "PATH": "/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "LD_LIBRARY_PATH": "/opt/intel/lib",
    "PYTHONPATH": "/opt/farm",
    "OV_CPU_DEBUG_LOG": "-",
    "OPENVINO_LOG_LEVEL": "2",
    "NPU_PLATFORM_OVERRIDE": "4000",
    "ZE_ENABLE_VALIDATION_LAYER": "0",
    "TBB_MALLOC_USE_HUGE_PAGES": "1",
}


def test_the_compile_child_environment_is_an_allowlist_without_worker_secrets(tmp_path):
    env = sandbox.child_environment(WORKER_ENVIRONMENT, tmp_path)
    assert env == {
        "PATH": "/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "LD_LIBRARY_PATH": "/opt/intel/lib",
        "PYTHONPATH": "/opt/farm",
        "OV_CPU_DEBUG_LOG": "-",
        "OPENVINO_LOG_LEVEL": "2",
        "NPU_PLATFORM_OVERRIDE": "4000",
        "ZE_ENABLE_VALIDATION_LAYER": "0",
        "TBB_MALLOC_USE_HUGE_PAGES": "1",
        "HOME": str(tmp_path),
        "TMPDIR": str(tmp_path),
        "PYTHONDONTWRITEBYTECODE": "1",
    }


@pytest.mark.skipif(os.geteuid() != 0, reason="only a worker running as root switches user")
def test_a_root_worker_compiles_as_nobody_unless_told_otherwise():
    nobody = compile_user.ChildUser(65534, 65534)
    assert compile_user.compile_identity() == nobody
    assert compile_user.compile_identity("nobody") == nobody
    assert compile_user.compile_identity("65534") == nobody
    assert compile_user.compile_identity("4242") == compile_user.ChildUser(
        4242, 4242
    )  # no passwd entry
    assert compile_user.compile_identity("root") is None
    assert compile_user.compile_identity("0") is None
    with pytest.raises(SandboxUnavailable, match=r"no user 'no-such-user' .*FARM_COMPILE_USER"):
        compile_user.compile_identity("no-such-user")


@pytest.mark.skipif(os.geteuid() == 0, reason="checks a worker that is not root")
def test_a_worker_that_is_not_root_compiles_as_itself():
    assert compile_user.compile_identity() is None
    assert compile_user.compile_identity("nobody") is None


def test_a_launcher_is_used_only_by_a_worker_that_is_not_root(tmp_path, monkeypatch):
    launcher = tmp_path / "compile-launcher"
    launcher.write_text("#!/bin/sh\n")
    launcher.chmod(0o750)
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert compile_user.compile_identity("4242", launcher) == compile_user.ChildUser(4242, 4242)
    monkeypatch.setattr(os, "geteuid", lambda: 10001)
    monkeypatch.setattr(os, "getuid", lambda: 10001)
    assert compile_user.compile_identity("4242", launcher) == compile_user.ChildUser(
        4242, 4242, launcher
    )
    assert compile_user.compile_identity("4242") is None  # no launcher: the worker's own user
    for itself in ("10001", "root"):
        with pytest.raises(SandboxUnavailable, match=r"must name a user of its own"):
            compile_user.compile_identity(itself, launcher)
    with pytest.raises(SandboxUnavailable, match=r"FARM_COMPILE_LAUNCHER .* is not an exec"):
        compile_user.compile_identity("4242", tmp_path / "missing")
    assert "FARM_COMPILE_LAUNCHER is unset" in compile_user.warn_if_compiles_as_worker(None)
    assert compile_user.warn_if_compiles_as_worker(launcher) is None
    command = compile_user.launched(compile_user.ChildUser(4242, 4243, launcher), ["python", "-P"])
    assert command == [
        str(launcher),
        "--reuid=4242",
        "--regid=4243",
        "--clear-groups",
        "--inh-caps=-all",
        "--no-new-privs",
        "--",
        "python",
        "-P",
    ]
    # The C library drops these when it starts the launcher (file capabilities): set again.
    env = {"LD_LIBRARY_PATH": "/opt/ov", "TMPDIR": "/tmp/box", "PATH": "/usr/bin"}
    again = compile_user.launched(compile_user.ChildUser(4242, 4243, launcher), ["python"], env)
    assert again[again.index("--") + 1 :] == [
        shutil.which("env"),
        "LD_LIBRARY_PATH=/opt/ov",
        "TMPDIR=/tmp/box",
        "python",
    ]


def test_the_blob_limit_is_a_ratio_of_the_model_the_admin_sets_unless_a_size_is_set():
    assert blob_size_limit(2621) == 4 * 2621 + 64 * 2**20
    assert blob_size_limit(2621) < 240 * 10**6  # the 2.6 KB IR made a 240 MB blob
    assert blob_size_limit(2 * 2**30) == 8 * 2**30 + 64 * 2**20
    assert blob_size_limit(2621, 2**20) == 2**20
    assert blob_size_limit(1000, None, 2.5, 2**20) == 2500 + 2**20
    tight = FarmContext(Settings(max_blob_ratio=2, blob_bytes_over_model=2**20)).run_limits
    assert (tight.max_blob_ratio, tight.blob_bytes_over_model) == (2, 2**20)
    limits = FarmContext(Settings(max_blob_bytes=2**20, compile_user="farm-compile")).run_limits
    assert (limits.max_blob_bytes, limits.compile_user) == (2**20, "farm-compile")


# --- the runner checks the blob's size again before uploading it ------------------------------


def oversized_compile(blob_bytes: int, asked: list[int | None]):
    """A stand-in for `sandbox.compile_in_child` whose child wrote `blob_bytes` whatever its
    limit (as where RLIMIT_FSIZE could not be set); `asked` records the limit it was given."""

    def compile_in_child(files, spec, out_dir, blob_id, *, max_blob_bytes, **limits):
        asked.append(max_blob_bytes)
        out_dir.mkdir(parents=True)
        blob = out_dir / f"{blob_id}.blob"
        blob.write_bytes(b"\0" * blob_bytes)
        return CompileResult(blob, 0, 10, TOOLCHAIN, 0.1, 0.01, 2**20, {}), ""

    return compile_in_child


@pytest.mark.parametrize("limit", [None, 4096])
def test_a_blob_over_its_limit_fails_the_job_before_anything_is_uploaded(
    embedded_farm, stub, tmp_path, monkeypatch, limit
):
    ref = make_ref(tmp_path / "model")
    with embedded_farm.session() as session:
        submitted = submit_matrix(
            session,
            embedded_farm.store,
            embedded_farm.settings,
            stub,
            ref.identity,
            [CPU],
            TOOLCHAIN,
            describe_model=lambda: ref.info,
            upload_from=ref,
        )
    job_id = submitted.results[0][1].job_id
    expected = limit or 4 * ref.info.size_bytes + 64 * 2**20
    asked: list[int | None] = []
    monkeypatch.setattr(runner, "compile_in_child", oversized_compile(expected + 1, asked))
    monkeypatch.setattr(toolchain, "host_toolchain", lambda target: TOOLCHAIN)  # as it reports
    (tmp_path / "work").mkdir()
    limits = RunLimits(max_run_seconds=60, max_blob_bytes=limit)
    job = run_job(
        embedded_farm.sessions,
        embedded_farm.store,
        job_id,
        limits=limits,
        work_root=tmp_path / "work",
    )

    assert asked == [expected]
    assert job.state == "failed" and job.attempts == 1
    assert job.error == sandbox.blob_limit_message(expected)
    assert f"size limit of {expected} bytes" in job.error and "FARM_MAX_BLOB_BYTES" in job.error
    with embedded_farm.session() as session:
        assert list(session.scalars(select(Blob))) == []
        assert session.get(Job, job_id).state == "failed"
    assert list(Path(embedded_farm.store.root / "blobs").glob("*")) == []
    assert list((tmp_path / "work").iterdir()) == []  # the work folder went, blob and all


# --- the worker takes only a regular file out of the child's folder ----------------------------


@pytest.mark.parametrize("planted", ["symlink", "hard link", "fifo", "directory"])
def test_the_worker_takes_no_link_or_fifo_from_the_compile_folder_for_a_blob(tmp_path, planted):
    """The compile user owns its folder: it could leave there, under the blob's name, a link to
    a file of the worker's (the signing key) for the worker to upload and sign."""
    secret = tmp_path / "signing.pem"
    secret.write_text("PRIVATE KEY")
    box, out = tmp_path / "box", tmp_path / "out"
    box.mkdir()
    out.mkdir()
    written = box / "k.blob"
    if planted == "symlink":
        written.symlink_to(secret)
    elif planted == "hard link":
        os.link(secret, written)
    elif planted == "fifo":
        os.mkfifo(written)
    else:  # renamed as root, it was then unlinked as a file: IsADirectoryError, retried
        written.mkdir()
        (written / "inside").write_text("x")
    with pytest.raises(errors.CompileError, match="something other than a blob file"):
        sandbox._take_blob(written, out / "k.blob")
    assert list(out.iterdir()) == []
    assert secret.read_text() == "PRIVATE KEY"


def test_the_worker_takes_a_regular_blob_file(tmp_path):
    (tmp_path / "box").mkdir()
    written = tmp_path / "box" / "k.blob"
    written.write_bytes(b"blob")
    assert sandbox._take_blob(written, tmp_path / "k.blob") == tmp_path / "k.blob"
    assert (tmp_path / "k.blob").read_bytes() == b"blob" and not written.exists()
