"""A whole-table aggregate cached per API process (farm.server.api.cached): computed once,
waited for rather than computed twice."""

from __future__ import annotations

import threading

import pytest

from farm.server.api.cached import Cached


class Counting:
    """A computation that counts its runs and, when `gate` is given, waits for it to open."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.runs = 0
        self.gate = gate
        self.started = threading.Event()

    def __call__(self) -> int:
        self.runs += 1
        self.started.set()
        if self.gate is not None:
            assert self.gate.wait(10)
        return self.runs


def test_a_value_is_computed_once_within_its_period():
    compute = Counting()
    cached = Cached(compute, 3600)
    assert [cached.get(), cached.get()] == [1, 1]
    assert compute.runs == 1


def test_a_request_during_the_first_computation_waits_for_it():
    gate = threading.Event()
    compute = Counting(gate)
    cached = Cached(compute, 3600)
    answers: list[int] = []
    first = threading.Thread(target=lambda: answers.append(cached.get()))
    first.start()
    assert compute.started.wait(10)
    second = threading.Thread(target=lambda: answers.append(cached.get()))
    second.start()
    second.join(0.2)
    assert second.is_alive()  # waits for the first computation rather than computing again
    gate.set()
    first.join(10)
    second.join(10)
    assert answers == [1, 1] and compute.runs == 1


def test_a_failed_first_computation_leaves_the_next_request_to_compute():
    outcomes = iter([RuntimeError("database down"), 7])

    def compute() -> int:
        outcome = next(outcomes)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    cached = Cached(compute, 3600)
    with pytest.raises(RuntimeError, match="database down"):
        cached.get()
    assert cached.get() == 7


def test_no_period_computes_on_every_request():
    compute = Counting()
    cached = Cached(compute, 0)
    assert [cached.get(), cached.get()] == [1, 2]


def test_a_stale_value_is_served_while_it_is_refreshed(monkeypatch):
    from farm.server.api import cached as module

    compute = Counting()
    cached = Cached(compute, 60)
    assert cached.get() == 1
    later = module.time.monotonic() + 60
    monkeypatch.setattr(module.time, "monotonic", lambda: later)
    assert cached.get() == 1  # the last value at once; the refresh runs in the background
