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

PARTS_DOMAIN = b"farm-blob-parts-v1\n"
"""Prefix of a part digests signature's bytes: readable as no other signed message."""

PART_BYTES = 64 << 20
"""The size of a blob's parts (the last one shorter): an edge downloads them on several
connections and checks each on the thread that receives it (`Parts`)."""

MIN_PART_BYTES = 1 << 20
"""The smallest part size an edge accepts: a record cannot make it send a request per byte."""

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
class Parts:
    """The sha256 of each `part_bytes` piece of a blob (the last one shorter), signed by the
    worker after it recorded the blob, beside its manifest: an edge that verified them checks
    each part as it arrives, on the connection that brings it, instead of one sha256 over the
    whole file after (bench/README.md "edge"). A signature of its own, like the reference's,
    so the manifests that edges of every version check stay as they were."""

    part_bytes: int
    sha256s: tuple[str, ...]

    @classmethod
    def of_record(cls, record: Mapping[str, Any]) -> Parts | None:
        """The parts a blob record lists, if it lists well-formed ones for its size (None:
        none, or malformed: the edge then checks the whole file's sha256)."""
        part_bytes, sha256s, size = (
            record.get("part_bytes"),
            record.get("part_sha256s"),
            record.get("size_bytes"),
        )
        if not (_count(part_bytes) and _count(size) and isinstance(sha256s, list | tuple)):
            return None
        assert isinstance(part_bytes, int) and isinstance(size, int)
        if part_bytes < MIN_PART_BYTES or len(sha256s) != part_count(size, part_bytes):
            return None
        if not all(map(_hex64, sha256s)):
            return None
        return cls(part_bytes, tuple(sha256s))


def part_count(size: int, part_bytes: int) -> int:
    return -(-size // part_bytes)


def parts_message(cache_key: str, blob_sha256: str, size_bytes: int, parts: Parts) -> bytes:
    """What a part digests signature covers: the parts, bound to the blob (its key, the sha256
    of its bytes and their number)."""
    return PARTS_DOMAIN + canonical_json(
        {
            "cache_key": cache_key,
            "sha256": blob_sha256,
            "size_bytes": size_bytes,
            "part_bytes": parts.part_bytes,
            "part_sha256s": list(parts.sha256s),
        }
    )


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

    def sign_message(self, signed: bytes) -> str:
        """The signature (base64) of `signed`, a message of its own domain (`farm.core.status`)."""
        return base64.b64encode(self.private.sign(signed)).decode("ascii")

    def sign_reference(
        self, cache_key: str, blob_sha256: str, reference_sha256: str, reference_size: int
    ) -> str:
        """The signature (base64) binding a reference file to its blob."""
        signed = reference_message(cache_key, blob_sha256, reference_sha256, reference_size)
        return base64.b64encode(self.private.sign(signed)).decode("ascii")

    def sign_parts(self, cache_key: str, blob_sha256: str, size_bytes: int, parts: Parts) -> str:
        """The signature (base64) binding a blob's part digests to the blob."""
        signed = parts_message(cache_key, blob_sha256, size_bytes, parts)
        return base64.b64encode(self.private.sign(signed)).decode("ascii")

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
        self.check(cache_key, signer_id, signature, message(cache_key, sha256))

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
        self.check(key, signer_id, signature, manifest.message())

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
        self.check(key, signer_id, signature, signed)

    def verified_parts(self, blob: Mapping[str, Any], manifest: Manifest) -> Parts | None:
        """The record's part digests, if a trusted key bound them to the blob `manifest`
        describes (verified already); None otherwise: the edge then checks the whole file's
        sha256, the signed manifest's, so parts that are missing, malformed or not signed by
        a trusted key cost speed, never trust."""
        parts = Parts.of_record({**blob, "size_bytes": manifest.size_bytes})
        signature, signer_id = blob.get("parts_signature"), blob.get("signing_key_id")
        if parts is None or not isinstance(signature, str) or not isinstance(signer_id, str):
            return None
        signed = parts_message(manifest.cache_key, manifest.sha256, manifest.size_bytes, parts)
        try:
            self.check(manifest.cache_key, signer_id, signature, signed)
        except SignatureError:
            return None
        return parts

    def check(self, cache_key: str, signer_id: str, signature: str, signed: bytes) -> None:
        """Raise `SignatureError` unless the trusted key `signer_id` signed `signed`."""
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
