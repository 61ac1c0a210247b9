"""A stage's output IR goes into the store, and what the compile then reads is what was stored."""

from __future__ import annotations

import hashlib
import os

import pytest

from farm.server.jobs.sandbox import StageRun
from farm.server.stages import phase
from farm.server.storage.local import LocalStore


class _Convert:
    kind = "convert"


@pytest.mark.parametrize("owner", ["this process", "the compile user"])
def test_the_compile_reads_the_stored_output_ir(tmp_path, owner):
    if owner == "the compile user" and os.geteuid() != 0:
        pytest.skip("gives the files to another user")
    out = tmp_path / "stage" / "out"
    out.mkdir(parents=True)
    xml, weights = out / "model.xml", out / "model.bin"
    xml.write_bytes(b"<net>" + b"x" * 200_000 + b"</net>")
    weights.write_bytes(os.urandom(3_000_000))
    if owner == "the compile user":  # as the box leaves them: copied, never moved, and given up
        for path in (xml, weights):
            os.chown(path, 65534, 65534)
    digests = {
        role: hashlib.sha256(p.read_bytes()).hexdigest()
        for role, p in (("xml", xml), ("bin", weights))
    }
    store = LocalStore(tmp_path / "store")

    outputs, identity, size = phase._store_files(
        store, _Convert, StageRun(xml, weights, {}, {}, "", digests)
    )

    assert identity == digests and size == 3_000_000 + 200_011
    for role, path in outputs.items():
        assert path == store.local_path(f"models/{digests[role]}")
        assert hashlib.sha256(path.read_bytes()).hexdigest() == digests[role]
