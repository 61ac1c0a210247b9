"""What the embedded backend starts before it is loaded: the compile child of the job a
`farm submit` is about to run, beside the model's hash (`sandbox.prestart_compile_child`).

Kept apart from `farm.cli.backends.direct`, whose import (SQLAlchemy, the job service) the
child need not wait for.
"""

from __future__ import annotations

from farm.core.config import Settings
from farm.core.spec import Target


def prestart_compile(settings: Settings, target: Target) -> bool:
    """The embedded farm: start the compile child for `target` now; whether it did
    (`direct.discard_prestaged` ends it if no job took it)."""
    if settings.api_url or settings.served:
        return False
    try:
        from farm.server.jobs.sandbox import prestart_compile_child
    except ModuleNotFoundError:  # no farm[embedded]: `backend()` says so
        return False
    prestart_compile_child(target, settings.compile_user, settings.compile_launcher)
    return True
