"""Where a bundle lives in the store: each file once under its sha256 (a tokenizer or VAE shared
by two bundles is stored once), the signed manifest under the bundle key, written last."""

from __future__ import annotations

import json
from typing import Any

from farm.core.errors import NotFound
from farm.server.storage import BlobStore


def file_storage_key(sha256: str) -> str:
    return f"bundle-files/{sha256}"


def manifest_storage_key(key: str) -> str:
    return f"bundles/{key}.json"


def published(store: BlobStore, key: str) -> dict[str, Any] | None:
    """The signed manifest of bundle `key`, or None if it was never published."""
    storage_key = manifest_storage_key(key)
    if not store.exists(storage_key):
        return None
    with store.open_read(storage_key) as stream:
        document: dict[str, Any] = json.load(stream)
    return document


def require(store: BlobStore, key: str) -> dict[str, Any]:
    found = published(store, key)
    if found is None:
        raise NotFound(f"no bundle {key}; compile it with farm submit <folder> first")
    return found
