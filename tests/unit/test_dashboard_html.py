"""The dashboard's per-blob verification column (farm.server.api.dashboard_html): what the fleet
knows of a blob's numbers, a pure rule of its row."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from farm.server.api.dashboard_html import _verification_state


def _blob(**fields: object) -> SimpleNamespace:
    row = {"quarantined_at": None, "quarantine_reason": None, "reference_state": None}
    return SimpleNamespace(**{**row, "reference_sha256": None, **fields})


@pytest.mark.parametrize(
    ("fields", "shown"),
    [
        ({"reference_state": "ready", "reference_sha256": "a" * 64}, "reference outputs"),
        ({"reference_state": "pending"}, "reference pending"),  # computed after the blob
        ({"reference_state": "skipped"}, "no reference"),
        ({}, "no reference"),  # a blob recorded before references followed it
        (
            {
                "quarantined_at": "2026-11-25",
                "quarantine_reason": "max abs 3.1",
                "reference_state": "ready",
            },
            "QUARANTINED: max abs 3.1",
        ),
    ],
)
def test_the_verification_column_says_what_is_known(fields, shown):
    assert _verification_state(_blob(**fields)) == shown
