"""Blobs and pulls: list, resolve a cache key, download, report a pull."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import FileResponse, RedirectResponse

from farm.core.errors import NotFound, ReportTooLarge
from farm.server.api.batches import Batches, PullReport
from farm.server.api.deps import (
    AdminCaller,
    Farm,
    PullCaller,
    SubmitCaller,
    known_query_only,
    link_next,
)
from farm.server.api.schemas import (
    BlobOut,
    PullIn,
    PullOut,
    QuarantineIn,
    Sha256,
    Text,
    VerificationIn,
)
from farm.server.blobs import service, verifications
from farm.server.blobs.rebuild import delete_quarantined
from farm.server.pagination import MAX_PAGE
from farm.server.storage import LocalPaths, Presigning, presign_seconds, reference_storage_key
from farm.server.tokens import Caller
from farm.server.views import blob_dict, compression_dict, compressions, verification_dict

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
    with farm.read() as session:
        blobs = service.list_blobs(session, target, limit, cursor)
        link_next(request, response, service.page_cursor(blobs, limit))
        found = compressions(session, blobs)
        return [BlobOut(**blob_dict(b, found.get(b.id))) for b in blobs]


@router.get("/v1/blobs/{cache_key}", response_model=BlobOut, responses={404: {}})
async def resolve(cache_key: Sha256, request: Request, _: PullCaller) -> Response:
    """Cache key → blob metadata (target, toolchain, size, sha256, created), and its status
    (ok or quarantined) signed now by the farm's status key: what edges act on."""
    resolves: Batches[str, str] = request.app.state.resolves  # farm.server.api.batches
    return _json(await resolves.ask(cache_key))


@router.get(
    "/v1/blobs/{cache_key}/download",
    response_model=None,
    responses={307: {"description": "Redirect to a presigned URL"}, 404: {}, 409: {}},
)
def download(cache_key: Sha256, farm: Farm, caller: PullCaller) -> RedirectResponse | FileResponse:
    """A presigned URL (S3), or the file itself with HTTP Range support (local store). The URL
    lives FARM_PRESIGN_SECONDS at most, and never past the token's expiry. None for a
    quarantined blob (409 `quarantined`), but to an admin, who investigates it."""
    with farm.session() as session:
        blob = service.require(session, cache_key)
        if not caller.may("admin"):
            service.refuse_quarantined(blob)
    return _object(farm, caller, blob.storage_key, f"{cache_key}.blob", blob.sha256)


@router.get(
    "/v1/blobs/{cache_key}/reference",
    response_model=None,
    responses={307: {"description": "Redirect to a presigned URL"}, 404: {}},
)
def download_reference(
    cache_key: Sha256, farm: Farm, caller: PullCaller
) -> RedirectResponse | FileResponse:
    """The blob's reference outputs (inputs and CPU f32 outputs, `.npz`): 404 when it has none
    (its record's `reference_note` says why)."""
    with farm.session() as session:
        blob = service.require(session, cache_key)
    if blob.reference_sha256 is None:
        raise NotFound(f"blob {cache_key} has no reference outputs: {blob.reference_note}")
    key = reference_storage_key(cache_key, blob.reference_sha256)
    return _object(farm, caller, key, f"{cache_key}.npz", blob.reference_sha256)


def _object(
    farm, caller: Caller, key: str, filename: str, sha256: str
) -> RedirectResponse | FileResponse:
    store = farm.store
    if isinstance(store, Presigning):
        seconds = presign_seconds(farm.settings.presign_seconds, caller.expires_at)
        return RedirectResponse(store.presigned_url(key, seconds), 307)
    assert isinstance(store, LocalPaths), "a store either presigns or has local paths"
    return FileResponse(
        store.local_path(key),
        media_type="application/octet-stream",
        filename=filename,
        headers={"X-Farm-Sha256": sha256},
    )


@router.post(
    "/v1/blobs/{cache_key}/pulls",
    status_code=201,
    response_model=PullOut,
    responses={404: {}, 409: {}},
)
async def report_pull(cache_key: Sha256, body: PullIn, request: Request, _: PullCaller) -> Response:
    """An edge reports one pull: who, import seconds, ok or the error. Answered once it is
    committed (with the other reports of its batch: farm.server.api.batches). An ok pull of a
    quarantined blob is refused (409 `quarantined`): no edge may have imported it."""
    pulls: Batches[PullReport, int] = request.app.state.pulls
    report = PullReport(cache_key, body.agent_id, body.ok, body.import_seconds, body.error)
    return _json(f'{{"id":{await pulls.ask(report)}}}', 201)


