"""Model files: which the farm lacks, and streamed, digest-verified uploads."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from farm.core.errors import ApiError, ChecksumMismatch
from farm.server.api.deps import Farm, SubmitCaller, known_query_only
from farm.server.api.schemas import MissingRequest, MissingResponse, Sha256
from farm.server.api.uploads import upload_slots
from farm.server.context import FarmContext
from farm.server.jobs import service
from farm.server.memory import release_free_memory
from farm.server.storage import ObjectWriter, model_storage_key

log = logging.getLogger(__name__)

router = APIRouter(tags=["models"], dependencies=[Depends(known_query_only)])


@router.post("/v1/models/missing")
def missing_models(body: MissingRequest, farm: Farm, _: SubmitCaller) -> MissingResponse:
    """Which of these model file digests the farm lacks (upload only those)."""
    return MissingResponse(missing=service.missing_model_files(farm.store, body.sha256))


@router.put(
    "/v1/models/{sha256}",
    status_code=201,
    responses={409: {}, 411: {}, 413: {}, 415: {}, 503: {}},
)
async def upload_model(
    sha256: Sha256, request: Request, farm: Farm, caller: SubmitCaller
) -> dict[str, Any]:
    """Upload one model file, streamed as `application/octet-stream`; its sha256 is verified
    against the digest in the URL before anything is stored. Past FARM_MAX_CONCURRENT_UPLOADS
    uploads at once: 503 `too_many_uploads` with Retry-After; past FARM_MAX_UPLOADS_PER_TOKEN
    of one token: 429 `too_many_uploads_for_token`; past the token's stored bytes quota: 413
    `storage_quota_exceeded`. The whole body must arrive within FARM_API_BODY_TIMEOUT_SECONDS
    plus its size at FARM_API_UPLOAD_MIN_BYTES_PER_SECOND (408 past it)."""
    if request.headers.get("content-type", "").split(";")[0].strip() != "application/octet-stream":
        raise ApiError(415, "unsupported_media_type", "send the file as application/octet-stream")
    declared = request.headers.get("content-length")
    if declared is None or not declared.isdigit():
        raise ApiError(411, "length_required", "Content-Length is required")
    if int(declared) > farm.settings.max_upload_bytes:
        raise ApiError(
            413,
            "too_large",
            f"{declared} bytes is over the upload limit of {farm.settings.max_upload_bytes}",
        )
    key = model_storage_key(sha256)
    if farm.store.exists(key):
        return {"sha256": sha256, "stored": False}
    await run_in_threadpool(_check_quota, farm, caller.name, int(declared))
    slots = upload_slots(
        request, farm.settings.max_concurrent_uploads, farm.settings.max_uploads_per_token
    )
    with slots.hold(caller.name):
        writer = farm.store.writer(key, expected_sha256=sha256)
        try:
            await _stream_into(writer, request, int(declared))
            await run_in_threadpool(writer.commit)
        except ChecksumMismatch as error:
            raise ApiError(422, "digest_mismatch", str(error)) from error
        except ClientDisconnect:
            # Not the server's fault, and nobody is left to answer: one line, no traceback.
            # The writer is discarded below, so nothing of the upload is stored.
            log.info(
                "upload of model file %s stopped: the client went away; nothing stored", sha256
            )
            raise ApiError(400, "client_disconnected", "the upload ended early") from None
        finally:
            writer.close()
            # The upload's buffers, freed, go back to the OS rather than stay with glibc.
            await run_in_threadpool(release_free_memory)
    await run_in_threadpool(_record_upload, farm, caller.name, sha256, int(declared))
    return {"sha256": sha256, "stored": True}


def _check_quota(farm: FarmContext, submitter: str, size: int) -> None:
    with farm.session() as session:
        service.check_storage_quota(session, farm.settings, submitter, size)


def _record_upload(farm: FarmContext, submitter: str, sha256: str, size: int) -> None:
    with farm.session() as session:
        service.record_upload(session, submitter, sha256, size)


async def _stream_into(writer: ObjectWriter, request: Request, declared: int) -> None:
    """The body goes to the store as it arrives, a store-sized piece at a time, while the next
    piece is received (the writer blocks when its parts in flight are full: in a thread).
    Pieces of exactly `chunk_bytes` go on without another copy (the host's CPU is the limit)."""
    pending, size, piece = bytearray(), 0, writer.chunk_bytes
    async for chunk in request.stream():
        size += len(chunk)
        if size > declared:
            raise ApiError(413, "too_large", "body longer than its Content-Length")
        pending += chunk
        if len(pending) >= piece:
            await run_in_threadpool(writer.write, bytes(memoryview(pending)[:piece]))
            del pending[:piece]
    if size != declared:
        raise ApiError(400, "incomplete_body", f"got {size} of {declared} bytes")
    await run_in_threadpool(writer.write, bytes(pending))
