"""One router per resource; `farm.server.api.app` includes them all."""

from __future__ import annotations

from farm.server.api.routes import blobs, health, jobs, keys, models, stages, workers

ROUTERS = (
    health.router,
    models.router,
    jobs.router,
    blobs.router,
    keys.router,
    workers.router,
    stages.router,
)
