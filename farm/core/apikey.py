"""The API's own signing key (`FARM_STATUS_KEY`; docs/architecture.md §14, SECURITY.md): a key
a blob signing key certified to sign what the API must sign by itself, each blob's status and
each channel document, and never a blob manifest or a reference. (Not an access token: those
are `farm token`.)

A certificate names the key and its purposes and is signed by a blob signing key under a
domain of its own (`API_KEY_DOMAIN`). It travels with every signature the key makes, so an
edge needs nothing but the keys it already trusts (`FARM_TRUSTED_KEYS`): `check_signed`
accepts a signature by a trusted key, or by a key a trusted key certified for that purpose.
Manifests and references are checked by `TrustedKeys` alone, which never reads a
certificate, so no certificate can make a key a blob signer. Edge-safe.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from farm.core.errors import KeyFileError, SignatureError
from farm.core.hashing import canonical_json
from farm.core.signing import Signer, TrustedKeys, key_id

API_KEY_DOMAIN = b"farm-api-key-v1\n"
"""Prefix of an API key's certificate: a blob signing key vouching for a key, for the
purposes it names."""
BLOB_STATUS = "blob-status"
"""Purpose: the farm's signed word on a blob (ok or quarantined, until when; farm.core.status)."""
CHANNEL_DOCUMENT = "channel-document"
"""Purpose: what a fleet following a channel runs (farm.core.channels)."""
PURPOSES = (BLOB_STATUS, CHANNEL_DOCUMENT)
"""What a certificate may name. Never a manifest or a reference: those only a blob signing key
signs."""
STATUS_KEY_DOMAIN = b"farm-status-key-v1\n"
"""Prefix of the first certificates (`farm keys create-status` before channels were signed by
the API): they name no purposes and are read as certificates for blob statuses only."""


def api_key_message(public: Ed25519PublicKey, purposes: Collection[str]) -> bytes:
    """What an API key's certificate covers: the key's id and raw bytes and its purposes (in
    the certificate's order), under `API_KEY_DOMAIN`."""
    return API_KEY_DOMAIN + canonical_json(
        {"key_id": key_id(public), "public_key": _raw_b64(public), "purposes": list(purposes)}
    )


def status_key_message(public: Ed25519PublicKey) -> bytes:
    """What a first certificate (no purposes: blob statuses only) covers."""
    return STATUS_KEY_DOMAIN + canonical_json(
        {"key_id": key_id(public), "public_key": _raw_b64(public)}
    )


def certify_api_key(
    signer: Signer, public: Ed25519PublicKey, purposes: Collection[str] = PURPOSES
) -> dict[str, Any]:
    """A certificate, by `signer` (a blob signing key), that `public` may sign `purposes` and
    nothing else: what an API that holds no blob signing key serves beside its signatures."""
    named = sorted(set(purposes))
    if not named or not set(named) <= set(PURPOSES):
        raise ValueError(f"an API key is certified for some of {PURPOSES}, not {purposes!r}")
    return {
        "key_id": key_id(public),
        "public_key": _raw_b64(public),
        "purposes": named,
        "signer_id": signer.key_id,
        "signature": signer.sign_message(api_key_message(public, named)),
    }


def certified_purposes(certificate: Mapping[str, Any]) -> tuple[str, ...]:
    """The purposes a certificate names (a first certificate: blob statuses only)."""
    if "purposes" not in certificate:
        return (BLOB_STATUS,)
    purposes = certificate["purposes"]
    if not isinstance(purposes, list) or not all(isinstance(p, str) for p in purposes):
        raise SignatureError("an API key's certificate names malformed purposes; refusing it")
    return tuple(purposes)


def check_signed(
    trust: TrustedKeys,
    purpose: str,
    signed: bytes,
    signer_id: object,
    signature: object,
    certificate: object,
    what: str,
) -> None:
    """Raise `SignatureError` unless `signature` is `signer_id`'s over `signed`, and that key
    is one `trust` holds or one a key in `trust` certified for `purpose` (`certificate`).
    `what` names the signed thing in the refusal ("the status of blob ...")."""
    if not signer_id or not signature:
        raise SignatureError(f"{what} is not signed; refusing it")
    if not isinstance(signer_id, str) or not isinstance(signature, str):
        raise SignatureError(f"{what} has a malformed signature; refusing it")
    public = trust.keys.get(signer_id) or _certified(trust, purpose, certificate, signer_id, what)
    if not _valid(public, signature, signed):
        raise SignatureError(
            f"{what} has an invalid signature from key {signer_id}; refusing it (it was changed "
            "after it was signed)"
        )


