"""bench/tune.py: a full benchmark run holds free page reporting and puts it back after."""

from __future__ import annotations

import pytest

from bench import tune


@pytest.fixture
def knobs(tmp_path, monkeypatch):
    (tmp_path / "min_free_ms").write_text("0\n")
    (tmp_path / "reported_kib").write_text("1024\n")
    monkeypatch.setattr(tune, "PAGE_REPORTING", tmp_path)
    monkeypatch.delenv("FARM_BENCH_TUNE", raising=False)
    return tmp_path


def test_reporting_is_held_during_the_run_and_put_back_even_after_an_error(knobs):
    with pytest.raises(RuntimeError), tune.held() as steady:
        assert steady
        assert tune.state() == {"min_free_ms": tune.HOLD_MS, "reported_kib": 1024}
        raise RuntimeError("a benchmark failed")
    assert (knobs / "min_free_ms").read_text() == "0"


def test_farm_bench_tune_0_leaves_the_machine_alone(knobs, monkeypatch):
    monkeypatch.setenv("FARM_BENCH_TUNE", "0")
    with tune.held() as steady:
        assert not steady
        assert tune.state()["min_free_ms"] == 0


def test_a_kernel_without_page_reporting_runs_as_it_is(tmp_path, monkeypatch):
    monkeypatch.setattr(tune, "PAGE_REPORTING", tmp_path / "absent")
    with tune.held() as steady:
        assert not steady
    assert tune.state() is None
