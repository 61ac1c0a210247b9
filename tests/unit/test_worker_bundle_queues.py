"""Which bundle queues a worker consumes, and the keys it must load before it starts
(workers/main.py; docs/architecture.md §17)."""

from __future__ import annotations

from pathlib import Path

import pytest

from farm.core.config import Settings
from farm.core.errors import ServiceUnavailable
from farm.core.signing import create_key_pair
from farm.server import routing
from workers.main import check_trusted_keys, genai_toolchains

GENAI = {routing.GENAI_CONVERTER: "installed"}


def test_a_worker_without_a_signing_key_takes_no_bundle_parts() -> None:
    """It could sign neither a part's listing nor the bundle's manifest."""
    assert genai_toolchains(["CPU"], GENAI, can_sign=False) == {}
    assert genai_toolchains(["CPU"], {}, can_sign=True) == {}
    pytest.importorskip("openvino_genai")
    assert genai_toolchains(["CPU"], GENAI, can_sign=True).keys() == {"CPU"}


def test_a_worker_whose_trusted_keys_do_not_load_does_not_start(tmp_path: Path) -> None:
    public, _ = create_key_pair(tmp_path / "farm.pem")
    check_trusted_keys(Settings(trusted_keys=str(public)))
    check_trusted_keys(Settings(trusted_keys=None))
    with pytest.raises(ServiceUnavailable, match="FARM_TRUSTED_KEYS"):
        check_trusted_keys(Settings(trusted_keys=str(tmp_path / "only-on-the-edges.pub")))
