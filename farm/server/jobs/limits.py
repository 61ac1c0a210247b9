"""How big a compile's blob may be: one rule for the job's child and for the child an embedded
`farm submit` gives its request before the job exists (`sandbox.request_compile_ahead`), whose
limits must be the job's to the byte. Imports nothing heavy: the submit reads it before the
database layer."""

from __future__ import annotations

BLOB_BYTES_PER_MODEL_BYTE = 4.0
BLOB_BYTES_OVER_MODEL = 64 * 2**20
"""The default blob size limit (FARM_MAX_BLOB_RATIO, FARM_BLOB_BYTES_OVER_MODEL): 4 times the
model's bytes plus 64 MiB. A blob holds the weights once (or not at all when weightless) plus
the compiled code; a blob far bigger than its model is a constant broadcast at compile time
(2.6 KB of IR made a 1 GiB blob in 14 s; with 256 MiB over the model, a 240 MB one passed)."""


def blob_size_limit(
    model_bytes: int,
    max_blob_bytes: int | None = None,
    ratio: float = BLOB_BYTES_PER_MODEL_BYTE,
    over_model: int = BLOB_BYTES_OVER_MODEL,
) -> int:
    """The largest blob a compile of a `model_bytes` model may write: FARM_MAX_BLOB_BYTES when
    set, else `ratio` (FARM_MAX_BLOB_RATIO) times the model plus `over_model`
    (FARM_BLOB_BYTES_OVER_MODEL)."""
    if max_blob_bytes:
        return max_blob_bytes
    return int(ratio * model_bytes) + over_model
