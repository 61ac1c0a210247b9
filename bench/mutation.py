"""The mutation score per module, from the results `mutmut run` left in mutants/.

``python -m bench.mutation [--before] [DIR]`` (scripts/mutation runs it after mutmut): counts
each module's mutants by outcome, writes `bench/results/mutation.json` (the score of each
module next to the score recorded with ``--before``, and the 90 % target) and lists every
surviving mutant that tests/mutation/survivors.md does not review. Exit 1 when a module is
under its target or a survivor is unreviewed: a survivor is a test to write, or a mutant shown
equivalent or harmless in that file.

The score is killed / reachable. Left out and counted apart: a mutant no unit test reaches
("no tests": that code runs only against real services, in the integration tests) and one a
stopped run did not check ("not checked").
A mutant that breaks a test module's import stops pytest with exit code 2 (a collection error),
which mutmut calls "interrupted": here it is killed, since the tests did notice it.
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from .common import REPO, RESULTS, comparison, log, target, write_result

MODULES = [
    "farm/core/spec.py",
    "farm/core/hashing.py",
    "farm/core/identity.py",
    "farm/core/blobformat.py",
    "farm/core/signing.py",
    "farm/server/jobs/reconcile.py",
    "farm/server/jobs/service.py",
]
"""What `[tool.mutmut] only_mutate` in pyproject.toml names."""
TARGET = 90.0
SURVIVORS = REPO / "tests" / "mutation" / "survivors.md"
OUTCOME = {0: "survived", 1: "killed", 2: "killed", 3: "killed", 5: "no tests", 33: "no tests"}
TIMEOUTS = {24, -24, 36, 152, 255}


def outcome(exit_code: int | None) -> str:
    if exit_code is None:
        return "not checked"
    if exit_code in TIMEOUTS:
        return "timeout"  # an infinite loop the tests ran into: they noticed it
    return OUTCOME.get(exit_code, "suspicious")


def read(root: Path) -> dict[str, dict[str, str]]:
    """Every mutant's outcome, by module, from mutmut's `<module>.meta` files."""
    outcomes = {}
    for module in MODULES:
        meta = root / "mutants" / f"{module}.meta"
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        outcomes[module] = {name: outcome(code) for name, code in sorted(codes.items())}
    return outcomes


def score(counts: Counter) -> dict[str, Any]:
    killed = counts["killed"] + counts["timeout"]
    reachable = sum(counts.values()) - counts["no tests"] - counts["not checked"]
    return {
        "mutants": sum(counts.values()),
        "reachable": reachable,
        "killed": killed,
        "survived": counts["survived"],
        "no_tests": counts["no tests"],
        "not_checked": counts["not checked"],
        "other": reachable - killed - counts["survived"],
        "score": round(100 * killed / reachable, 1) if reachable else 100.0,
    }


def reviewed() -> set[str]:
    """Mutant names that survivors.md reviews (each in backticks)."""
    if not SURVIVORS.exists():
        return set()
    return set(re.findall(r"`([^`\s]+__mutmut_\d+)`", SURVIVORS.read_text()))


def main(argv: list[str]) -> int:
    before = "--before" in argv
    folders = [arg for arg in argv if not arg.startswith("--")]
    root = Path(folders[0]) if folders else REPO
    outcomes = read(root)
    scores = {module: score(Counter(found.values())) for module, found in outcomes.items()}
    survivors = sorted(
        name for found in outcomes.values() for name, what in found.items() if what == "survived"
    )
    path = RESULTS / "mutation.json"
    previous = json.loads(path.read_text()) if path.exists() else {}
    this_run = {"commit": _commit(root), "scores": scores}
    if before:  # the baseline; the last "after" run, if any, stays
        baseline, current = this_run, previous.get("after", this_run)
        survivors = previous.get("survivors", survivors)
    else:
        baseline, current = previous.get("before", this_run), this_run
    unreviewed = sorted(set(survivors) - reviewed())
    data = {
        "title": (
            "mutmut 3 over the core modules and the job rules, fast unit tests only; "
            f"before: commit {baseline['commit']}, after: commit {current['commit']}"
        ),
        "before": baseline,
        "after": current,
        "runs_per_measurement": 1,
        "survivors": survivors,
        "unreviewed_survivors": unreviewed,
        "comparisons": [
            comparison(
                f"{module}: killed of {current['scores'][module]['reachable']} reachable",
                f"before ({baseline['scores'][module]['reachable']} reachable)",
                baseline["scores"][module]["score"],
                current["scores"][module]["score"],
                "%",
            )
            for module in MODULES
        ],
        "targets": [
            target(
                f"{module}: mutants killed, % of reachable",
                current["scores"][module]["score"],
                TARGET,
                at_most=False,
                unit="%",
            )
            for module in MODULES
        ],
        "notes": (
            "scripts/mutation; survivors reviewed in tests/mutation/survivors.md. 'Reachable' "
            "excludes mutants no unit test runs (code exercised only by the integration tests)."
        ),
    }
    written = write_result("mutation", data)
    for module in MODULES:
        now, was = current["scores"][module], baseline["scores"][module]
        log(
            f"{module}: {now['killed']}/{now['reachable']} killed, {now['score']} % "
            f"(before {was['score']} %), {now['survived']} survived, "
            f"{now['no_tests']} reached by no unit test"
            + (f", {now['not_checked']} not checked (run stopped)" if now["not_checked"] else "")
        )
    log(f"wrote {written.relative_to(REPO)}")
    under = [m for m in MODULES if current["scores"][m]["score"] < TARGET]
    if under:
        log(f"under {TARGET} %: {', '.join(under)}")
    if unreviewed:
        log(f"{len(unreviewed)} survivors not reviewed in {SURVIVORS.relative_to(REPO)}:")
        for name in unreviewed:
            print(f"  {name}", file=sys.stderr)
    return 1 if (under or unreviewed) and not before else 0


def _commit(root: Path) -> str:
    import subprocess

    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True
    ).stdout.strip()
    changed = subprocess.run(
        ["git", "status", "--porcelain", "--", *MODULES, "tests/unit"],
        cwd=root,
        capture_output=True,
        text=True,
    ).stdout.strip()
    return f"{head}+changes" if changed else head


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