def _certified(
    trust: TrustedKeys, purpose: str, certificate: object, signer_id: str, what: str
) -> Ed25519PublicKey:
    """The key of `certificate`, once a trusted key is found to have certified it for
    `purpose`."""
    known = ", ".join(sorted(trust.keys)) or "none"
    if not isinstance(certificate, Mapping):
        raise SignatureError(
            f"{what} is signed by key {signer_id}, which this machine does not trust and no "
            f"certificate vouches for (trusted: {known}; FARM_TRUSTED_KEYS)"
        )
    try:
        raw = base64.b64decode(str(certificate.get("public_key")), validate=True)
        public = Ed25519PublicKey.from_public_bytes(raw)
    except ValueError:
        raise SignatureError(
            f"the certificate of key {signer_id} is malformed; refusing {what}"
        ) from None
    if key_id(public) != signer_id or certificate.get("key_id") != signer_id:
        raise SignatureError(
            f"the certificate offered for key {signer_id} is of another key; refusing {what}"
        )
    purposes = certified_purposes(certificate)
    by, signature = certificate.get("signer_id"), certificate.get("signature")
    certifier = trust.keys.get(by) if isinstance(by, str) else None
    if certifier is None:
        raise SignatureError(
            f"{what} is signed by key {signer_id}, certified by key {by}, which this machine "
            f"does not trust (trusted: {known}; FARM_TRUSTED_KEYS)"
        )
    message = (
        status_key_message(public)
        if "purposes" not in certificate
        else api_key_message(public, purposes)
    )
    if not isinstance(signature, str) or not _valid(certifier, signature, message):
        raise SignatureError(
            f"the certificate of key {signer_id} has an invalid signature from key {by}; "
            f"refusing {what}"
        )
    if purpose not in purposes:
        raise SignatureError(
            f"{what} is signed by key {signer_id}, which key {by} certified for "
            f"{', '.join(purposes) or 'nothing'}, not for {purpose}; refusing it"
        )
    return public


def _valid(public: Ed25519PublicKey, signature: str, signed: bytes) -> bool:
    try:
        public.verify(base64.b64decode(signature, validate=True), signed)
    except (InvalidSignature, ValueError):
        return False
    return True


def _raw_b64(public: Ed25519PublicKey) -> str:
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return base64.b64encode(raw).decode("ascii")


def certificate_path(private_path: Path) -> Path:
    """Where an API key's certificate lives: beside the key (`farm keys create-status`)."""
    return private_path.with_name(private_path.name + ".cert")


@dataclass(frozen=True)
class ApiSigner:
    """What the farm's API (and an operator's direct CLI) signs statuses and channel documents
    with: its own key and the certificate a blob signing key gave it (`FARM_STATUS_KEY`), or
    the blob signing key itself where the host holds it anyway (the embedded farm, a one-host
    farm), which needs no certificate."""

    signer: Signer
    certificate: dict[str, Any] | None = field(default=None, hash=False)

    @property
    def key_id(self) -> str:
        return self.signer.key_id

    def may_sign(self, purpose: str) -> bool:
        return self.certificate is None or purpose in certified_purposes(self.certificate)

    def sign(self, purpose: str, signed: bytes) -> dict[str, Any]:
        """`{signing_key_id, signature, certificate}` of `signed`, a message of `purpose`."""
        if not self.may_sign(purpose):
            raise KeyFileError(
                f"the API's key {self.key_id} (FARM_STATUS_KEY) is certified for "
                f"{', '.join(certified_purposes(self.certificate or {}))} only, not for "
                f"{purpose}: certify it again where FARM_SIGNING_KEY is, with "
                "`farm keys create-status PATH --if-missing`, and restart the API"
            )
        return {
            "signing_key_id": self.key_id,
            "signature": self.signer.sign_message(signed),
            "certificate": self.certificate,
        }

    @classmethod
    def from_file(cls, private_path: Path) -> ApiSigner:
        """The API key at `private_path` and its certificate beside it."""
        signer = Signer.from_file(private_path)
        path = certificate_path(private_path)
        try:
            certificate = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            raise KeyFileError(
                f"{path}: no readable certificate for the API key {private_path} ({error}); "
                "make one with `farm keys create-status PATH` on a host with FARM_SIGNING_KEY"
            ) from None
        if not isinstance(certificate, dict) or certificate.get("key_id") != signer.key_id:
            raise KeyFileError(f"{path} is not the certificate of the API key {private_path}")
        try:
            certified_purposes(certificate)  # refused here, rather than by every edge
        except SignatureError as error:
            raise KeyFileError(f"{path}: {error}") from None
        return cls(signer, certificate)
