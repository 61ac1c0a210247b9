"""The registry of compile workers: who serves which queues, and who is live."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from farm.server.api.deps import Farm, SubmitCaller, known_query_only
from farm.server.api.schemas import WorkerOut
from farm.server.views import workers_view

router = APIRouter(tags=["workers"], dependencies=[Depends(known_query_only)])


@router.get("/v1/workers")
def workers(farm: Farm, _: SubmitCaller) -> list[WorkerOut]:
    with farm.session() as session:
        return [
            WorkerOut(**worker)
            for worker in workers_view(session, farm.settings.worker_heartbeat_seconds)
        ]
