"""The API's one error mapping: every error answers ``{"code", "message"[, "details"]}`` with
the HTTP status of its kind (`HTTP_STATUS`), never a traceback.

A `FarmError` carries its kind and code (`farm.core.errors`); an `ApiError` its own status.
What the framework raises (validation, unknown routes) and a lost database connection map here
too. Anything else is a bug: a 500 whose details stay in the server log.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

from farm.core.errors import ApiError, FarmError, Kind

log = logging.getLogger(__name__)

DATABASE_RETRY_AFTER_SECONDS = 5
"""Retry-After of a 503 answered while the database is unreachable."""

HTTP_STATUS: dict[Kind, int] = {
    Kind.BAD_INPUT: 422,
    Kind.NOT_FOUND: 404,
    Kind.CONFLICT: 409,
    Kind.CANNOT_RUN_HERE: 422,
    Kind.INTEGRITY: 502,
    Kind.UNTRUSTED: 502,
    Kind.INFRASTRUCTURE: 503,
    Kind.UNAUTHORIZED: 401,
    Kind.FORBIDDEN: 403,
    Kind.RATE_LIMITED: 429,
    Kind.JOB_FAILED: 409,
    Kind.GAVE_UP: 504,
    Kind.REJECTED: 409,
}
"""The HTTP status of each kind of error: the API's one table."""

_PUBLIC_MESSAGES = {
    "database_unavailable": "the farm's database is unavailable (restarting or down); "
    "try again shortly",
}
"""What a client is told of an infrastructure failure; the details (hosts, buckets, driver
errors) go to the server log only."""
_PUBLIC_DEFAULT = "the farm's storage or services failed; try again shortly"

_FRAMEWORK_CODES = {
    404: "not_found",
    405: "method_not_allowed",
    413: "too_large",
    415: "unsupported_media_type",
}


def error_response(
    status: int, code: str, message: str, details: dict[str, Any] | None = None
) -> JSONResponse:
    body: dict[str, Any] = {"code": code, "message": message}
    if details:
        body["details"] = details
    response = JSONResponse(body, status_code=status)
    if status == 503:
        response.headers["Retry-After"] = str(DATABASE_RETRY_AFTER_SECONDS)
    return response


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(FarmError)
    async def farm_error(_: Request, error: FarmError) -> JSONResponse:
        # An ApiError carries its status, and so may an error class (a limit's 413).
        status = getattr(error, "status", None) or HTTP_STATUS[error.kind]
        message = str(error)
        if status >= 500 and not isinstance(error, ApiError):
            log.warning("%s: %s", error.code, message)
            message = _PUBLIC_MESSAGES.get(error.code, _PUBLIC_DEFAULT)
        response = error_response(status, error.code, message, error.details)
        response.headers.update(getattr(error, "headers", {}))  # an error's own, if any
        return response

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, error: RequestValidationError) -> JSONResponse:
        problems = [
            f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e['msg']}"
            for e in error.errors()[:10]
        ]
        return error_response(422, "invalid_request", "; ".join(problems))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
        code = _FRAMEWORK_CODES.get(error.status_code, "http_error")
        return error_response(error.status_code, code, str(error.detail))

    @app.exception_handler(OperationalError)
    async def database_unavailable(_: Request, error: OperationalError) -> JSONResponse:
        # The database is down or restarting (connection refused or lost): a 503 the client
        # may retry, not a 500. Retrying a submission is safe: single flight answers with the
        # job a first try may have recorded.
        first = (str(error.orig or error).strip().splitlines() or [""])[0]
        log.warning("database unavailable: %s", first)
        return error_response(
            503,
            "database_unavailable",
            "the farm's database is unavailable (restarting or down); try again shortly",
        )

    @app.exception_handler(Exception)
    async def unexpected(_: Request, error: Exception) -> JSONResponse:
        log.exception("unexpected error")
        return error_response(500, "internal", "internal error; the server log has the details")
