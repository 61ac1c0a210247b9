"""Signed blobs: a worker signs each blob's manifest with an Ed25519 key; an edge imports only
blobs whose manifest a key it trusts signed, and acts only on the manifest's fields.

The manifest (version 2) is the canonical JSON of every field of a blob's record an edge acts
on: the cache key it asked for, the sha256 and size of the bytes, the payload offset, the
target and toolchain it checks compatibility with, whether the blob is weightless and the model
digests it checks a weightless blob's `.bin` against. Signing all of them means that no one
between the worker and the edge (the farm's database, bucket or API, a proxy) can hand an edge
another key's blob, other bytes, or a record that passes the compatibility check falsely.

Version 1 signed only ``(cache_key, sha256)``. Workers still write that signature too (the
``signature`` column), so edges older than manifest signatures keep working during a rolling
upgrade; edges of this version require the manifest signature and never fall back to v1, so a
record stripped of its manifest signature is refused, not downgraded. Blobs recorded before
manifests were signed get theirs from `farm keys resign`.

Keys are files in PEM: the private key on workers (``FARM_SIGNING_KEY``), public keys on
edges (``FARM_TRUSTED_KEYS``, several allowed so keys can be rotated). Edge-safe.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from farm.core.errors import IntegrityMismatch, KeyFileError, SignatureError
from farm.core.hashing import canonical_json

MESSAGE_VERSION = b"farm-blob-signature-v1"
MANIFEST_VERSION = 2
MANIFEST_DOMAIN = b"farm-blob-manifest-v2\n"
"""Prefix of the signed bytes: a v2 signature can never be read as a v1 one, or the reverse."""

REFERENCE_DOMAIN = b"farm-blob-reference-v1\n"
"""Prefix of a reference signature's bytes: never readable as a manifest, or the reverse."""

STATUS_VERSION = 1
STATUS_DOMAIN = b"farm-blob-status-v1\n"
"""Prefix of a blob status's signed bytes (`BlobStatus`)."""
STATUS_KEY_DOMAIN = b"farm-status-key-v1\n"
"""Prefix of a status key's certificate: a blob signing key vouching for a key that may sign
blob statuses, and nothing else."""
STATUS_STATES = ("ok", "quarantined")
STATUS_CLOCK_SKEW_SECONDS = 300
"""How far in the future an edge accepts a status's `signed_at` (clocks differ)."""

_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def message(cache_key: str, sha256: str) -> bytes:
    """What a v1 signature covers (still written, for edges older than manifests)."""
    return b"\n".join([MESSAGE_VERSION, cache_key.encode("ascii"), sha256.encode("ascii")])


@dataclass(frozen=True)
class Manifest:
    """Every field of a blob's record an edge acts on; what a v2 signature covers."""

    cache_key: str
    sha256: str
    size_bytes: int
    payload_offset: int
    target: str
    toolchain: dict[str, str | None] = field(hash=False)
    weightless: bool
    model: dict[str, str] = field(hash=False)
    """sha256 of each model file by role (an edge checks a weightless blob's `.bin`)."""

    FIELDS = (
        "cache_key",
        "sha256",
        "size_bytes",
        "payload_offset",
        "target",
        "toolchain",
        "weightless",
        "model",
    )

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> Manifest:
        """The manifest of a blob record (the API's answer, or a row's fields), its types
        checked: a record that is not one is refused, never half-read."""
        name = str(record.get("cache_key"))[:64]
        try:
            values = {key: record[key] for key in cls.FIELDS}
        except KeyError as missing:
            raise IntegrityMismatch(f"the farm's record of blob {name} lacks {missing}") from None
        problems = [
            key
            for key, ok in (
                ("cache_key", _hex64(values["cache_key"])),
                ("sha256", _hex64(values["sha256"])),
                ("size_bytes", _count(values["size_bytes"])),
                ("payload_offset", _count(values["payload_offset"])),
                ("target", isinstance(values["target"], str)),
                ("toolchain", _strings(values["toolchain"], nullable=True)),
                ("weightless", isinstance(values["weightless"], bool)),
                ("model", _strings(values["model"]) and all(map(_hex64, values["model"].values()))),
            )
            if not ok
        ]
        if problems:
            raise IntegrityMismatch(
                f"the farm's record of blob {name} is malformed ({', '.join(problems)}); "
                "refusing it"
            )
        values["toolchain"] = dict(values["toolchain"])
        values["model"] = dict(values["model"])
        return cls(**values)

    def document(self) -> dict[str, Any]:
        """The signed JSON document: the fields and the manifest version."""
        return {"v": MANIFEST_VERSION, **{key: getattr(self, key) for key in self.FIELDS}}

    def fields(self) -> dict[str, Any]:
        """The fields as a blob record has them (to overlay a record with what was signed)."""
        return {key: getattr(self, key) for key in self.FIELDS}

    def canonical(self) -> bytes:
        """Sorted keys, no spaces, UTF-8 (`hashing.canonical_json`): one byte string."""
        return canonical_json(self.document())

    def message(self) -> bytes:
        return MANIFEST_DOMAIN + self.canonical()


