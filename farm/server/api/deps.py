"""What every router depends on, declared once: the farm context, the authenticated caller of
each role, and the refusal of query parameters an endpoint does not take.

The dependencies are `async def` where they do no blocking work: FastAPI runs a plain `def`
dependency on its thread pool, a thread hop per dependency per request, which was a good part
of an edge's resolve (bench/catalog.py). The one that may block (a token's database lookup)
hops only when it has to."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from fastapi import Depends, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from farm.core.errors import ApiError, TokenExpired
from farm.server.context import FarmContext
from farm.server.jobs.dispatch import Dispatcher
from farm.server.tokens import Caller, authenticate, recently_authenticated

_bearer = HTTPBearer(auto_error=False)


def farm_of(request: Request) -> FarmContext:
    return request.app.state.farm


async def _farm(request: Request) -> FarmContext:
    return farm_of(request)


def dispatcher_of(request: Request) -> Dispatcher:
    return request.app.state.dispatcher


def caller_with(role: str) -> Callable[..., Awaitable[Caller]]:
    """A dependency: the authenticated caller, who must hold `role` (or a higher one)."""

    async def dependency(
        request: Request, credentials: HTTPAuthorizationCredentials | None = Depends(_bearer)
    ) -> Caller:
        if credentials is None:
            raise ApiError(401, "unauthorized", "missing bearer token (Authorization: Bearer …)")
        farm = farm_of(request)
        token = credentials.credentials
        caller = recently_authenticated(token, farm.settings.token_cache_seconds)
        if caller is None:
            caller = await run_in_threadpool(_look_up, farm, token)
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


def _look_up(farm: FarmContext, token: str) -> Caller | None:
    with farm.session() as session:
        try:
            return authenticate(session, token)
        except TokenExpired as error:
            raise ApiError(401, "token_expired", str(error)) from None


async def known_query_only(request: Request) -> None:
    """Refuse query parameters the endpoint does not declare. FastAPI ignores them, so a typo
    (`?stat=failed`) or a filter this server lacks would silently answer as if unfiltered."""
    route = request.scope.get("route")
    if route is None:
        return
    allowed = _query_names(route)
    unknown = sorted(set(request.query_params) - allowed)
    if unknown:
        takes = ", ".join(sorted(allowed)) or "no query parameters"
        raise ApiError(
            400,
            "unknown_parameter",
            f"unknown query parameter {', '.join(unknown)}; {request.url.path} takes {takes}",
        )


def _query_names(route: Any) -> set[str]:
    names: set[str] = set()
    pending = [route.dependant]
    while pending:
        dependant = pending.pop()
        names.update(field.alias for field in dependant.query_params)
        pending.extend(dependant.dependencies)
    return names


Farm = Annotated[FarmContext, Depends(_farm)]
"""The process's farm context (settings, sessions, store, dispatcher)."""
Dispatch = Annotated[Dispatcher, Depends(dispatcher_of)]
"""Where this process sends new jobs: the broker, or its own background thread (embedded)."""
PullCaller = Annotated[Caller, Depends(caller_with("pull"))]
"""A caller with at least the `pull` role (edges: resolve, download, report)."""
SubmitCaller = Annotated[Caller, Depends(caller_with("submit"))]
"""A caller with at least the `submit` role."""
ReleaseCaller = Annotated[Caller, Depends(caller_with("release"))]
"""A caller who may move channels: the `release` role, or `admin`."""
AdminCaller = Annotated[Caller, Depends(caller_with("admin"))]
"""A caller with the `admin` role (quarantine and release blobs)."""


NEXT_CURSOR_HEADER = "X-Next-Cursor"


def link_next(request: Request, response: Response, cursor: str | None) -> None:
    """Point an answer at its next page: `X-Next-Cursor` for scripts, and `Link: <...>;
    rel="next"` (RFC 8288) with the same query and the cursor; nothing after the last page."""
    if cursor is None:
        return
    response.headers[NEXT_CURSOR_HEADER] = cursor
    url = request.url.include_query_params(cursor=cursor)
    response.headers["Link"] = f'<{url}>; rel="next"'
