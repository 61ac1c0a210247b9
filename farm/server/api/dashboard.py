"""`/dashboard`: a read-only page of jobs, blobs and workers, filtered by query parameters.

Authentication: a browser cannot attach a bearer header to a link, and a token in the URL ends
up in history, proxy logs and Referer headers. So a login form posts the token once, and the
answer sets a cookie holding a server-side session id, never the token
(`farm.server.api.sessions`): HttpOnly (page scripts cannot read it), SameSite=Lax (other
sites' forms do not carry it; every dashboard request that carries it is a read-only GET),
Secure when served over HTTPS, scoped to /dashboard, and expiring
(FARM_DASHBOARD_SESSION_SECONDS, never past the token's expiry). Every request checks the
session and its token against the database, so `farm token revoke` takes effect at once, and
logging out ends the session on the server, not only in the browser. It needs
the `submit` role: the page shows what `GET /v1/jobs` and `/v1/workers` show that role (a valid
token without it, an edge's pull token, gets 403, not the login page). A bearer header works as
well, for curl or an authenticating proxy in front.

At scale (a million blobs and jobs) the page reads only the rows it shows: one page of jobs and
of blobs (keyset queries on their indexes), the pulls of the blobs shown, the models of the rows
shown, and the workers up to the same limit; the summary cards count whole tables, so they come
from a per-process cache refreshed in the background (`FARM_METRICS_CACHE_SECONDS`).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any
from urllib.parse import parse_qs

from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from sqlalchemy import func, select

from farm.core.spec import Toolchain
from farm.server import routing
from farm.server.api import dashboard_html as html
from farm.server.api import sessions
from farm.server.api.cached import Cached
from farm.server.api.deps import farm_of
from farm.server.api.metrics import read_counts
from farm.server.api.schemas import Text
from farm.server.blobs import service as blob_service
from farm.server.channels import status as channel_status
from farm.server.context import FarmContext
from farm.server.db.models import Pull
from farm.server.jobs import service
from farm.server.jobs.phases import phases_of_page
from farm.server.tokens import TOKEN_PREFIX, Caller, TokenExpired, authenticate
from farm.server.views import compressions, model_names

COOKIE = "farm_dashboard"
"""The session cookie: a session id (`sessions`), never the API token."""
ROLE = "submit"
log = logging.getLogger(__name__)

router = APIRouter(prefix="/dashboard", include_in_schema=False)


def _authenticated(request: Request, token: str | None) -> Caller | None:
    """The token's caller, whatever its role; None: no token, or unknown, revoked, expired."""
    if not token:
        return None
    with farm_of(request).session() as session:
        try:
            return authenticate(session, token)
        except TokenExpired:
            return None


def _request_caller(request: Request) -> Caller | None:
    """Who sends this request: a bearer header's token, or the session in the cookie."""
    header = request.headers.get("authorization", "")
    if header.lower().startswith("bearer "):
        return _authenticated(request, header[7:].strip())
    session_id = request.cookies.get(COOKIE)
    if not session_id:
        return None
    with farm_of(request).session() as session:
        return sessions.session_caller(session, session_id)


def _caller(request: Request, token: str | None) -> Caller | None:
    caller = _authenticated(request, token)
    if caller is None or not caller.may(ROLE):
        return None
    return caller


def _page(body: str, status: int = 200) -> HTMLResponse:
    return HTMLResponse(body, status, headers=html.SECURITY_HEADERS)


@router.get("/style.css")
def style() -> Response:
    return Response(html.CSS, media_type="text/css", headers={"Cache-Control": "max-age=3600"})


@router.get("/login")
def login_form() -> HTMLResponse:
    return _page(html.login())


@router.post("/login")
async def login(request: Request) -> Response:
    form = parse_qs((await request.body())[:4096].decode("utf-8", "replace"))
    token = (form.get("token") or [""])[0].strip()
    caller = _caller(request, token)
    if caller is None:
        return _page(html.login(f"that token is unknown, revoked, or lacks the {ROLE!r} role"), 401)
    if not request.app.state.limiter.allow(caller.name):
        return _page(html.login("too many requests for this token; retry in a minute"), 429)
    farm = farm_of(request)
    with farm.session() as session:
        session_id, seconds = sessions.open_session(
            session, caller, farm.settings.dashboard_session_seconds
        )
    response = RedirectResponse("/dashboard", 303)
    response.set_cookie(
        COOKIE,
        session_id,
        max_age=seconds,
        path="/dashboard",
        httponly=True,
        samesite="lax",
        secure=request.url.scheme == "https",
    )
    return response


@router.post("/logout")
def logout(request: Request) -> Response:
    session_id = request.cookies.get(COOKIE)
    if session_id:
        with farm_of(request).session() as session:
            sessions.close_session(session, session_id)
    response = RedirectResponse("/dashboard/login", 303)
    response.delete_cookie(COOKIE, path="/dashboard")
    return response


