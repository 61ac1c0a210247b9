"""One router per resource; `farm.server.api.app` includes them all."""

from __future__ import annotations

from farm.server.api.routes import (
    blobs,
    bundles,
    channels,
    health,
    jobs,
    keys,
    models,
    stages,
    workers,
)

ROUTERS = (
    health.router,
    models.router,
    jobs.router,
    blobs.router,
    keys.router,
    workers.router,
    channels.router,
    stages.router,
    bundles.router,
)
