"""Submissions and jobs: submit a matrix, list, show, log, cancel."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Depends, Query, Request, Response
from sqlalchemy.orm import Session

from farm.core.errors import ApiError, ModelFileError, NotFound, SpecError
from farm.core.identity import ModelInfo
from farm.core.spec import CompileSpec, Toolchain
from farm.core.stages import source_recipe
from farm.server.api.deps import Dispatch, Farm, SubmitCaller, known_query_only, link_next
from farm.server.api.schemas import (
    JobOut,
    SubmissionRequest,
    SubmissionResponse,
    SubmissionResult,
    Text,
)
from farm.server.context import FarmContext
from farm.server.db.models import Job
from farm.server.jobs import service
from farm.server.pagination import MAX_PAGE, job_cursor
from farm.server.storage import BlobStore, model_storage_key
from farm.server.views import job_view, job_views, log_view

router = APIRouter(tags=["jobs"], dependencies=[Depends(known_query_only)])


@router.post("/v1/submissions", responses={409: {}})
def submit(
    body: SubmissionRequest, farm: Farm, dispatcher: Dispatch, caller: SubmitCaller
) -> SubmissionResponse:
    """Submit one spec or a matrix for one model: one result per spec (hit, existing, queued).
    A hit needs no model upload; a new job needs the model files (409 `model_missing`)."""
    if len(body.specs) > farm.settings.max_matrix:
        raise ApiError(
            422,
            "matrix_too_large",
            f"{len(body.specs)} specs is over the limit of {farm.settings.max_matrix}",
        )
    identity: dict[str, str] = {role: sha for role, sha in body.model.items()}
    try:
        recipe = source_recipe(identity, [stage.model_dump() for stage in body.recipe or []])
    except (ModelFileError, SpecError) as error:
        raise ApiError(422, error.code, str(error)) from None
    specs = [
        CompileSpec.from_canonical(s.target, s.model_dump(exclude={"target"})) for s in body.specs
    ]
    toolchain = Toolchain(
        body.toolchain.openvino, runtime_requirements=body.toolchain.runtime_requirements
    )
    for spec in specs:
        toolchain.key_part(spec.target)  # a CPU spec needs runtime requirements: 422 here
    with farm.session() as session:
        submitted = service.submit_matrix(
            session,
            farm.store,
            farm.settings,
            dispatcher,
            identity,
            specs,
            toolchain,
            describe_model=lambda: ModelInfo(
                identity, body.model_name, _stored_size(farm.store, identity), recipe
            ),
            recipe=recipe,
            submitter=caller.name,
            reference_inputs=body.reference_inputs,
            refuse_uncompilable=not farm.settings.served,
            rebuild=body.rebuild,
        )
        return SubmissionResponse(
            submission_id=submitted.submission_id,
            results=[
                SubmissionResult(
                    cache_key=outcome.cache_key,
                    target=spec.target.name,
                    outcome=outcome.outcome,
                    job=_job_out(farm, session, service.get_job(session, outcome.job_id))
                    if outcome.job_id
                    else None,
                    reason=outcome.reason,
                )
                for spec, outcome in submitted.results
            ],
        )


def _in_utc(since: datetime | None) -> datetime | None:
    """`since` in UTC (no zone: UTC). A date at the edge of the calendar in a far zone
    (0001-01-01T00:00:00+14:00) has no UTC equivalent: a 422 naming the parameter, not a 500."""
    if since is None or since.tzinfo is None:
        return since
    try:
        return since.astimezone(UTC)
    except OverflowError:
        raise ApiError(
            422,
            "invalid_request",
            f"since: {since.isoformat()} is outside the dates the farm can compare "
            "(years 1 to 9999 in UTC)",
        ) from None


def _stored_size(store: BlobStore, model: dict[str, str]) -> int:
    """Bytes of the model files already stored (0 for those not uploaded yet)."""
    stats = (store.stat(model_storage_key(sha)) for sha in model.values())
    return sum(stored.size for stored in stats if stored is not None)


@router.get("/v1/jobs")
def list_jobs(
    request: Request,
    response: Response,
    farm: Farm,
    _: SubmitCaller,
    state: str | None = Query(None, pattern="^(queued|running|succeeded|failed|cancelled)$"),
    target: Text | None = Query(None, max_length=32),
    model: Text | None = Query(None, max_length=256, description="Model digest or name."),
    submitter: Text | None = Query(None, max_length=128),
    since: datetime | None = Query(None, description="Created at or after; UTC if no zone."),
    cache_key: str | None = Query(None, pattern="^[0-9a-f]{64}$"),
    limit: int = Query(50, ge=1, le=MAX_PAGE),
    cursor: str | None = Query(None, max_length=512, description="From X-Next-Cursor."),
) -> list[JobOut]:
    """Jobs, newest first, filtered by any of the parameters, a page at a time: the next
    page's cursor is in the `X-Next-Cursor` and `Link` headers."""
    with farm.session() as session:
        jobs = service.list_jobs(
            session,
            state,
            target,
            limit,
            model=model,
            submitter=submitter,
            since=_in_utc(since),
            cache_key=cache_key,
            cursor=cursor,
        )
        following = job_cursor(jobs[-1].id) if len(jobs) == limit else None
        link_next(request, response, following)
        # The page's model names and waiting notes in two queries, not two per job.
        views = job_views(session, jobs, farm.settings.worker_heartbeat_seconds)
        return [JobOut(**view) for view in views]


@router.get("/v1/jobs/{job_id}", responses={404: {}})
def get_job(job_id: int, farm: Farm, _: SubmitCaller) -> JobOut:
    with farm.session() as session:
        return _job_out(farm, session, service.get_job(session, _job_id(job_id)))


@router.get("/v1/jobs/{job_id}/log", responses={404: {}})
def job_log(job_id: int, farm: Farm, _: SubmitCaller) -> dict[str, Any]:
    """The job's log: properties used, toolchain, timings, the compiler's output."""
    with farm.session() as session:
        return log_view(service.get_job(session, _job_id(job_id)))


@router.post("/v1/jobs/{job_id}/cancel", responses={403: {}, 404: {}})
def cancel_job(job_id: int, farm: Farm, caller: SubmitCaller) -> JobOut:
    """Only the job's submitter, or an admin token, may cancel it (403 `forbidden`)."""
    with farm.session() as session:
        cancelled = service.cancel(
            session, _job_id(job_id), by=caller.name, as_admin=caller.may("admin")
        )
        return _job_out(farm, session, cancelled)


def _job_id(job_id: int) -> int:
    if not 0 < job_id < 2**31:
        raise NotFound(f"no job {job_id}")
    return job_id


def _job_out(farm: FarmContext, session: Session, job: Job) -> JobOut:
    return JobOut(**job_view(session, job, farm.settings.worker_heartbeat_seconds))
