"""The API's endpoints (DESIGN.md §9). Thin: parse, authorise, call `farm.service`, answer."""

from __future__ import annotations

import uuid
from datetime import datetime

from fastapi import APIRouter, BackgroundTasks, Depends, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse, RedirectResponse

from farm import routing, service
from farm.api.app import ApiError, caller_with, farm_of
from farm.api.schemas import (
    BlobOut,
    JobOut,
    MissingRequest,
    MissingResponse,
    PullIn,
    Sha256,
    SubmissionRequest,
    SubmissionResponse,
    SubmissionResult,
    Text,
    WorkerOut,
)
from farm.db.models import Blob, Job
from farm.spec import CompileSpec, Toolchain
from farm.storage import ChecksumMismatch, ObjectWriter
from farm.tokens import Caller
from farm.views import blob_dict, job_dict, worker_dict


def known_query_only(request: Request) -> None:
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


def _query_names(route) -> set[str]:
    names, pending = set(), [route.dependant]
    while pending:
        dependant = pending.pop()
        names.update(field.alias for field in dependant.query_params)
        pending.extend(dependant.dependencies)
    return names


router = APIRouter(dependencies=[Depends(known_query_only)])
pull_role = Depends(caller_with("pull"))
submit_role = Depends(caller_with("submit"))

UPLOAD_CHUNK = 1 << 20


@router.get("/healthz", tags=["health"])
def healthz() -> dict[str, str]:
    """Liveness: the process answers."""
    return {"status": "ok"}


@router.get("/readyz", tags=["health"])
def readyz(request: Request, response: Response) -> dict:
    """Readiness: the database, broker and store answer."""
    from farm.doctor import service_checks

    checks = service_checks(farm_of(request).settings)
    ready = all(c.ok for c in checks)
    response.status_code = 200 if ready else 503
    return {"ready": ready, "checks": {c.name: c.detail for c in checks}}


# --- models ------------------------------------------------------------------------------


@router.post("/v1/models/missing", tags=["models"])
def missing_models(
    body: MissingRequest, request: Request, _: Caller = submit_role
) -> MissingResponse:
    """Which of these model file digests the farm lacks (upload only those)."""
    return MissingResponse(missing=service.missing_model_files(farm_of(request).store, body.sha256))


@router.put(
    "/v1/models/{sha256}",
    status_code=201,
    tags=["models"],
    responses={409: {}, 411: {}, 413: {}, 415: {}},
)
async def upload_model(sha256: Sha256, request: Request, _: Caller = submit_role) -> dict:
    """Upload one model file, streamed as `application/octet-stream`; its sha256 is verified
    against the digest in the URL before anything is stored."""
    farm = farm_of(request)
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
    key = service.model_storage_key(sha256)
    if farm.store.exists(key):
        return {"sha256": sha256, "stored": False}
    writer = farm.store.writer(key, expected_sha256=sha256)
    try:
        await _stream_into(writer, request, int(declared))
        await run_in_threadpool(writer.commit)
    except ChecksumMismatch as error:
        raise ApiError(422, "digest_mismatch", str(error)) from error
    finally:
        writer.close()
    return {"sha256": sha256, "stored": True}


# --- submissions and jobs ----------------------------------------------------------------


