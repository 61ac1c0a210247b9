"""Cache key prefixes: the keys of blobs and jobs that start with what a person typed, so the
CLI accepts a unique prefix (`farm status 3f2a9c1e`) through the API as it does directly.

A submit token sees the keys of blobs and jobs, as `GET /v1/blobs` and `GET /v1/jobs` show
them. An edge's pull token resolves a unique prefix to the key of a blob, and sees nothing it
could not see with a full key: no job's key, and for an ambiguous prefix no candidates (409).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query
from pydantic import BaseModel

from farm.core.errors import Conflict
from farm.core.keyprefix import CANDIDATES_SHOWN, KEY_LENGTH, MIN_PREFIX
from farm.server.api.deps import Farm, PullCaller, known_query_only
from farm.server.blobs import service

router = APIRouter(tags=["blobs"], dependencies=[Depends(known_query_only)])


class CacheKeysOut(BaseModel):
    cache_keys: list[str]


@router.get("/v1/cache-keys")
def cache_keys(
    farm: Farm,
    caller: PullCaller,
    prefix: Annotated[
        str,
        Query(pattern=f"^[0-9a-f]{{{MIN_PREFIX},{KEY_LENGTH}}}$", description="Lower-case hex."),
    ],
) -> CacheKeysOut:
    """The cache keys of blobs and jobs that start with `prefix`, in order: one more than an
    ambiguous prefix lists, so the caller knows there are more. A pull token: the key of the one
    blob that starts with `prefix` (none: an empty list; several: 409)."""
    lister = caller.may("submit")
    with farm.session() as session:
        found = service.cache_keys_starting_with(session, prefix, CANDIDATES_SHOWN + 1, jobs=lister)
    if len(found) > 1 and not lister:
        raise Conflict(
            f"cache key prefix {prefix} is ambiguous: it matches more than one blob; give more "
            "characters (a pull token is not shown the candidates)"
        )
    return CacheKeysOut(cache_keys=found)
