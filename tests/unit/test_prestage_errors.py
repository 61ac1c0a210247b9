"""`farm submit`'s early copies of a model into the embedded store leave nothing on an error."""

from __future__ import annotations

import pytest

from farm.cli.backends import direct
from farm.core.config import Settings
from farm.server.storage import local


def test_copies_started_before_a_file_went_missing_are_deleted(tmp_path):
    first = tmp_path / "model.xml"
    first.write_bytes(b"<net/>" * 100_000)
    settings = Settings(home=tmp_path / "farm")
    try:
        with pytest.raises(FileNotFoundError):
            direct.prestage_unhashed(settings, [first, tmp_path / "gone.bin"])
        assert local._PRESTAGED == {}  # stopped, not left to finish
        assert [p for p in (tmp_path / "farm").rglob("*") if p.is_file()] == []
    finally:
        local.discard_prestaged()
