"""The compile child, observed while it runs: it holds none of the worker's secrets, runs as an
unprivileged user when the worker is root, and cannot write a blob past its size limit."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import numpy as np
import openvino as ov
import pytest
from openvino import opset13 as ops

from farm.core import errors
from farm.core.hashing import model_files
from farm.core.spec import CompileSpec
from farm.server.jobs import sandbox
from tests import models

SECRETS = {
    "FARM_DATABASE_URL": "postgresql+psycopg://farm:db-password@127.0.0.1:5432/farm",
    "FARM_BROKER_URL": "redis://:broker-password@127.0.0.1:6390/0",
    "FARM_S3_SECRET_ACCESS_KEY": "s3-secret",
    "FARM_SIGNING_KEY": "/run/secrets/farm-signing.pem",
}


def broadcast_net(elements: int) -> ov.Model:
    """About 2 KB of IR whose one-float constant is broadcast to `elements` floats: constant
    folding at compile time turns it into a blob of 4 x `elements` bytes."""
    x = ops.parameter([1], ov.Type.f32, name="x")
    small = ops.constant(np.array([1.5], dtype=np.float32))
    big = ops.broadcast(small, ops.constant(np.array([elements], dtype=np.int64)))
    return ov.Model([ops.add(big, x)], [x], "broadcast_net")


def children_of(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                status = Path(f"/proc/{entry}/status").read_text()
            except OSError:
                continue
            if f"\nPPid:\t{pid}\n" in status:
                found.append(int(entry))
    return found


def observe(pid: int) -> dict | None:
    """What /proc shows of a running process: its uids, environment and working folder."""
    try:
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        cwd = os.readlink(f"/proc/{pid}/cwd")
    except OSError:  # it ended meanwhile
        return None
    uids = next(line for line in status if line.startswith("Uid:")).split()[1:]
    env = dict(item.decode().split("=", 1) for item in environ if item)
    return {"uids": [int(uid) for uid in uids], "env": env, "cwd": cwd}


def test_the_compile_child_holds_no_worker_secrets_and_runs_unprivileged(tmp_path, monkeypatch):
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)  # the worker's own environment
    monkeypatch.setattr(sandbox, "POLL_SECONDS", 0.02)  # look at the child often
    files = model_files(models.save_ir(models.large_net(64), tmp_path / "m" / "big.xml"))
    seen: list[dict] = []

    def look() -> bool:  # called by the watching process while the child runs
        seen.extend(filter(None, map(observe, children_of(os.getpid()))))
        return False

    result, _ = sandbox.compile_in_child(
        files,
        CompileSpec.create("CPU"),
        tmp_path / "out",
        "k",
        timeout_seconds=120,
        should_stop=look,
    )

    assert result.blob_path == tmp_path / "out" / "k.blob" and result.blob_path.is_file()
    assert result.size_bytes == result.blob_path.stat().st_size > 64 * 2**20
    assert len(seen) >= 5
    box = seen[0]["cwd"]
    # A folder of its own, since removed: in the temporary directory when it switches user
    # (a folder every user may reach), else beside the output.
    root = Path(tempfile.gettempdir()) if os.geteuid() == 0 else tmp_path
    assert Path(box).parent == root and not Path(box).exists()
    for sight in seen:
        assert not [name for name in sight["env"] if name.startswith("FARM_")]
        assert not set(SECRETS.values()) & set(sight["env"].values())
        assert sight["env"]["HOME"] == sight["env"]["TMPDIR"] == sight["cwd"] == box
    if os.geteuid() == 0:
        # It starts as root (to load OpenVINO from where only root may read), then compiles
        # as nobody: every uid (real, effective, saved, file system) switched, for good.
        assert seen[-1]["uids"] == [65534] * 4
        switched = [i for i, sight in enumerate(seen) if sight["uids"] == [65534] * 4]
        assert switched == list(range(switched[0], len(seen)))
    else:
        assert all(sight["uids"] == [os.getuid()] * 4 for sight in seen)


def test_a_blob_past_its_size_limit_stops_the_compile_and_leaves_nothing(tmp_path):
    xml = models.save_ir(broadcast_net(16 * 2**20), tmp_path / "m" / "bc.xml")  # a 64 MiB blob
    assert xml.stat().st_size + xml.with_suffix(".bin").stat().st_size < 4096
    started = time.monotonic()
    with pytest.raises(errors.BlobTooLarge) as raised:
        sandbox.compile_in_child(
            model_files(xml),
            CompileSpec.create("CPU"),
            tmp_path / "out",
            "k",
            timeout_seconds=120,
            max_blob_bytes=16 * 2**20,
        )
    assert str(raised.value) == sandbox.blob_limit_message(16 * 2**20)
    assert str(raised.value).startswith(
        "the compiled blob exceeded its size limit of 16777216 bytes (16 MiB: "
        "FARM_MAX_BLOB_RATIO times the model's size plus FARM_BLOB_BYTES_OVER_MODEL"
    )
    assert list((tmp_path / "out").iterdir()) == []
    assert time.monotonic() - started < 60
