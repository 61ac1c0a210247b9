"""Cache key prefixes: the keys of blobs and jobs that start with what a person typed, so the
CLI accepts a unique prefix (`farm status 3f2a9c1e`) through the API as it does directly.

Listing keys is listing: a submit token, as for `GET /v1/blobs`; an edge's pull token resolves
the full keys it computes itself.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query
from pydantic import BaseModel

from farm.core.keyprefix import CANDIDATES_SHOWN, KEY_LENGTH, MIN_PREFIX
from farm.server.api.deps import Farm, SubmitCaller, known_query_only
from farm.server.blobs import service

router = APIRouter(tags=["blobs"], dependencies=[Depends(known_query_only)])


class CacheKeysOut(BaseModel):
    cache_keys: list[str]


@router.get("/v1/cache-keys")
def cache_keys(
    farm: Farm,
    _: SubmitCaller,
    prefix: Annotated[
        str,
        Query(pattern=f"^[0-9a-f]{{{MIN_PREFIX},{KEY_LENGTH}}}$", description="Lower-case hex."),
    ],
) -> CacheKeysOut:
    """The cache keys of blobs and jobs that start with `prefix`, in order: one more than an
    ambiguous prefix lists, so the caller knows there are more."""
    with farm.session() as session:
        return CacheKeysOut(
            cache_keys=service.cache_keys_starting_with(session, prefix, CANDIDATES_SHOWN + 1)
        )
