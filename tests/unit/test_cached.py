"""A whole-table aggregate cached per API process (farm.server.api.cached): computed once, started
at the process's start (`warm`), waited for rather than computed twice."""

from __future__ import annotations

import threading

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


def test_warming_computes_in_the_background_and_a_request_waits_for_it():
    gate = threading.Event()
    compute = Counting(gate)
    cached = Cached(compute, 3600)
    cached.warm()
    assert compute.started.wait(10)
    cached.warm()  # under way: not a second computation
    answers: list[int] = []
    request = threading.Thread(target=lambda: answers.append(cached.get()))
    request.start()
    request.join(0.2)
    assert request.is_alive()  # waits for the warm-up rather than computing again
    gate.set()
    request.join(10)
    assert answers == [1] and compute.runs == 1


def test_a_failed_warm_up_leaves_the_first_request_to_compute():
    outcomes = iter([RuntimeError("database down"), 7])

    def compute() -> int:
        outcome = next(outcomes)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    cached = Cached(compute, 3600)
    cached.warm()
    assert cached.get() == 7


def test_no_period_computes_on_every_request_and_never_warms():
    compute = Counting()
    cached = Cached(compute, 0)
    cached.warm()
    assert compute.runs == 0
    assert [cached.get(), cached.get()] == [1, 2]


def test_a_stale_value_is_served_while_it_is_refreshed(monkeypatch):
    from farm.server.api import cached as module

    compute = Counting()
    cached = Cached(compute, 60)
    assert cached.get() == 1
    later = module.time.monotonic() + 60
    monkeypatch.setattr(module.time, "monotonic", lambda: later)
    assert cached.get() == 1  # the last value at once; the refresh runs in the background