@router.get("")
def dashboard(
    request: Request,
    state: str | None = Query(None, pattern="^(|queued|running|succeeded|failed|cancelled)$"),
    target: Text | None = Query(None, max_length=32),
    submitter: Text | None = Query(None, max_length=128),
    limit: int = Query(50, ge=1, le=500),
    workers: str | None = Query(None, pattern="^(|all)$"),
) -> Response:
    caller = _request_caller(request)
    if caller is None:
        return RedirectResponse("/dashboard/login", 303)
    if not caller.may(ROLE):  # signing in again would not help: say why
        return _page(
            html.message(
                f"token {caller.name!r} has the {caller.role!r} role; the dashboard needs "
                f"{ROLE!r} or 'admin'"
            ),
            403,
        )
    if not request.app.state.limiter.allow(caller.name):
        return _page(html.message("too many requests for this token; retry in a minute"), 429)
    filters = {"state": state or "", "target": target or "", "submitter": submitter or ""}
    body = _render(
        farm_of(request), caller.name, filters, limit, workers == "all", _summary(request)
    )
    return _page(body)


def _render(
    farm: FarmContext,
    caller_name: str,
    filters: dict[str, str],
    limit: int,
    all_workers: bool,
    summary: dict[str, Any],
) -> str:
    """The page: one page of jobs and of blobs, their pulls and models, the workers."""
    state, target, submitter = filters["state"], filters["target"], filters["submitter"]
    with farm.session() as session:
        jobs = service.list_jobs(
            session, state or None, target or None, limit, submitter=submitter or None
        )
        blobs = blob_service.list_blobs(session, target or None, limit)
        pulls = _pull_counts(session, [b.id for b in blobs])
        running = routing.live_workers(session, farm.settings.worker_heartbeat_seconds)
        live = {w.name for w in running}
        shown = routing.workers_page(session, limit) if all_workers else running[:limit]
        return html.dashboard(
            caller_name,
            filters,
            limit,
            all_workers,
            {**summary, "live_workers": len(live)},
            html.jobs_table(jobs, model_names(session, jobs), phases_of_page(session, jobs)),
            html.blobs_table(blobs, pulls, compressions(session, blobs)),
            html.workers_table(shown, live),
            _channels(session, running),
        )


def warm(farm: FarmContext) -> None:
    """As an API process starts, before it serves: the first dashboard's and the first blob
    page's queries once (pooled connections, SQLAlchemy's compiled statements, the page code),
    so the first request after a restart costs what later ones do (issue 30: 0.55 s for the
    first dashboard at a million blobs). Done before serving, not beside it: a warm-up on a
    thread of its own competed with the very first requests for the CPU."""
    try:
        summary = {"states": {}, "blobs": (0, None)}
        _render(farm, "", {"state": "", "target": "", "submitter": ""}, 50, False, summary)
        with farm.read() as session:
            compressions(session, blob_service.list_blobs(session, None, 1))
        with farm.session() as session:  # the token query, with a token nobody holds
            authenticate(session, f"{TOKEN_PREFIX}{'0' * 43}")
    except Exception:  # a warm-up only: the requests report what is wrong
        log.debug("warming the dashboard's queries failed", exc_info=True)


def _channels(session, running: list) -> str:
    """The channels table, when the farm has channels: each one's rollout and, per toolchain
    the live workers compile with, what is built for it."""
    parts: dict[str, list] = {}
    for worker in running:
        for part in (worker.toolchains or {}).values():
            if isinstance(part, dict) and part.get("openvino"):
                parts.setdefault(str(part["openvino"]), []).append(part)
    toolchains = []
    for release in parts.values():  # one per release; its CPU part names the requirements
        with contextlib.suppress(Exception):
            toolchains.append(Toolchain.from_json(release))
    rows = channel_status.dashboard_rows(session, toolchains)
    return html.channels_table(rows) if rows else ""


def _summary(request: Request) -> dict[str, Any]:
    """Jobs by state, blobs and their bytes: whole-table counts, from the process's cache."""
    return summary(request.app, farm_of(request)).get()


def summary(app: Any, farm: FarmContext) -> Cached[dict[str, Any]]:
    """This process's dashboard cards, made on first use."""
    if getattr(app.state, "dashboard_summary", None) is None:

        def count() -> dict[str, Any]:
            # The database's counters (migration 0022), as /metrics reads them: milliseconds
            # at a million jobs and blobs, where counting the tables took half a second.
            with farm.session() as session:
                counts = read_counts(session)
            states: dict[str, int] = {}
            blobs, size = 0, 0.0
            for (family, label1, _, _), (n, total) in counts.items():
                if family == "jobs":
                    states[label1] = states.get(label1, 0) + n
                elif family == "blobs":
                    blobs, size = blobs + n, size + total
            return {"states": states, "blobs": (blobs, int(size) if blobs else None)}

        app.state.dashboard_summary = Cached(count, farm.settings.metrics_cache_seconds)
    return app.state.dashboard_summary


def _pull_counts(session, blob_ids: list[int]) -> dict[int, tuple[int, object]]:
    if not blob_ids:
        return {}
    rows = session.execute(
        select(Pull.blob_id, func.count(), func.max(Pull.created_at))
        .where(Pull.blob_id.in_(blob_ids))
        .group_by(Pull.blob_id)
    )
    return {blob_id: (n, last) for blob_id, n, last in rows}
