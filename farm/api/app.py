"""The FastAPI application: state, authentication, limits, errors. Routes in `farm.api.routes`."""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.exc import OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

from farm.api.limits import BodyLimit
from farm.config import Settings, get_settings
from farm.local import LocalFarm
from farm.tokens import Caller, TokenExpired, authenticate

log = logging.getLogger(__name__)

DATABASE_RETRY_AFTER_SECONDS = 5
"""Retry-After of a 503 answered while the database is unreachable."""


class ApiError(Exception):
    """An error with a stable code, turned into ``{"code", "message"}`` and a status."""

    def __init__(self, status: int, code: str, message: str, details: dict | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.details = status, code, message, details


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


_bearer = HTTPBearer(auto_error=False)


def farm_of(request: Request) -> LocalFarm:
    return request.app.state.farm


def caller_with(role: str) -> Callable[..., Caller]:
    """A dependency: the authenticated caller, who must hold `role` (or a higher one)."""

    def dependency(
        request: Request, credentials: HTTPAuthorizationCredentials | None = Depends(_bearer)
    ) -> Caller:
        if credentials is None:
            raise ApiError(401, "unauthorized", "missing bearer token (Authorization: Bearer …)")
        with farm_of(request).session() as session:
            try:
                caller = authenticate(session, credentials.credentials)
            except TokenExpired as error:
                raise ApiError(401, "token_expired", str(error)) from None
        if caller is None:
            raise ApiError(401, "unauthorized", "invalid or revoked token")
        if not caller.may(role):
            raise ApiError(
                403,
                "forbidden",
                f"this needs the {role!r} role; token {caller.name!r} has {caller.role!r}",
            )
        if not request.app.state.limiter.allow(caller.name):
            raise ApiError(
                429, "rate_limited", "too many requests for this token; retry in a minute"
            )
        return caller

    return dependency


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.farm = LocalFarm.open(settings)
        app.state.dispatcher = app.state.farm.dispatcher() if settings.served else None
        yield
        if app.state.dispatcher is not None:
            app.state.dispatcher.close()

    app = FastAPI(
        title="farm",
        summary="A compilation farm for OpenVINO models.",
        version="1",
        lifespan=lifespan,
        responses={401: {"model": _error_model()}, 422: {"model": _error_model()}},
    )
    app.state.limiter = RateLimiter(settings.api_requests_per_minute)
    app.add_middleware(BodyLimit, max_bytes=settings.max_request_bytes)
    _install_error_handlers(app)
    from farm.api import dashboard, metrics
    from farm.api.routes import router

    app.include_router(router)
    app.include_router(metrics.router)
    app.include_router(dashboard.router)
    return app


def _error_model():
    from farm.api.schemas import Error

    return Error


def _error(status: int, code: str, message: str, details: dict | None = None) -> JSONResponse:
    body = {"code": code, "message": message}
    if details:
        body["details"] = details
    return JSONResponse(body, status_code=status)


def _install_error_handlers(app: FastAPI) -> None:
    from farm.hashing import ModelFileError
    from farm.service import ModelMissing, NotFound
    from farm.spec import SpecError

    @app.exception_handler(ApiError)
    async def api_error(_: Request, error: ApiError) -> JSONResponse:
        return _error(error.status, error.code, error.message, error.details)

    @app.exception_handler(SpecError)
    async def spec_error(_: Request, error: SpecError) -> JSONResponse:
        return _error(422, "invalid_spec", str(error))

    @app.exception_handler(ModelFileError)
    async def model_error(_: Request, error: ModelFileError) -> JSONResponse:
        return _error(422, "invalid_model", str(error))

    @app.exception_handler(NotFound)
    async def not_found(_: Request, error: NotFound) -> JSONResponse:
        return _error(404, "not_found", str(error))

    @app.exception_handler(ModelMissing)
    async def model_missing(_: Request, error: ModelMissing) -> JSONResponse:
        return _error(409, "model_missing", str(error), {"missing": error.missing})

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, error: RequestValidationError) -> JSONResponse:
        problems = [
            f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e['msg']}"
            for e in error.errors()[:10]
        ]
        return _error(422, "invalid_request", "; ".join(problems))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
        codes = {
            404: "not_found",
            405: "method_not_allowed",
            413: "too_large",
            415: "unsupported_media_type",
        }
        return _error(
            error.status_code, codes.get(error.status_code, "http_error"), str(error.detail)
        )

    @app.exception_handler(OperationalError)
    async def database_unavailable(_: Request, error: OperationalError) -> JSONResponse:
        # The database is down or restarting (connection refused or lost): a 503 the client
        # may retry, not a 500. Retrying a submission is safe: single flight answers with the
        # job a first try may have recorded.
        first = (str(error.orig or error).strip().splitlines() or [""])[0]
        log.warning("database unavailable: %s", first)
        response = _error(
            503,
            "database_unavailable",
            "the farm's database is unavailable (restarting or down); try again shortly",
        )
        response.headers["Retry-After"] = str(DATABASE_RETRY_AFTER_SECONDS)
        return response

    @app.exception_handler(Exception)
    async def unexpected(_: Request, error: Exception) -> JSONResponse:
        log.exception("unexpected error")
        return _error(500, "internal", "internal error; the server log has the details")
