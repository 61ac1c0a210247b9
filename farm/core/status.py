"""The farm's signed word on a blob at one moment (docs/architecture.md §14): whether it still
offers the blob or quarantined it, and until when an edge may act on that word.

The API signs a `BlobStatus` on every resolve with its status key (`StatusSigner`); an edge
that checks signatures acts on its `state`, never on the unsigned `quarantined_at`
(`verify_status`). The status key is vouched for by a blob signing key with a certificate
(`certify_status_key`) that lets it sign statuses and nothing else, so the API never holds the
key that signs blobs. Edge-safe, like farm.core.signing.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from farm.core.errors import KeyFileError, SignatureError
from farm.core.hashing import canonical_json
from farm.core.signing import Manifest, Signer, TrustedKeys, key_id

STATUS_VERSION = 1
STATUS_DOMAIN = b"farm-blob-status-v1\n"
"""Prefix of a blob status's signed bytes (`BlobStatus`)."""
STATUS_KEY_DOMAIN = b"farm-status-key-v1\n"
"""Prefix of a status key's certificate: a blob signing key vouching for a key that may sign
blob statuses, and nothing else."""
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


def status_key_message(public: Ed25519PublicKey) -> bytes:
    """What a status key's certificate covers: the key's id and raw bytes, under its domain."""
    return STATUS_KEY_DOMAIN + canonical_json(
        {"key_id": key_id(public), "public_key": _raw_b64(public)}
    )


def _raw_b64(public: Ed25519PublicKey) -> str:
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return base64.b64encode(raw).decode("ascii")


def sign_status(signer: Signer, status: BlobStatus) -> str:
    """The signature (base64) of a blob status."""
    return signer.sign_message(status.message())


def certify_status_key(signer: Signer, public: Ed25519PublicKey) -> dict[str, str]:
    """A certificate, by `signer` (a blob signing key), that `public` may sign blob statuses
    and only those: what an API that holds no blob signing key serves beside its statuses."""
    return {
        "key_id": key_id(public),
        "public_key": _raw_b64(public),
        "signer_id": signer.key_id,
        "signature": signer.sign_message(status_key_message(public)),
    }


def verify_status(
    trust: TrustedKeys, record: Mapping[str, Any], manifest: Manifest, at: float
) -> BlobStatus:
    """The record's blob status, once its signature (by a trusted key, or by a status key a
    trusted key certified) and its binding to `manifest` (cache key, sha256) are checked
    and it is current at `at` (Unix seconds); SignatureError otherwise."""
    key = manifest.cache_key
    signed = record.get("status")
    if not isinstance(signed, Mapping):
        raise SignatureError(
            f"the farm's record of blob {key} carries no signed status (whether the farm "
            "still offers it, or quarantined it); refusing it. The farm's API signs one "
            "with FARM_STATUS_KEY or FARM_SIGNING_KEY (an API older than this edge signs none)"
        )
    status = BlobStatus.from_document(signed.get("document"))
    signer_id, signature = signed.get("signing_key_id"), signed.get("signature")
    if not isinstance(signer_id, str) or not isinstance(signature, str):
        raise SignatureError(f"the status of blob {key} has a malformed signature")
    keys = trust
    if signer_id not in trust.keys:
        keys = TrustedKeys({signer_id: _certified(trust, signed.get("certificate"), signer_id)})
    keys.check(key, signer_id, signature, status.message())
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


def _certified(trust: TrustedKeys, certificate: object, signer_id: str) -> Ed25519PublicKey:
    """The status key of `certificate`, which a trusted key must have signed."""
    if not isinstance(certificate, Mapping):
        known = ", ".join(sorted(trust.keys)) or "none"
        raise SignatureError(
            f"a blob status is signed by key {signer_id}, which this machine does not trust "
            f"and no certificate vouches for (trusted: {known}; FARM_TRUSTED_KEYS)"
        )
    try:
        raw = base64.b64decode(str(certificate.get("public_key")), validate=True)
        public = Ed25519PublicKey.from_public_bytes(raw)
    except ValueError:
        raise SignatureError("a status key's certificate is malformed; refusing it") from None
    if key_id(public) != signer_id or certificate.get("key_id") != signer_id:
        raise SignatureError(
            f"the certificate offered for status key {signer_id} is of another key"
        )
    by, signature = certificate.get("signer_id"), certificate.get("signature")
    if not isinstance(by, str) or not isinstance(signature, str):
        raise SignatureError("a status key's certificate is not signed; refusing it")
    trust.check(f"(status key {signer_id})", by, signature, status_key_message(public))
    return public


def certificate_path(private_path: Path) -> Path:
    """Where a status key's certificate lives: beside the key (`farm keys create-status`)."""
    return private_path.with_name(private_path.name + ".cert")


@dataclass(frozen=True)
class StatusSigner:
    """Signs the farm's blob statuses (its API, or the direct CLI): with a status key and the
    certificate a blob signing key gave it, or with the blob signing key itself where the host
    holds it (the embedded farm)."""

    signer: Signer
    lifetime_seconds: int
    certificate: dict[str, str] | None = field(default=None, hash=False)

    def signed(self, cache_key: str, sha256: str, quarantined: bool, at: float) -> dict[str, Any]:
        """The signed status of a blob at `at` (Unix seconds), as a blob record carries it."""
        status = BlobStatus(
            cache_key,
            sha256,
            "quarantined" if quarantined else "ok",
            int(at),
            int(at) + self.lifetime_seconds,
        )
        return {
            "document": status.document(),
            "signing_key_id": self.signer.key_id,
            "signature": sign_status(self.signer, status),
            "certificate": self.certificate,
        }

    @classmethod
    def from_file(cls, private_path: Path, lifetime_seconds: int) -> StatusSigner:
        """The status key at `private_path` and its certificate beside it."""
        signer = Signer.from_file(private_path)
        path = certificate_path(private_path)
        try:
            certificate = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            raise KeyFileError(
                f"{path}: no readable certificate for the status key {private_path} ({error}); "
                "make one with `farm keys create-status PATH` on a host with FARM_SIGNING_KEY"
            ) from None
        if not isinstance(certificate, dict) or certificate.get("key_id") != signer.key_id:
            raise KeyFileError(f"{path} is not the certificate of the status key {private_path}")
        return cls(signer, lifetime_seconds, certificate)
