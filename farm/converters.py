"""The converters this host has for stages (docs/architecture.md §15), with their versions.

Read from the installed distributions' metadata: nothing is imported, so a worker reports its
converters at start-up in milliseconds (torch alone takes seconds to import). A converter is
present when every distribution it names is installed (`farm.core.stages.CONVERTERS`).
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Iterable

from farm.core.stages import CONVERTERS


def probe() -> dict[str, dict[str, str]]:
    """Converter -> {distribution: version} for each converter every distribution of which
    is installed here."""
    found = {}
    for name, converter in sorted(CONVERTERS.items()):
        versions = {}
        for distribution in converter.modules:
            try:
                versions[distribution] = importlib.metadata.version(distribution)
            except importlib.metadata.PackageNotFoundError:
                break
        else:
            found[name] = versions
    return found


def missing(needed: Iterable[str]) -> list[str]:
    """The converters among `needed` this host lacks."""
    here = probe()
    return sorted(name for name in needed if name not in here)


def missing_message(names: Iterable[str], where: str) -> str:
    """``no converter torch on this host for this source: install it with pip install
    'farm[convert]' (on a worker)``."""
    names = sorted(names)
    extras = sorted({CONVERTERS[name].extra for name in names if name in CONVERTERS})
    installs = " ".join(f"'farm[{extra}]'" for extra in extras)
    return (
        f"no converter {', '.join(names)} on {where} for this source: install it with "
        f"pip install {installs} (on a worker)"
    )
