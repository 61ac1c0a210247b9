"""Pipeline bundles (docs/architecture.md §17): submit a folder (its files uploaded through
`PUT /v1/models/{sha256}`), a bundle's build, its signed manifest, and its files by sha256."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends
from fastapi.responses import FileResponse, RedirectResponse
from pydantic import Field, StringConstraints

from farm.core.errors import NotFound
from farm.core.pipelines import KINDS
from farm.server.api.deps import Dispatch, Farm, PullCaller, SubmitCaller, known_query_only
from farm.server.api.routes.blobs import _object
from farm.server.api.schemas import Sha256, Strict, Text
from farm.server.bundles import builds
from farm.server.bundles.storage import file_storage_key, published

router = APIRouter(tags=["bundles"], dependencies=[Depends(known_query_only)])

MAX_BUNDLE_FILES = 4096
"""Files in one pipeline folder (a text-to-image folder has a few dozen)."""
FolderPath = Annotated[Text, StringConstraints(min_length=1, max_length=1024)]
Short = Annotated[Text, StringConstraints(min_length=1, max_length=4096)]


class BundleIn(Strict):
    pipeline: Annotated[str, StringConstraints(pattern="^(" + "|".join(KINDS) + ")$")] | None = None
    files: dict[FolderPath, Sha256] = Field(min_length=1, max_length=MAX_BUNDLE_FILES)
    target: Annotated[Text, StringConstraints(min_length=1, max_length=64)]
    options: dict[Annotated[str, StringConstraints(max_length=64)], int | str | None] = Field(
        default_factory=dict, max_length=16
    )
    weightless: bool = False
    toolchain: dict[Annotated[str, StringConstraints(max_length=64)], Short] = Field(max_length=8)


@router.post("/v1/bundles", status_code=201, responses={409: {}, 422: {}})
def submit_bundle(
    body: BundleIn, farm: Farm, dispatcher: Dispatch, caller: SubmitCaller
) -> dict[str, Any]:
    """Compile a pipeline folder into a bundle: the folder named by its files' sha256 (uploaded
    first: 409 `model_missing` names those the farm lacks), checked as `farm submit FOLDER`
    checks it (422 naming the file or option), its parts queued for workers with GenAI. A
    published bundle is answered as it is (`state` done): nothing is compiled again."""
    request = builds.BundleRequest(
        pipeline=body.pipeline,
        files=dict(body.files),
        target=body.target,
        options=dict(body.options),
        toolchain=dict(body.toolchain),
        weightless=body.weightless,
    )
    with farm.session() as session:
        return builds.submit(
            session, farm.store, farm.settings, dispatcher, request, submitter=caller.name
        )


@router.get("/v1/bundles/{bundle_key}", responses={404: {}})
def bundle_manifest(bundle_key: Sha256, farm: Farm, _: PullCaller) -> dict[str, Any]:
    """The signed manifest of a published bundle (what `farm pull FOLDER` checks before it
    fetches any file); 404 saying what became of it otherwise."""
    signed = published(farm.store, bundle_key)
    with farm.session() as session:
        if signed is None:
            raise NotFound(builds.not_published(session, bundle_key))
        builds.record_pull(session, bundle_key)  # what farm gc reads
    return signed


@router.get("/v1/bundles/{bundle_key}/build", responses={404: {}})
def bundle_build(bundle_key: Sha256, farm: Farm, _: PullCaller) -> dict[str, Any]:
    """A bundle's build: its state, error and parts (state, queue, worker, attempts)."""
    with farm.session() as session:
        build = builds.find(session, bundle_key)
        if build is None:
            raise NotFound(f"the farm was never asked for bundle {bundle_key}")
        return builds.build_view(session, build)


@router.get(
    "/v1/bundle-files/{sha256}",
    response_model=None,
    responses={307: {"description": "Redirect to a presigned URL"}, 404: {}},
)
def bundle_file(sha256: Sha256, farm: Farm, caller: PullCaller) -> RedirectResponse | FileResponse:
    """One file of a published bundle by its sha256 (ranges allowed: an interrupted pull
    resumes)."""
    key = file_storage_key(sha256)
    if not farm.store.exists(key):
        raise NotFound(f"bundle file {sha256} is not in the farm's store")
    return _object(farm, caller, key, sha256, sha256)
