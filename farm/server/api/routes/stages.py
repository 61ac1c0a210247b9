"""Stage outputs (docs/architecture.md §15): a stage's record, and its output IR files."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import FileResponse, RedirectResponse

from farm.core.errors import NotFound
from farm.server.api.deps import Farm, PullCaller
from farm.server.api.routes.blobs import _object
from farm.server.api.schemas import Sha256
from farm.server.stages import catalog
from farm.server.storage import model_storage_key

router = APIRouter(tags=["stages"])


@router.get("/v1/stages/{stage_key}", responses={404: {}})
def stage(stage_key: Sha256, farm: Farm, _: PullCaller) -> dict[str, Any]:
    """A stage's record: kind, args, state, recorded tool versions, output files' sha256."""
    with farm.session() as session:
        row = catalog.find(session, stage_key)
        if row is None:
            raise NotFound(f"the farm has no stage {stage_key}: submit the source first")
        return catalog.stage_view(row)


@router.get(
    "/v1/stages/{stage_key}/files/{role}",
    response_model=None,
    responses={307: {"description": "Redirect to a presigned URL"}, 404: {}},
)
def stage_file(
    stage_key: Sha256, role: str, farm: Farm, _: PullCaller
) -> RedirectResponse | FileResponse:
    """One output file of a done stage (`xml`, `bin`): `farm pull SOURCE --ir`."""
    with farm.session() as session:
        row = catalog.require_done(session, stage_key)
        files = dict(row.output_files or {})
    if role not in files:
        raise NotFound(f"stage {stage_key} has no output {role!r}; it has {sorted(files)}")
    return _object(farm, model_storage_key(files[role]), f"model.{role}", files[role])
