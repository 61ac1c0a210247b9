"""An edge's verification of a blob whose reference outputs are still pending (they follow the
blob, docs §14): it resolves again while they are, returns the record once they are no longer
(ready, or none will come), and past its wait has not judged the blob: `ReferencePending`
from `farm verify`, an error report (neither kept nor sent) from `verify_once`."""

from __future__ import annotations

import time

import pytest

from farm.core.errors import ReferencePending
from farm.edge import verify


class Resolver:
    """An agent whose farm answers `records` in turn (the last one from then on)."""

    def __init__(self, *records: dict) -> None:
        self.records, self.asked = list(records), 0

    def resolve(self, cache_key: str) -> dict:
        self.asked += 1
        return self.records[min(self.asked, len(self.records)) - 1]


@pytest.fixture(autouse=True)
def quick_polls(monkeypatch):
    monkeypatch.setattr(verify, "REFERENCE_POLL_SECONDS", (0.01, 0.02))


def record(state: str | None) -> dict:
    return {"cache_key": "k", "reference_state": state, "reference_sha256": "d" * 64}


def test_a_pending_reference_is_waited_for_until_it_is_ready():
    agent = Resolver(record("pending"), record("pending"), record("ready"))
    assert verify.wait_for_reference(agent, "k", None, 5)["reference_state"] == "ready"
    assert agent.asked == 3


@pytest.mark.parametrize("state", ["ready", "skipped", None])
def test_a_settled_or_older_record_is_not_asked_again(state):
    agent = Resolver(record(state))
    assert verify.wait_for_reference(agent, "k", record(state), 5) == record(state)
    assert agent.asked == 0


def test_still_pending_past_the_wait_is_not_judged_yet():
    agent = Resolver(record("pending"))
    began = time.monotonic()
    with pytest.raises(ReferencePending, match="not judged yet, nothing reported"):
        verify.wait_for_reference(agent, "k", None, 0.2)
    assert 0.2 <= time.monotonic() - began < 2 and agent.asked > 2
    assert ReferencePending.kind.value == "cannot_run_here"  # farm verify: exit 4


def test_verify_once_answers_an_error_report_for_a_pending_reference():
    outcome = verify.verify_once(Resolver(record("pending")), "k", wait_seconds=0.05)
    assert outcome is not None and outcome["passed"] is False and outcome["reference_pending"]
    assert "still being computed" in outcome["error"]
