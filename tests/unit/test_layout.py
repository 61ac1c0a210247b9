"""The layout's promises that need no service: the wheel claims no generic top-level names, and
the imports import-linter cannot see obey the tiers.

`workers/` and `migrations/` live at the repository's top level and install as `farm.workers` and
`farm.migrations` (setuptools' package-dir mapping), so import-linter, which reads the `farm`
folder, analyses `workers` as a root package of its own and never sees an import spelled
`farm.workers`; the scan below covers those.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_wheel_installs_only_the_farm_package(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "-q",
            "-w",
            str(tmp_path),
            str(REPO),
        ],
        check=True,
        capture_output=True,
        cwd=tmp_path,
    )
    (wheel,) = tmp_path.glob("farm-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/")[0] for name in names}
    assert {name for name in top_level if not name.endswith(".dist-info")} == {"farm"}
    assert "farm/workers/tasks.py" in names
    assert "farm/migrations/env.py" in names and "farm/migrations/script.py.mako" in names
    assert any(name.startswith("farm/migrations/versions/0001_") for name in names)
    assert "farm/server/api/routes/jobs.py" in names


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def test_only_the_direct_backend_imports_the_workers_package():
    importers = sorted(
        str(path.relative_to(REPO))
        for path in (REPO / "farm").rglob("*.py")
        if any(name.startswith(("farm.workers", "workers")) for name in _imports(path))
    )
    assert importers == ["farm/cli/backends/direct.py"]


def test_the_workers_never_import_the_api():
    for path in (REPO / "workers").rglob("*.py"):
        assert not any(name.startswith("farm.server.api") for name in _imports(path)), path
