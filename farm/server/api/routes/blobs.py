"""Blobs and pulls: list, resolve a cache key, download, report a pull."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import FileResponse, RedirectResponse

from farm.server.api.deps import Farm, PullCaller, SubmitCaller, known_query_only, link_next
from farm.server.api.schemas import BlobOut, PullIn, Sha256, Text
from farm.server.blobs import service
from farm.server.pagination import MAX_PAGE
from farm.server.storage import LocalPaths, Presigning
from farm.server.views import blob_dict

router = APIRouter(tags=["blobs"], dependencies=[Depends(known_query_only)])


@router.get("/v1/blobs")
def list_blobs(
    request: Request,
    response: Response,
    farm: Farm,
    _: SubmitCaller,
    target: Text | None = Query(None, max_length=32),
    limit: int = Query(100, ge=1, le=MAX_PAGE),
    cursor: str | None = Query(None, max_length=512, description="From X-Next-Cursor."),
) -> list[BlobOut]:
    """Stored blobs, newest first, a page at a time: the next page's cursor is in the
    `X-Next-Cursor` and `Link` headers. An edge's pull token cannot list: it resolves the keys
    it computes itself."""
    with farm.session() as session:
        blobs = service.list_blobs(session, target, limit, cursor)
        link_next(request, response, service.page_cursor(blobs, limit))
        return [BlobOut(**blob_dict(b)) for b in blobs]


@router.get("/v1/blobs/{cache_key}", responses={404: {}})
def resolve(cache_key: Sha256, farm: Farm, _: PullCaller) -> BlobOut:
    """Cache key → blob metadata (target, toolchain, size, sha256, created)."""
    with farm.session() as session:
        return BlobOut(**blob_dict(service.require(session, cache_key)))


@router.get(
    "/v1/blobs/{cache_key}/download",
    response_model=None,
    responses={307: {"description": "Redirect to a presigned URL"}, 404: {}},
)
def download(cache_key: Sha256, farm: Farm, _: PullCaller) -> RedirectResponse | FileResponse:
    """A presigned URL (S3), or the file itself with HTTP Range support (local store)."""
    with farm.session() as session:
        blob = service.require(session, cache_key)
    store = farm.store
    if isinstance(store, Presigning):
        url = store.presigned_url(blob.storage_key, farm.settings.presign_seconds)
        return RedirectResponse(url, 307)
    assert isinstance(store, LocalPaths), "a store either presigns or has local paths"
    return FileResponse(
        store.local_path(blob.storage_key),
        media_type="application/octet-stream",
        filename=f"{cache_key}.blob",
        headers={"X-Farm-Sha256": blob.sha256},
    )


@router.post("/v1/blobs/{cache_key}/pulls", status_code=201, responses={404: {}})
def report_pull(cache_key: Sha256, body: PullIn, farm: Farm, _: PullCaller) -> dict[str, Any]:
    """An edge reports one pull: who, import seconds, ok or the error."""
    with farm.session() as session:
        pull = service.record_pull(
            session, cache_key, body.agent_id, body.ok, body.import_seconds, body.error
        )
        return {"id": pull.id}
