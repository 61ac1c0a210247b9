"""The CLI's light reads answer what the ORM answers on PostgreSQL too (an operator's `farm
jobs|blobs|status` with FARM_DATABASE_URL): the tests of tests/unit/test_reads.py, on a farm
whose database is a fresh PostgreSQL one."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from farm.server.context import FarmContext
from farm.server.db.session import upgrade_database
from tests.unit.conftest import close_farm, open_farm
from tests.unit.test_reads import (  # noqa: F401  (the same tests, collected here)
    farm_with_rows,
    test_a_blob_its_keys_and_its_latest_job_are_the_orms,
    test_a_jobs_view_is_the_orms_with_its_phases_and_notes,
    test_blob_pages_are_the_orms,
    test_job_pages_are_the_orms,
)

pytestmark = pytest.mark.postgres


@pytest.fixture
def embedded_farm(tmp_path, monkeypatch, postgres_url) -> Iterator[FarmContext]:
    upgrade_database(postgres_url)
    (tmp_path / "farm").mkdir()  # the store and add_blob's sources live there
    farm = open_farm(tmp_path / "farm", monkeypatch, database_url=postgres_url)
    yield farm
    close_farm(farm)
