"""`farm submit`'s early copies of a model into the embedded store leave nothing on an error."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from farm.cli.backends import ahead
from farm.core.config import Settings
from farm.server.storage import local


def test_copies_started_before_a_file_went_missing_are_deleted(tmp_path):
    first = tmp_path / "model.xml"
    first.write_bytes(b"<net/>" * 100_000)
    settings = Settings(home=tmp_path / "farm")
    try:
        with pytest.raises(FileNotFoundError):
            ahead.prestage_unhashed(settings, [first, tmp_path / "gone.bin"])
        assert local._PRESTAGED == {}  # stopped, not left to finish
        assert [p for p in (tmp_path / "farm").rglob("*") if p.is_file()] == []
    finally:
        local.discard_prestaged()


def test_the_early_copy_starts_without_the_database_libraries(tmp_path):
    """The copy of a new model is the longest thing the submit waits for before its compile:
    it starts beside the hash, with the compile child, before `farm.cli.backends.direct`
    (SQLAlchemy, the job service) is loaded, and loads neither that nor OpenVINO in this
    process (bench/README.md "submit_overhead: the seventh pass")."""
    model = tmp_path / "model.xml"
    model.write_bytes(b"<net/>" * 1000)
    script = f"""
import sys
from pathlib import Path
from farm.cli.backends import ahead
from farm.core.config import Settings
from farm.server.storage import local
from farm.core.spec import Target
from farm.server.jobs import sandbox
settings = Settings(home=Path({str(tmp_path / "farm")!r}))
assert ahead.prestart_compile(settings, Target.parse("CPU"))
assert ahead.prestage_unhashed(settings, [Path({str(model)!r})], compiled_as_is=True)
assert list(local._PRESTAGED) == [{str(model)!r}]
ahead.discard_prestaged()
assert not sandbox._WAITING and not local._PRESTAGED
print(sorted(m for m in sys.modules if m.split(".")[0] in ("sqlalchemy", "openvino")
             or m in ("farm.cli.backends.direct", "farm.server.jobs.service")))
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FARM_")}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "[]", done.stdout
    assert [p for p in (tmp_path / "farm").rglob("*") if p.is_file()] == []
