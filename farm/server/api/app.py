"""The FastAPI application factory: the farm context, the rate limiter, the body limit, the
error mapping, and one router per resource (`farm.server.api.routes`)."""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.concurrency import run_in_threadpool
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


def _warm(app: FastAPI, farm: FarmContext) -> None:
    try:
        metrics.metrics_text(app, farm).get()
        dashboard.summary(app, farm).get()
    except Exception:  # the requests report a database that is not there
        logging.getLogger(__name__).debug("warming the counters failed", exc_info=True)
    dashboard.warm(farm)


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
        farm = app.state.farm
        kept = [batches.KeptSessions(farm), batches.KeptSessions(farm)]
        app.state.resolves = batches.resolve_batches(kept[0], lambda: farm.status_signer)
        app.state.pulls = batches.pull_batches(kept[1])
        configure_mappers()  # what the first request to use the ORM would do otherwise
        # FastAPI builds each route's dependencies and validators when a request first meets
        # it (0.1-0.2 s for all of them: the first request after a start paid it); a path no
        # route matches meets them all, now, before the process serves.
        scope = {"type": "http", "method": "GET", "path": "/-", "root_path": "", "headers": []}
        for route in app.router.routes:
            route.matches(scope)
        # Before serving (issue 30: a warm-up beside the first requests competed with them):
        # the counters /metrics and the dashboard's cards show (milliseconds: migration 0022),
        # the first page's queries, and anyio's thread pool, which it imports on first use.
        await run_in_threadpool(_warm, app, farm)
        yield
        for sessions in kept:
            sessions.close()
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
