"""A blob row's signatures: its manifest, built from the row's own fields, signed as version 2
(what edges check) and as version 1 (for edges older than manifests), both by one key.

One place for the worker that records a blob and for `farm keys resign`, so what a key signs
is always exactly what the row holds, and so what the API answers (farm/server/views.py).
And the blob's status, signed fresh on every resolve by the API's status key
(`signed_status`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from farm.core.clock import now
from farm.core.signing import Manifest, Signer
from farm.core.status import StatusSigner

if TYPE_CHECKING:  # a blob's columns only: the CLI's light reads pass Core rows
    from farm.server.db.models import Blob


def manifest_of(blob: Blob, model: Mapping[str, str] | None = None) -> Manifest:
    """The manifest of `blob` (`model`: its model's file digests, for a row whose `model`
    relationship is not loaded yet)."""
    return Manifest.from_record(
        {
            "cache_key": blob.cache_key,
            "sha256": blob.sha256,
            "size_bytes": blob.size_bytes,
            "payload_offset": blob.payload_offset,
            "target": blob.target,
            "toolchain": blob.toolchain,
            "weightless": blob.weightless,
            "model": blob.model.files if model is None else model,
        }
    )


def sign_row(blob: Blob, signer: Signer | None, model: Mapping[str, str] | None = None) -> Blob:
    """Set the signature columns of `blob` (all null without a signer); returns `blob`."""
    if signer is None:
        blob.signature = blob.manifest_signature = blob.signing_key_id = None
        return blob
    blob.signature = signer.sign(blob.cache_key, blob.sha256)
    blob.manifest_signature = signer.sign_manifest(manifest_of(blob, model))
    blob.signing_key_id = signer.key_id
    return blob


def sign_reference(blob: Blob, signer: Signer | None) -> Blob:
    """Set `reference_signature`, binding the row's reference file to its blob (null without a
    signer or without a reference)."""
    if signer is None or blob.reference_sha256 is None or blob.reference_size_bytes is None:
        blob.reference_signature = None
        return blob
    blob.reference_signature = signer.sign_reference(
        blob.cache_key, blob.sha256, blob.reference_sha256, blob.reference_size_bytes
    )
    return blob


def signed_status(blob: Blob, signer: StatusSigner | None) -> dict[str, Any] | None:
    """The row's status (ok, or quarantined) signed now, as a resolve answers it; None when
    this farm signs no statuses (edges of this version then refuse the blob)."""
    if signer is None:
        return None
    return signer.signed(
        blob.cache_key, blob.sha256, blob.quarantined_at is not None, now().timestamp()
    )
