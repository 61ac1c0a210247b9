"""The FastAPI application factory: the farm context, the rate limiter, the body limit, the
error mapping, and one router per resource (`farm.server.api.routes`)."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from sqlalchemy.orm import configure_mappers

from farm.core.config import Settings, get_settings
from farm.core.logs import redact_logs
from farm.server.api import batches, dashboard, metrics
from farm.server.api.errors import install_error_handlers
from farm.server.api.limits import BodyLimit
from farm.server.api.routes import ROUTERS
from farm.server.api.schemas import Error
from farm.server.context import FarmContext
from farm.server.readiness import Readiness


class RateLimiter:
    """Requests per token per minute, counted in fixed one-minute windows in this process.

    Note: each API replica counts on its own; behind N replicas a token gets up to N times the
    limit. Good enough to stop a runaway client; a shared limit would need Redis.
    """

    def __init__(self, per_minute: int) -> None:
        self.per_minute = per_minute
        self._counts: dict[tuple[str, int], int] = defaultdict(int)
        self._lock = threading.Lock()

    def allow(self, name: str) -> bool:
        window = int(time.time() // 60)
        with self._lock:
            if len(self._counts) > 10_000:
                self._counts = defaultdict(
                    int, {k: v for k, v in self._counts.items() if k[1] == window}
                )
            self._counts[(name, window)] += 1
            return self._counts[(name, window)] <= self.per_minute


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    # Drivers' errors may quote their URLs: no log line of this process shows a password.
    redact_logs(settings.secrets)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.farm = FarmContext.open(settings)
        # Without a broker, this process is the farm's only worker: jobs run on a thread of
        # its own, after the request that created them has been answered.
        app.state.dispatcher = app.state.farm.dispatcher(background=True)
        app.state.readiness = Readiness(app.state.farm, settings.readyz_cache_seconds)
        # The whole-table aggregates start now, in the background: the first scrape or
        # dashboard after a restart finds them ready (farm.server.api.cached).
        farm = app.state.farm
        app.state.resolves = batches.resolve_batches(farm.read, lambda: farm.status_signer)
        app.state.pulls = batches.pull_batches(app.state.farm.session)
        configure_mappers()  # what the first request to use the ORM would do otherwise
        metrics.metrics_text(app, app.state.farm).warm()
        dashboard.summary(app, app.state.farm).warm()
        yield
        app.state.readiness.close()
        app.state.dispatcher.close()

    app = FastAPI(
        title="farm",
        summary="A compilation farm for OpenVINO models.",
        version="1",
        lifespan=lifespan,
        responses={401: {"model": Error}, 422: {"model": Error}},
    )
    app.state.limiter = RateLimiter(settings.api_requests_per_minute)
    app.add_middleware(
        BodyLimit,
        max_bytes=settings.max_request_bytes,
        body_timeout_seconds=settings.api_body_timeout_seconds,
        upload_min_bytes_per_second=settings.api_upload_min_bytes_per_second,
    )
    install_error_handlers(app)
    for router in (*ROUTERS, metrics.router, dashboard.router):
        app.include_router(router)
    return app