def _json(text: str, status: int = 200) -> Response:
    """An answer already in JSON. Returned as a model or a dict, FastAPI would validate it again
    (for a plain `def` route, on a thread of its pool) before encoding it: half a millisecond of
    a resolve on this machine, for the same bytes (`response_model` still documents the
    shape)."""
    return Response(text, status, media_type="application/json")


@router.post("/v1/blobs/{cache_key}/verifications", status_code=201, responses={404: {}, 409: {}})
def report_verification(
    cache_key: Sha256, body: VerificationIn, farm: Farm, _: PullCaller
) -> dict[str, Any]:
    """An edge reports one verification (`farm verify`); a failed one quarantines the blob.
    Bounded: FARM_MAX_REPORT_BYTES a report (413 `report_too_large`), FARM_MAX_REPORTS_PER_BLOB
    and FARM_MAX_REPORTS_PER_AGENT reports a blob (429 `too_many_reports`)."""
    settings = farm.settings
    size = len(body.model_dump_json())
    if size > settings.max_report_bytes:
        raise ReportTooLarge(
            f"the report is {size} bytes of JSON; keep it under the limit (fewer outputs, "
            "a shorter error)",
            setting="FARM_MAX_REPORT_BYTES",
            limit=settings.max_report_bytes,
        )
    report = body.model_dump()
    limits = verifications.ReportLimits(
        settings.max_reports_per_blob, settings.max_reports_per_agent
    )
    with farm.session() as session:
        verification, quarantined = verifications.record_verification(
            session,
            cache_key,
            report.pop("blob_sha256"),
            report,
            settings.quarantine_on_failure,
            limits,
        )
        return {"id": verification.id, "passed": verification.passed, "quarantined": quarantined}


@router.get("/v1/blobs/{cache_key}/verifications", responses={404: {}})
def list_verifications(
    cache_key: Sha256,
    farm: Farm,
    _: SubmitCaller,
    limit: int = Query(100, ge=1, le=MAX_PAGE),
    # verifications.id is a 4-byte INTEGER: a larger bound is a 422, not PostgreSQL's overflow.
    before: int | None = Query(
        None, ge=1, le=2**31 - 1, description="Only those with an id below this."
    ),
) -> list[dict[str, Any]]:
    """The newest verifications of the blobs stored under `cache_key` (rebuilt ones too), a
    page at a time: the next page is `before=<the last id>`. 404 for a key never stored."""
    with farm.session() as session:
        rows = verifications.verifications_of(session, cache_key, limit, before)
        return [verification_dict(v) for v in rows]


@router.post("/v1/blobs/{cache_key}/quarantine", responses={404: {}})
def quarantine(cache_key: Sha256, body: QuarantineIn, farm: Farm, caller: AdminCaller) -> BlobOut:
    """Quarantine a blob (admin): edges refuse it until it is released."""
    with farm.session() as session:
        blob = verifications.quarantine(session, cache_key, f"{body.reason} (by {caller.name})")
        return BlobOut(**blob_dict(blob, compression_dict(session, blob)))


@router.delete("/v1/blobs/{cache_key}", status_code=204, responses={404: {}, 409: {}})
def delete_blob(cache_key: Sha256, farm: Farm, caller: AdminCaller) -> None:
    """Delete a quarantined blob (admin; 409 for one that is not quarantined): objects gone,
    its row in blob_deletions, its verifications kept."""
    with farm.session() as session:
        delete_quarantined(session, farm.store, cache_key, caller.name)


@router.post("/v1/blobs/{cache_key}/release", responses={404: {}})
def release(cache_key: Sha256, farm: Farm, caller: AdminCaller) -> BlobOut:
    """Lift a blob's quarantine (admin); its verifications stay."""
    with farm.session() as session:
        released = verifications.release(session, cache_key, caller.name)
        return BlobOut(**blob_dict(released, compression_dict(session, released)))
