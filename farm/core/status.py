"""The farm's signed word on a blob at one moment (docs/architecture.md §14): whether it still
offers the blob or quarantined it, and until when an edge may act on that word.

The API signs a `BlobStatus` on every resolve with its own key (`StatusSigner`, the API key of
farm.core.apikey, which a blob signing key certified to sign statuses and channel documents,
never manifests), so the API never holds the key that signs blobs; an edge that checks
signatures acts on its `state`, never on the unsigned `quarantined_at` (`verify_status`).
Edge-safe, like farm.core.signing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from farm.core.apikey import BLOB_STATUS, ApiSigner, check_signed
from farm.core.errors import SignatureError
from farm.core.hashing import canonical_json
from farm.core.signing import Manifest, Signer, TrustedKeys

STATUS_VERSION = 1
STATUS_DOMAIN = b"farm-blob-status-v1\n"
"""Prefix of a blob status's signed bytes (`BlobStatus`)."""
STATUS_STATES = ("ok", "quarantined")
STATUS_CLOCK_SKEW_SECONDS = 300
"""How far in the future an edge accepts a status's `signed_at` (clocks differ)."""

_HEX = frozenset("0123456789abcdef")


def _hex64(value: object) -> bool:
    return isinstance(value, str) and len(value) == 64 and set(value) <= _HEX


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclass(frozen=True)
class BlobStatus:
    """The farm's signed word on a blob at one moment: whether it still offers the blob
    (`state` "ok") or quarantined it, and until when an edge may act on this word.

    Issued fresh by the farm's API on every resolve, signed by its status key: a proxy that
    strips or rewrites the quarantine can only withhold the status (the edge then refuses the
    blob), and an old answer replayed is refused once `expires_at` has passed, so an old blob
    cannot be served forever under a key that is still trusted."""

    cache_key: str
    sha256: str
    state: str
    signed_at: int
    """Unix seconds."""
    expires_at: int
    """Unix seconds: edges refuse the status from then on."""

    @classmethod
    def from_document(cls, document: object) -> BlobStatus:
        """The status a signed document states, its types checked (a malformed one refused)."""
        fields = ("cache_key", "sha256", "state", "signed_at", "expires_at")
        if not isinstance(document, Mapping) or document.get("v") != STATUS_VERSION:
            raise SignatureError("the farm's blob status is malformed or of an unknown version")
        values = {key: document.get(key) for key in fields}
        if not (
            _hex64(values["cache_key"])
            and _hex64(values["sha256"])
            and values["state"] in STATUS_STATES
            and _count(values["signed_at"])
            and _count(values["expires_at"])
        ):
            raise SignatureError("the farm's blob status is malformed; refusing it")
        return cls(**values)  # type: ignore[arg-type]

    def document(self) -> dict[str, Any]:
        return {
            "v": STATUS_VERSION,
            "cache_key": self.cache_key,
            "sha256": self.sha256,
            "state": self.state,
            "signed_at": self.signed_at,
            "expires_at": self.expires_at,
        }

    def message(self) -> bytes:
        return STATUS_DOMAIN + canonical_json(self.document())


def sign_status(signer: Signer, status: BlobStatus) -> str:
    """The signature (base64) of a blob status."""
    return signer.sign_message(status.message())


def verify_status(
    trust: TrustedKeys, record: Mapping[str, Any], manifest: Manifest, at: float
) -> BlobStatus:
    """The record's blob status, once its signature (by a trusted key, or by a key a trusted
    key certified for blob statuses: the API's key), its binding to `manifest` (cache key,
    sha256) and that it is current at `at` (Unix seconds) are checked; SignatureError
    otherwise."""
    key = manifest.cache_key
    signed = record.get("status")
    if not isinstance(signed, Mapping):
        raise SignatureError(
            f"the farm's record of blob {key} carries no signed status (whether the farm "
            "still offers it, or quarantined it); refusing it. The farm's API signs one "
            "with FARM_STATUS_KEY or FARM_SIGNING_KEY (an API older than this edge signs none)"
        )
    status = BlobStatus.from_document(signed.get("document"))
    check_signed(
        trust,
        BLOB_STATUS,
        status.message(),
        signed.get("signing_key_id"),
        signed.get("signature"),
        signed.get("certificate"),
        f"the status of blob {key}",
    )
    if (status.cache_key, status.sha256) != (key, manifest.sha256):
        raise SignatureError(
            f"the signed status offered with blob {key} is about another blob "
            f"({status.cache_key}, sha256 {status.sha256[:16]}…); refusing it"
        )
    if status.signed_at > at + STATUS_CLOCK_SKEW_SECONDS:
        raise SignatureError(
            f"the status of blob {key} is signed {status.signed_at - at:.0f} s in the future: "
            "this machine's clock or the farm's is wrong; refusing it"
        )
    if status.expires_at <= at:
        raise SignatureError(
            f"the signed status of blob {key} expired {at - status.expires_at:.0f} s ago: "
            "an old answer replayed, or this machine's clock is wrong; refusing it"
        )
    return status


@dataclass(frozen=True)
class StatusSigner:
    """Signs the farm's blob statuses (its API, or the direct CLI) with the API's key."""

    key: ApiSigner
    lifetime_seconds: int

    def signed(self, cache_key: str, sha256: str, quarantined: bool, at: float) -> dict[str, Any]:
        """The signed status of a blob at `at` (Unix seconds), as a blob record carries it."""
        status = BlobStatus(
            cache_key,
            sha256,
            "quarantined" if quarantined else "ok",
            int(at),
            int(at) + self.lifetime_seconds,
        )
        return {"document": status.document(), **self.key.sign(BLOB_STATUS, status.message())}