@router.post("/v1/submissions", tags=["jobs"], responses={409: {}})
def submit(
    body: SubmissionRequest,
    request: Request,
    background: BackgroundTasks,
    caller: Caller = submit_role,
) -> SubmissionResponse:
    """Submit one spec or a matrix for one model: one result per spec (hit, existing, queued).
    A hit needs no model upload; a new job needs the model files (409 `model_missing`)."""
    farm = farm_of(request)
    if len(body.specs) > farm.settings.max_matrix:
        raise ApiError(
            422,
            "matrix_too_large",
            f"{len(body.specs)} specs is over the limit of {farm.settings.max_matrix}",
        )
    roles = set(body.model)
    if roles not in ({"xml", "bin"}, {"onnx"}):
        raise ApiError(422, "invalid_model", "model must be {xml, bin} or {onnx} digests")
    specs = [
        CompileSpec.from_canonical(s.target, s.model_dump(exclude={"target"})) for s in body.specs
    ]
    toolchain = Toolchain(
        body.toolchain.openvino, runtime_requirements=body.toolchain.runtime_requirements
    )
    for spec in specs:
        toolchain.key_part(spec.target)  # a CPU spec needs runtime requirements: 422 here
    submission_id = uuid.uuid4().hex
    results, to_send = [], []
    with farm.session() as session:
        model = None  # its size needs the store: asked only when a job is to be created
        for spec in specs:
            outcome = service.known_outcome(session, body.model, spec, toolchain)
            if outcome is None:
                if model is None:
                    size = _model_size(farm.store, body.model)
                    model = service.ModelInfo(dict(body.model), body.model_name, size)
                queue = _queue_for(farm, spec, model.size_bytes)
                outcome = service.submit(
                    session,
                    farm.store,
                    model,
                    spec,
                    toolchain,
                    queue=queue,
                    submitter=caller.name,
                    submission_id=submission_id,
                    max_attempts=farm.settings.max_attempts,
                )
                if outcome.outcome == "queued":
                    to_send.append((outcome.job_id, queue))
            results.append(outcome)
        for job_id, queue in to_send:
            if request.app.state.dispatcher is not None:
                request.app.state.dispatcher.send(session, job_id, queue)
            else:  # no broker: this process is the farm's only worker
                background.add_task(farm.run, job_id)
        return SubmissionResponse(
            submission_id=submission_id,
            results=[
                SubmissionResult(
                    cache_key=r.cache_key,
                    target=spec.target.name,
                    outcome=r.outcome,
                    job=_job_out(farm, session, service.get_job(session, r.job_id))
                    if r.job_id
                    else None,
                )
                for r, spec in zip(results, specs, strict=True)
            ],
        )


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


def _queue_for(farm, spec: CompileSpec, model_bytes: int) -> str:
    if not farm.settings.served:
        return "embedded"
    return routing.queue_name(spec.target, model_bytes > farm.settings.large_model_bytes)


def _model_size(store, model: dict[str, str]) -> int:
    """Bytes of the model files already stored (0 for those not uploaded yet)."""
    stats = (store.stat(service.model_storage_key(sha)) for sha in model.values())
    return sum(stored.size for stored in stats if stored is not None)


@router.get("/v1/jobs", tags=["jobs"])
def list_jobs(
    request: Request,
    state: str | None = Query(None, pattern="^(queued|running|succeeded|failed|cancelled)$"),
    target: Text | None = Query(None, max_length=32),
    model: Text | None = Query(None, max_length=256, description="Model digest or name."),
    submitter: Text | None = Query(None, max_length=128),
    since: datetime | None = Query(None, description="Created at or after; UTC if no zone."),
    cache_key: str | None = Query(None, pattern="^[0-9a-f]{64}$"),
    limit: int = Query(50, ge=1, le=1000),
    _: Caller = submit_role,
) -> list[JobOut]:
    """Jobs, newest first, filtered by any of the parameters."""
    farm = farm_of(request)
    with farm.session() as session:
        jobs = service.list_jobs(
            session,
            state,
            target,
            limit,
            model=model,
            submitter=submitter,
            since=since,
            cache_key=cache_key,
        )
        return [_job_out(farm, session, job) for job in jobs]


@router.get("/v1/jobs/{job_id}", tags=["jobs"], responses={404: {}})
def get_job(job_id: int, request: Request, _: Caller = submit_role) -> JobOut:
    farm = farm_of(request)
    with farm.session() as session:
        return _job_out(farm, session, service.get_job(session, _job_id(job_id)))


