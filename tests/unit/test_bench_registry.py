"""Every benchmark in bench/ is one `bench/run --smoke` runs, so none can rot unseen."""

from __future__ import annotations

import ast
from pathlib import Path

from bench.__main__ import BENCHMARKS, ON_DEMAND, SMOKE_ARGS

BENCH = Path(__file__).resolve().parents[2] / "bench"
NOT_BENCHMARKS = {"__init__", "__main__", "common", "observe", "probes", "report", "stack", "tune"}
"""Helpers of the benchmarks, and `mutation` (scripts/mutation's scorer, an hour long)."""


def _has_main(path: Path) -> bool:
    tree = ast.parse(path.read_text())
    return any(isinstance(node, ast.FunctionDef) and node.name == "main" for node in tree.body)


def test_every_benchmark_module_is_registered_for_the_smoke_run() -> None:
    modules = {
        path.stem
        for path in BENCH.glob("*.py")
        if path.stem not in NOT_BENCHMARKS | {"mutation"} and _has_main(path)
    }
    assert modules, "no benchmark found: the glob or the layout changed"
    assert modules == set(BENCHMARKS) | set(ON_DEMAND)


def test_smoke_arguments_name_registered_benchmarks() -> None:
    assert set(SMOKE_ARGS) <= set(BENCHMARKS) | set(ON_DEMAND)
