"""Signed blobs: a worker signs (cache key, sha256) of each blob it records with an Ed25519 key;
an edge imports only blobs signed by a key it trusts.

The sha256 pins the bytes and the cache key pins what they claim to be (model, spec,
toolchain), so a signature cannot be moved to another blob, and a farm database or bucket
that an attacker can write to cannot hand an edge a blob no trusted worker produced.
Keys are files in PEM: the private key on workers (``FARM_SIGNING_KEY``), public keys on
edges (``FARM_TRUSTED_KEYS``, several allowed so keys can be rotated). Edge-safe.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from farm.core.errors import KeyFileError, SignatureError

MESSAGE_VERSION = b"farm-blob-signature-v1"


def message(cache_key: str, sha256: str) -> bytes:
    return b"\n".join([MESSAGE_VERSION, cache_key.encode("ascii"), sha256.encode("ascii")])


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

    def sign(self, cache_key: str, sha256: str) -> str:
        return base64.b64encode(self.private.sign(message(cache_key, sha256))).decode("ascii")

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

    def verify(self, cache_key: str, sha256: str, signer_id: str | None, signature: str | None):
        """Raise `SignatureError` unless a trusted key signed exactly (cache_key, sha256)."""
        if not signature or not signer_id:
            raise SignatureError(f"blob {cache_key} is not signed; refusing to import it")
        public = self.keys.get(signer_id)
        if public is None:
            known = ", ".join(sorted(self.keys)) or "none"
            raise SignatureError(
                f"blob {cache_key} is signed by key {signer_id}, which this machine does not "
                f"trust (trusted: {known}; FARM_TRUSTED_KEYS)"
            )
        try:
            public.verify(base64.b64decode(signature, validate=True), message(cache_key, sha256))
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