def _hex64(value: object) -> bool:
    return isinstance(value, str) and bool(_HEX64.match(value))


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _strings(value: object, nullable: bool = False) -> bool:
    return isinstance(value, Mapping) and all(
        isinstance(k, str) and (isinstance(v, str) or (nullable and v is None))
        for k, v in value.items()
    )


def reference_message(
    cache_key: str, blob_sha256: str, reference_sha256: str, reference_size: int
) -> bytes:
    """What a reference signature covers: the reference file's digest and size, bound to the
    blob (its key and the sha256 of its bytes). A signature of its own, not a manifest field,
    so the manifests that edges of every version check stay as they were (rolling upgrades)."""
    return REFERENCE_DOMAIN + canonical_json(
        {
            "cache_key": cache_key,
            "sha256": blob_sha256,
            "reference_sha256": reference_sha256,
            "reference_size": reference_size,
        }
    )


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


def key_id(public: Ed25519PublicKey) -> str:
    """A short, stable name of a public key: sha256 of its raw bytes, 16 hex characters."""
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


@dataclass(frozen=True)
class Signer:
    private: Ed25519PrivateKey

    @property
    def key_id(self) -> str:
        return key_id(self.private.public_key())

    @property
    def public_key(self) -> Ed25519PublicKey:
        return self.private.public_key()

    def sign(self, cache_key: str, sha256: str) -> str:
        """The v1 signature of (cache_key, sha256), for edges older than manifests."""
        return base64.b64encode(self.private.sign(message(cache_key, sha256))).decode("ascii")

    def sign_manifest(self, manifest: Manifest) -> str:
        """The v2 signature (base64) of the manifest: what edges of this version check."""
        return base64.b64encode(self.private.sign(manifest.message())).decode("ascii")

    def sign_reference(
        self, cache_key: str, blob_sha256: str, reference_sha256: str, reference_size: int
    ) -> str:
        """The signature (base64) binding a reference file to its blob."""
        signed = reference_message(cache_key, blob_sha256, reference_sha256, reference_size)
        return base64.b64encode(self.private.sign(signed)).decode("ascii")

    def sign_status(self, status: BlobStatus) -> str:
        """The signature (base64) of a blob status."""
        return base64.b64encode(self.private.sign(status.message())).decode("ascii")

    def certify_status_key(self, public: Ed25519PublicKey) -> dict[str, str]:
        """A certificate that `public` may sign blob statuses (and only those), by this key:
        what an API that holds no blob signing key serves beside its statuses."""
        return {
            "key_id": key_id(public),
            "public_key": _raw_b64(public),
            "signer_id": self.key_id,
            "signature": base64.b64encode(self.private.sign(status_key_message(public))).decode(
                "ascii"
            ),
        }

    @classmethod
    def from_file(cls, path: Path) -> Signer:
        try:
            private = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
        except (OSError, ValueError) as error:
            raise KeyFileError(f"{path}: not a readable Ed25519 private key: {error}") from None
        if not isinstance(private, Ed25519PrivateKey):
            raise KeyFileError(f"{path}: not an Ed25519 key")
        return cls(private)


