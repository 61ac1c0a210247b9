"""The signed bundle manifest (farm/core/bundles.py) and the edge's pull (farm/edge/bundle.py)
on plain files: signatures, refusals, resume, nothing half-written. No GenAI here."""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path
from typing import BinaryIO

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from farm.core.bundles import (
    MANIFEST_NAME,
    BundleFile,
    BundleManifest,
    safe_path,
    sign,
    verify,
)
from farm.core.errors import IntegrityMismatch, NotFound, SignatureError
from farm.core.signing import Signer, TrustedKeys
from farm.edge.bundle import FolderSource, install_cache, pull, read_manifest, staging_folder

KEY = "ab" * 32
FILES = {
    "openvino_model.xml": b"<net/>",
    "openvino_model.bin": bytes(range(256)) * 64,
    "cache/123.blob": b"compiled" * 1000,
}


def _manifest(files: dict[str, bytes] = FILES, key: str = KEY) -> BundleManifest:
    return BundleManifest(
        bundle_key=key,
        pipeline="llm",
        target="CPU",
        options={"cache_mode": "OPTIMIZE_SPEED", "attention_backend": "SDPA"},
        toolchain={"openvino": "2026.4.1"},
        files=tuple(
            BundleFile(path, hashlib.sha256(data).hexdigest(), len(data))
            for path, data in sorted(files.items())
        ),
        reference={"prompt": "p", "tokens": [1, 2]},
    )


@pytest.fixture
def signer() -> Signer:
    return Signer(Ed25519PrivateKey.generate())


def _store(root: Path, signer: Signer, files: dict[str, bytes] = FILES) -> Path:
    for data in files.values():
        path = root / "bundle-files" / hashlib.sha256(data).hexdigest()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    (root / "bundles").mkdir(parents=True, exist_ok=True)
    (root / "bundles" / f"{KEY}.json").write_text(json.dumps(sign(_manifest(files), signer)))
    return root


def test_signed_manifest_round_trip_and_refusals(signer: Signer) -> None:
    trusted = TrustedKeys({}).with_key(signer.public_key)
    signed = sign(_manifest(), signer)
    assert verify(json.loads(json.dumps(signed)), trusted, KEY) == _manifest()
    with pytest.raises(SignatureError, match="asked for bundle"):
        verify(signed, trusted, "cd" * 32)
    with pytest.raises(SignatureError, match="which this machine does not trust"):
        verify(signed, TrustedKeys({}), KEY)
    altered = json.loads(json.dumps(signed))
    altered["manifest"]["files"][0]["size"] += 1
    with pytest.raises(SignatureError, match="the signature does not verify"):
        verify(altered, trusted, KEY)
    unsigned = {"manifest": signed["manifest"]}
    with pytest.raises(SignatureError, match="is not signed"):
        verify(unsigned, trusted, KEY)


@pytest.mark.parametrize(
    ("path", "ok"),
    [
        ("cache/1.blob", True),
        ("../x", False),
        ("/etc/passwd", False),
        ("a//b", False),
        ("a/./b", False),
        ("ok.json", True),
        ("spa ce", False),
    ],
)
def test_bundle_paths_are_plain_relative_paths(path: str, ok: bool) -> None:
    assert safe_path(path) is ok


def test_manifest_shape_refusals() -> None:
    document = _manifest().document()
    with pytest.raises(SignatureError, match="not a plain relative path"):
        BundleManifest.from_document(
            {**document, "files": [{"path": "../evil", "sha256": "0" * 64, "size": 1}]}
        )
    with pytest.raises(SignatureError, match="lists each file once, and not itself"):
        BundleManifest.from_document(
            {**document, "files": [{"path": MANIFEST_NAME, "sha256": "0" * 64, "size": 1}]}
        )
    with pytest.raises(SignatureError, match="sha256 is not 64 hex"):
        BundleManifest.from_document(
            {**document, "files": [{"path": "a", "sha256": "xyz", "size": 1}]}
        )


