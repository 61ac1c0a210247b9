"""The signed manifest of a pipeline bundle (docs/architecture.md §17).

One document lists every file an edge needs to open a compiled GenAI pipeline (compiled blobs
or cache entries, the tokenizer and detokenizer IR, configs, weights), each with its size and
sha256, plus what it was compiled from and with, and the tokens recorded at compile time. A
farm key signs the canonical JSON of the document; an edge checks the signature before it
downloads anything and each file's digest as it arrives. Pure and edge-safe.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cryptography.exceptions import InvalidSignature

from farm.core.errors import SignatureError
from farm.core.hashing import canonical_json
from farm.core.signing import Signer, TrustedKeys

MANIFEST_VERSION = 1
MANIFEST_NAME = "farm_bundle.json"
"""The signed manifest, written into a ready folder beside the files it lists."""
CACHE_FOLDER = "cache"
"""Where a CPU bundle's OpenVINO cache entries live, relative to the ready folder."""
_SIGNED_PREFIX = b"farm-bundle-v1\n"
_SEGMENT = re.compile(r"^[A-Za-z0-9._-]+$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class BundleFile:
    path: str
    """Relative to the ready folder, POSIX separators; plain segments only."""
    sha256: str
    size: int


@dataclass(frozen=True)
class BundleManifest:
    bundle_key: str
    pipeline: str
    target: str
    options: dict[str, Any]
    toolchain: dict[str, str]
    files: tuple[BundleFile, ...]
    reference: dict[str, Any]

    def document(self) -> dict[str, Any]:
        return {
            "v": MANIFEST_VERSION,
            "bundle_key": self.bundle_key,
            "pipeline": self.pipeline,
            "target": self.target,
            "options": dict(self.options),
            "toolchain": dict(self.toolchain),
            "files": [{"path": f.path, "sha256": f.sha256, "size": f.size} for f in self.files],
            "reference": dict(self.reference),
        }

    def message(self) -> bytes:
        return _SIGNED_PREFIX + canonical_json(self.document())

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)

    @classmethod
    def from_document(cls, data: Any) -> BundleManifest:
        """Check the shape of a manifest (from the network: nothing trusted yet)."""
        if not isinstance(data, dict) or data.get("v") != MANIFEST_VERSION:
            raise SignatureError("not a farm bundle manifest of version 1")
        files = data.get("files")
        if not isinstance(files, list) or not files:
            raise SignatureError("a bundle manifest lists its files")
        parsed = []
        for entry in files:
            if not isinstance(entry, dict):
                raise SignatureError("a bundle manifest's file entry is an object")
            path, sha, size = entry.get("path"), entry.get("sha256"), entry.get("size")
            if not isinstance(path, str) or not safe_path(path):
                raise SignatureError(f"bundle file path {path!r} is not a plain relative path")
            if not isinstance(sha, str) or not _HEX64.match(sha):
                raise SignatureError(f"bundle file {path}: sha256 is not 64 hex digits")
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise SignatureError(f"bundle file {path}: size is not a byte count")
            parsed.append(BundleFile(path, sha, size))
        if len({f.path for f in parsed}) != len(parsed) or MANIFEST_NAME in {
            f.path for f in parsed
        }:
            raise SignatureError("a bundle manifest lists each file once, and not itself")
        key = data.get("bundle_key")
        if not isinstance(key, str) or not _HEX64.match(key):
            raise SignatureError("a bundle manifest names its 64-hex bundle key")
        return cls(
            bundle_key=key,
            pipeline=str(data.get("pipeline")),
            target=str(data.get("target")),
            options=dict(data.get("options") or {}),
            toolchain={str(k): str(v) for k, v in dict(data.get("toolchain") or {}).items()},
            files=tuple(parsed),
            reference=dict(data.get("reference") or {}),
        )


def safe_path(path: str) -> bool:
    """A relative path of plain segments (no `..`, no absolute path, no odd bytes)."""
    segments = path.split("/")
    return all(s not in ("", ".", "..") and _SEGMENT.match(s) for s in segments)


def sign(manifest: BundleManifest, signer: Signer) -> dict[str, Any]:
    """The signed manifest as stored and shipped: the document, the key id, the signature."""
    signature = signer.sign_message(manifest.message())
    return {"manifest": manifest.document(), "signer": signer.key_id, "signature": signature}


def verify(signed: Mapping[str, Any], trusted: TrustedKeys, bundle_key: str) -> BundleManifest:
    """The manifest of `signed` if a trusted key signed exactly it and it names `bundle_key`;
    else `SignatureError` (nothing of the bundle may be used)."""
    manifest = BundleManifest.from_document(signed.get("manifest"))
    if manifest.bundle_key != bundle_key:
        raise SignatureError(
            f"asked for bundle {bundle_key}, the farm answered with {manifest.bundle_key}"
        )
    signer_id, signature = signed.get("signer"), signed.get("signature")
    if not isinstance(signer_id, str) or not isinstance(signature, str):
        raise SignatureError(f"bundle {bundle_key} is not signed; refusing it")
    public = trusted.keys.get(signer_id)
    if public is None:
        raise SignatureError(
            f"bundle {bundle_key} is signed by key {signer_id}, which this machine does not "
            "trust; add the farm's public key to FARM_TRUSTED_KEYS"
        )
    try:
        public.verify(base64.b64decode(signature, validate=True), manifest.message())
    except (InvalidSignature, ValueError):
        raise SignatureError(f"bundle {bundle_key}: the signature does not verify") from None
    return manifest