@dataclass(frozen=True)
class TrustedKeys:
    keys: dict[str, Ed25519PublicKey]

    @classmethod
    def from_files(cls, paths: Iterable[Path]) -> TrustedKeys:
        keys = {}
        for path in paths:
            try:
                public = serialization.load_pem_public_key(Path(path).read_bytes())
            except (OSError, ValueError) as error:
                raise KeyFileError(f"{path}: not a readable Ed25519 public key: {error}") from None
            if not isinstance(public, Ed25519PublicKey):
                raise KeyFileError(f"{path}: not an Ed25519 key")
            keys[key_id(public)] = public
        return cls(keys)

    def with_key(self, public: Ed25519PublicKey) -> TrustedKeys:
        """These keys and `public` (a farm trusts its own key)."""
        return TrustedKeys({**self.keys, key_id(public): public})

    def verify(
        self, cache_key: str, sha256: str, signer_id: str | None, signature: str | None
    ) -> None:
        """Raise `SignatureError` unless a trusted key signed exactly (cache_key, sha256): a
        v1 signature (`farm keys resign` checks old blobs with it; edges need manifests)."""
        if not signature or not signer_id:
            raise SignatureError(f"blob {cache_key} is not signed; refusing to import it")
        self._check(cache_key, signer_id, signature, message(cache_key, sha256))

    def verify_manifest(
        self,
        manifest: Manifest,
        signer_id: str | None,
        signature: str | None,
        legacy_signature: str | None = None,
    ) -> None:
        """Raise `SignatureError` unless a trusted key signed exactly this manifest.

        `legacy_signature` (the record's v1 signature) only changes the message when the
        manifest is unsigned: such a blob predates manifest signatures, and the way out is
        `farm keys resign` on the farm, never accepting the v1 signature here.
        """
        key = manifest.cache_key
        if not signer_id or not signature:
            if signer_id and legacy_signature:
                raise SignatureError(
                    f"blob {key} carries only a v1 signature, over its cache key and sha256, "
                    "which leaves its target, toolchain, size and model digests unsigned; "
                    "refusing it. The farm's operator signs its manifest with `farm keys resign`"
                )
            raise SignatureError(f"blob {key} is not signed; refusing to import it")
        self._check(key, signer_id, signature, manifest.message())

    def verify_reference(self, blob: Mapping[str, Any]) -> None:
        """Raise `SignatureError` unless a trusted key bound the record's reference file
        (`reference_sha256`, `reference_size_bytes`) to its blob (`cache_key`, `sha256`)."""
        key = str(blob.get("cache_key"))[:64]
        digest, size = blob.get("reference_sha256"), blob.get("reference_size_bytes")
        signature, signer_id = blob.get("reference_signature"), blob.get("signing_key_id")
        if not (_hex64(digest) and _count(size)):
            raise SignatureError(f"blob {key} has no reference outputs recorded")
        if not signature or not signer_id:
            raise SignatureError(f"the reference outputs of blob {key} are not signed")
        signed = reference_message(key, str(blob.get("sha256")), str(digest), int(str(size)))
        self._check(key, signer_id, signature, signed)

    def verify_status(self, record: Mapping[str, Any], manifest: Manifest, at: float) -> BlobStatus:
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
        keys = self
        if signer_id not in self.keys:
            keys = TrustedKeys({signer_id: self._certified(signed.get("certificate"), signer_id)})
        keys._check(key, signer_id, signature, status.message())
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

    def _certified(self, certificate: object, signer_id: str) -> Ed25519PublicKey:
        """The status key of `certificate`, which a trusted key must have signed."""
        if not isinstance(certificate, Mapping):
            known = ", ".join(sorted(self.keys)) or "none"
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
        self._check(f"(status key {signer_id})", by, signature, status_key_message(public))
        return public

    def _check(self, cache_key: str, signer_id: str, signature: str, signed: bytes) -> None:
        if not isinstance(signer_id, str) or not isinstance(signature, str):
            raise SignatureError(f"blob {cache_key} has a malformed signature; refusing it")
        public = self.keys.get(signer_id)
        if public is None:
            known = ", ".join(sorted(self.keys)) or "none"
            raise SignatureError(
                f"blob {cache_key} is signed by key {signer_id}, which this machine does not "
                f"trust (trusted: {known}; FARM_TRUSTED_KEYS)"
            )
        try:
            public.verify(base64.b64decode(signature, validate=True), signed)
        except (InvalidSignature, ValueError):
            raise SignatureError(
                f"blob {cache_key} has an invalid signature from key {signer_id}; refusing it"
            ) from None


def create_key_pair(private_path: Path) -> tuple[Path, str]:
    """Write a new private key (mode 0600) and its public key beside it (``.pub``)."""
    private = Ed25519PrivateKey.generate()
    private_path.parent.mkdir(parents=True, exist_ok=True)
    pem = private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    # Written whole under a temporary name, then linked into place: a concurrent reader never
    # sees half a key, and an existing key is never overwritten (FileExistsError).
    partial = private_path.with_name(f".{private_path.name}.{os.getpid()}.partial")
    descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "wb") as sink:
        sink.write(pem)
    try:
        os.link(partial, private_path)
    finally:
        partial.unlink()
    public_path = public_key_path(private_path)
    public_path.write_bytes(
        private.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return public_path, key_id(private.public_key())


def load_signer(private_path: Path | None, create: bool = False) -> Signer | None:
    """The signer of this worker; with `create`, a missing key file is made (embedded farm)."""
    if private_path is None:
        return None
    if create and not private_path.exists():
        with contextlib.suppress(FileExistsError):  # another process made it first
            create_key_pair(private_path)
    return Signer.from_file(private_path)


def public_key_path(private_path: Path) -> Path:
    return private_path.with_name(private_path.name + ".pub")


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
            "signature": self.signer.sign_status(status),
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