@router.get("/v1/jobs/{job_id}/log", tags=["jobs"], responses={404: {}})
def job_log(job_id: int, request: Request, _: Caller = submit_role) -> dict:
    """The job's log: properties used, toolchain, timings, the compiler's output."""
    with farm_of(request).session() as session:
        job = service.get_job(session, _job_id(job_id))
        return {"id": job.id, "state": job.state, "log": job.log or job.error or ""}


@router.post("/v1/jobs/{job_id}/cancel", tags=["jobs"], responses={404: {}})
def cancel_job(job_id: int, request: Request, _: Caller = submit_role) -> JobOut:
    farm = farm_of(request)
    with farm.session() as session:
        return _job_out(farm, session, service.cancel(session, _job_id(job_id)))


# --- blobs and pulls ---------------------------------------------------------------------


@router.get("/v1/blobs", tags=["blobs"])
def list_blobs(
    request: Request, target: Text | None = Query(None, max_length=32), _: Caller = submit_role
) -> list[BlobOut]:
    """Every stored blob, newest first. An edge's pull token cannot list: it resolves the keys
    it computes itself."""
    with farm_of(request).session() as session:
        return [_blob_out(b) for b in service.list_blobs(session, target)]


@router.get("/v1/blobs/{cache_key}", tags=["blobs"], responses={404: {}})
def resolve(cache_key: Sha256, request: Request, _: Caller = pull_role) -> BlobOut:
    """Cache key → blob metadata (target, toolchain, size, sha256, created)."""
    with farm_of(request).session() as session:
        return _blob_out(_blob(session, cache_key))


@router.get(
    "/v1/blobs/{cache_key}/download",
    tags=["blobs"],
    response_model=None,
    responses={307: {"description": "Redirect to a presigned URL"}, 404: {}},
)
def download(
    cache_key: Sha256, request: Request, _: Caller = pull_role
) -> RedirectResponse | FileResponse:
    """A presigned URL (S3), or the file itself with HTTP Range support (local store)."""
    farm = farm_of(request)
    with farm.session() as session:
        blob = _blob(session, cache_key)
    presign = getattr(farm.store, "presigned_url", None)
    if presign is not None:
        return RedirectResponse(presign(blob.storage_key, farm.settings.presign_seconds), 307)
    path = farm.store.local_path(blob.storage_key)
    return FileResponse(
        path,
        media_type="application/octet-stream",
        filename=f"{cache_key}.blob",
        headers={"X-Farm-Sha256": blob.sha256},
    )


@router.post("/v1/blobs/{cache_key}/pulls", status_code=201, tags=["blobs"], responses={404: {}})
def report_pull(
    cache_key: Sha256, body: PullIn, request: Request, caller: Caller = pull_role
) -> dict:
    """An edge reports one pull: who, import seconds, ok or the error."""
    with farm_of(request).session() as session:
        _blob(session, cache_key)
        pull = service.record_pull(
            session, cache_key, body.agent_id, body.ok, body.import_seconds, body.error
        )
        return {"id": pull.id}


@router.get("/v1/workers", tags=["workers"])
def workers(request: Request, _: Caller = submit_role) -> list[WorkerOut]:
    farm = farm_of(request)
    with farm.session() as session:
        live = {
            w.name for w in routing.live_workers(session, farm.settings.worker_heartbeat_seconds)
        }
        return [WorkerOut(**worker_dict(w, w.name in live)) for w in routing.all_workers(session)]


def _job_id(job_id: int) -> int:
    if not 0 < job_id < 2**31:
        raise service.NotFound(f"no job {job_id}")
    return job_id


def _blob(session, cache_key: str) -> Blob:
    blob = service.resolve(session, cache_key)
    if blob is None:
        raise service.NotFound(f"no blob for cache key {cache_key}")
    return blob


def _job_out(farm, session, job: Job) -> JobOut:
    note = routing.waiting_note(session, job, farm.settings.worker_heartbeat_seconds)
    return JobOut(**job_dict(job), note=note)


def _blob_out(blob: Blob) -> BlobOut:
    return BlobOut(**blob_dict(blob))
