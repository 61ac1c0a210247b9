"""`/healthz` (the process answers) and `/readyz` (its database, broker and store answer)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request, Response

from farm.server.api.deps import known_query_only
from farm.server.readiness import Readiness

router = APIRouter(tags=["health"], dependencies=[Depends(known_query_only)])


@router.get("/healthz")
def healthz() -> dict[str, str]:
    """Liveness: the process answers."""
    return {"status": "ok"}


@router.get("/readyz")
def readyz(request: Request, response: Response) -> dict[str, Any]:
    """Readiness: the database, broker and store answer (checked at most every
    `FARM_READYZ_CACHE_SECONDS`, with this process's own clients)."""
    readiness: Readiness = request.app.state.readiness
    checks = readiness.checks()
    ready = all(c.ok for c in checks)
    response.status_code = 200 if ready else 503
    return {"ready": ready, "checks": {c.name: c.detail for c in checks}}
