"""Stage outputs (docs §15): the record of a stage, and its output IR's files (`farm pull
--ir`: the converted or compressed IR for users who compile on the device themselves)."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Depends
from fastapi.responses import FileResponse, RedirectResponse

from farm.core.errors import NotFound
from farm.server.api.deps import Farm, PullCaller, known_query_only
from farm.server.api.routes.blobs import _object
from farm.server.api.schemas import Sha256
from farm.server.stages import catalog
from farm.server.storage import model_storage_key
from farm.server.views import stage_output_dict

router = APIRouter(tags=["stages"], dependencies=[Depends(known_query_only)])


@router.get("/v1/stages/{stage_key}", responses={404: {}})
def stage_output(stage_key: Sha256, farm: Farm, _: PullCaller) -> dict[str, Any]:
    with farm.session() as session:
        return stage_output_dict(_done(session, stage_key))


@router.get(
    "/v1/stages/{stage_key}/files/{role}",
    response_model=None,
    responses={307: {"description": "Redirect to a presigned URL"}, 404: {}},
)
def stage_file(
    stage_key: Sha256, role: Literal["xml", "bin"], farm: Farm, _: PullCaller
) -> RedirectResponse | FileResponse:
    """One file of the stage's output IR (its sha256 is in the stage's record)."""
    with farm.session() as session:
        sha = _done(session, stage_key).output_files[role]
    return _object(farm, model_storage_key(sha), f"model.{role}", sha)


def _done(session, stage_key: str):
    row = catalog.find(session, stage_key)
    if row is None or row.state != catalog.DONE:
        raise NotFound(f"no finished stage output {stage_key}")
    return row
