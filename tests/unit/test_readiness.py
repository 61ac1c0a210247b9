"""`/readyz` is cheap: one check per cache window, with the process's own clients."""

from __future__ import annotations

from farm.server.readiness import Readiness


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_one_check_answers_every_probe_within_the_cache_window(embedded_farm):
    clock = Clock()
    readiness = Readiness(embedded_farm, cache_seconds=2.0, clock=clock)
    answers = [readiness.checks() for _ in range(100)]
    assert readiness.checked == 1
    assert all(answer is answers[0] for answer in answers)
    assert [(c.name, c.ok) for c in answers[0]] == [("database", True), ("storage", True)]

    clock.now += 1.9
    readiness.checks()
    assert readiness.checked == 1
    clock.now += 0.1
    readiness.checks()
    assert readiness.checked == 2
