"""bench/tune.py: a full benchmark run holds free page reporting and puts it back after."""

from __future__ import annotations

import signal
import threading

import pytest

from bench import report, tune


@pytest.fixture
def knobs(tmp_path, monkeypatch):
    (tmp_path / "min_free_ms").write_text("0\n")
    (tmp_path / "reported_kib").write_text("1024\n")
    monkeypatch.setattr(tune, "PAGE_REPORTING", tmp_path)
    monkeypatch.setattr(tune, "LOCK", tmp_path / "tune.lock")
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


def test_a_second_run_at_once_leaves_the_knob_to_the_first(knobs):
    with tune.held() as first:
        with tune.held() as second:
            assert first and not second
        assert tune.held_now(tune.state())  # the second did not put back the first's value
    assert (knobs / "min_free_ms").read_text() == "0"


def test_a_knob_that_cannot_be_set_runs_as_the_machine_is(knobs):
    (knobs / "min_free_ms").unlink()
    (knobs / "min_free_ms").mkdir()  # refused to root too, as a read-only knob to others
    with tune.held() as steady:
        assert not steady


@pytest.mark.parametrize("number", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_and_sighup_put_the_setting_back(knobs, number):
    handler = signal.getsignal(number)
    with pytest.raises(SystemExit), tune.held():
        # What the signal would run, called here: a real signal sent to this process would
        # reach whatever else runs in it too (a test runner's worker).
        signal.getsignal(number)(number, None)
    assert (knobs / "min_free_ms").read_text() == "0"
    assert signal.getsignal(number) is handler  # the process's own handler again


def test_the_results_block_says_how_reporting_stood():
    def line(reporting):
        return report._reporting({"machine": {"page_reporting": reporting}})

    assert line({"min_free_ms": tune.HOLD_MS, "reported_kib_during_run": 3 << 20}) == (
        "; free page reporting held, 3072 MiB reported meanwhile"
    )
    assert line({"min_free_ms": 0}) == "; free page reporting on (min_free_ms 0)"
    assert line(None) == ""


def test_held_from_a_thread_that_cannot_catch_signals_still_puts_the_setting_back(knobs):
    seen = []

    def run() -> None:
        with tune.held() as steady:
            seen.append((steady, tune.held_now(tune.state())))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen == [(True, True)]
    assert (knobs / "min_free_ms").read_text() == "0"