def test_pull_writes_a_ready_folder(signer: Signer, tmp_path: Path) -> None:
    store = _store(tmp_path / "store", signer)
    trusted = TrustedKeys({}).with_key(signer.public_key)
    ready = tmp_path / "ready"
    local = tmp_path / "mine"
    local.mkdir()
    (local / "openvino_model.bin").write_bytes(FILES["openvino_model.bin"])
    fetched: list[int] = []
    manifest = pull(FolderSource(store), KEY, ready, trusted, local=local, progress=fetched.append)
    for path, data in FILES.items():
        assert (ready / path).read_bytes() == data
    assert sum(fetched) == manifest.size - len(FILES["openvino_model.bin"])  # copied, not fetched
    assert read_manifest(ready, trusted) == manifest
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "ready", "store"]
    app_cache = tmp_path / "app"
    assert [p.name for p in install_cache(ready, app_cache)] == ["123.blob"]
    # A second pull replaces the folder whole.
    (ready / "stray").write_text("x")
    pull(FolderSource(store), KEY, ready, trusted)
    assert not (ready / "stray").exists()


class _Cut:
    def __init__(self, inner: FolderSource, limit: int) -> None:
        self.inner, self.limit = inner, limit

    def manifest(self, bundle_key: str) -> dict:
        return self.inner.manifest(bundle_key)

    def open_file(self, sha256: str, offset: int) -> BinaryIO:
        with self.inner.open_file(sha256, offset) as stream:
            data = stream.read(max(0, self.limit - offset))

        class Failing(io.BytesIO):
            def read(self, size: int | None = -1) -> bytes:
                chunk = super().read(size)
                if not chunk:
                    raise ConnectionResetError("lost")
                return chunk

        return Failing(data)


def test_pull_resumes_where_it_stopped(signer: Signer, tmp_path: Path) -> None:
    store = _store(tmp_path / "store", signer)
    trusted = TrustedKeys({}).with_key(signer.public_key)
    ready = tmp_path / "ready"
    with pytest.raises(ConnectionResetError):
        pull(_Cut(FolderSource(store), 5000), KEY, ready, trusted)
    assert not ready.exists() and staging_folder(ready, KEY).is_dir()
    fetched: list[int] = []
    manifest = pull(FolderSource(store), KEY, ready, trusted, progress=fetched.append)
    assert sum(fetched) == manifest.size - 5000
    assert (ready / "cache/123.blob").read_bytes() == FILES["cache/123.blob"]
    assert not staging_folder(ready, KEY).exists()


def test_an_altered_or_missing_file_refuses_the_bundle_whole(
    signer: Signer, tmp_path: Path
) -> None:
    store = _store(tmp_path / "store", signer)
    trusted = TrustedKeys({}).with_key(signer.public_key)
    stored = store / "bundle-files" / hashlib.sha256(FILES["openvino_model.bin"]).hexdigest()
    stored.write_bytes(bytes(len(FILES["openvino_model.bin"])))
    ready = tmp_path / "ready"
    with pytest.raises(IntegrityMismatch, match=r"openvino_model\.bin: .* refused whole"):
        pull(FolderSource(store), KEY, ready, trusted)
    assert not ready.exists() and not staging_folder(ready, KEY).exists()
    stored.unlink()
    with pytest.raises(NotFound, match="not in the farm's store"):
        pull(FolderSource(store), KEY, ready, trusted)
    assert not ready.exists()


def test_the_edge_module_loads_no_genai_and_no_framework() -> None:
    import subprocess
    import sys

    code = (
        "import sys, farm.edge.bundle, farm.core.pipelines, farm.core.bundles;"
        "print([m for m in ('openvino_genai', 'torch', 'transformers', 'optimum')"
        " if m in sys.modules])"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert loaded.stdout.strip() == "[]"


def test_check_files_names_a_file_edited_after_the_pull(signer: Signer, tmp_path: Path) -> None:
    from farm.edge.bundle import check_files

    store = _store(tmp_path / "store", signer)
    ready = tmp_path / "ready"
    manifest = pull(FolderSource(store), KEY, ready, TrustedKeys({}).with_key(signer.public_key))
    check_files(ready, manifest)
    (ready / "openvino_model.xml").write_bytes(b"<net>")
    with pytest.raises(IntegrityMismatch, match=r"openvino_model\.xml: not the file"):
        check_files(ready, manifest)
    (ready / "cache" / "123.blob").unlink()
    (ready / "openvino_model.xml").write_bytes(FILES["openvino_model.xml"])
    with pytest.raises(IntegrityMismatch, match=r"123\.blob: listed .* missing"):
        check_files(ready, manifest)
