"""The registry of compile workers: who serves which queues, and who is live."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Query, Request, Response

from farm.server.api.deps import Farm, SubmitCaller, known_query_only, link_next
from farm.server.api.schemas import WorkerOut
from farm.server.pagination import MAX_PAGE, after_worker, worker_cursor
from farm.server.views import workers_view

router = APIRouter(tags=["workers"], dependencies=[Depends(known_query_only)])


@router.get("/v1/workers")
def workers(
    request: Request,
    response: Response,
    farm: Farm,
    _: SubmitCaller,
    limit: int = Query(MAX_PAGE, ge=1, le=MAX_PAGE),
    cursor: str | None = Query(None, max_length=512, description="From X-Next-Cursor."),
) -> list[WorkerOut]:
    """Registered workers by name, each marked live or not, a page at a time: the next page's
    cursor is in the `X-Next-Cursor` and `Link` headers."""
    after = after_worker(cursor) if cursor else None
    with farm.session() as session:
        rows = workers_view(session, farm.settings.worker_heartbeat_seconds, limit, after)
    following = worker_cursor(rows[-1]["name"]) if len(rows) == limit else None
    link_next(request, response, following)
    return [WorkerOut(**worker) for worker in rows]
