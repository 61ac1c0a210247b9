"""Pull a pipeline bundle into a ready folder and open it with OpenVINO GenAI (§17).

The edge computes the bundle's key offline from its own folder (`farm.core.pipelines`), checks
the signed manifest, then fetches each file, hashing it as it is written: a file the edge
already holds with the listed digest (the tokenizer, the weights in its own folder) is copied,
not downloaded; an interrupted download resumes where it stopped. Everything lands in a staging
folder beside the destination, renamed into place only when every file verified: a bundle with
any file missing or altered is refused whole, and nothing half-written is left where a
pipeline would open it.

Edge-safe: no torch, optimum or transformers; openvino-genai is imported only by
`open_bundle`/`verify_bundle` (through `farm.genai`), when a pipeline is opened.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from farm.core.bundles import CACHE_FOLDER, MANIFEST_NAME, BundleFile, BundleManifest, verify
from farm.core.errors import IntegrityMismatch, NotFound, VerificationFailed
from farm.core.hashing import CHUNK_BYTES, sha256_file
from farm.core.pipelines import (
    GenAIOptions,
    context_length,
    detect,
    folder_key,
    hf_pipeline,
    is_huggingface_folder,
)
from farm.core.signing import TrustedKeys
from farm.core.spec import Target


class BundleSource(Protocol):
    """Where a bundle's bytes come from (a farm's store folder, presigned URLs, ...)."""

    def manifest(self, bundle_key: str) -> dict[str, Any]: ...

    def open_file(self, sha256: str, offset: int) -> BinaryIO:
        """The stored file's bytes from `offset` on."""
        ...


@dataclass(frozen=True)
class FolderSource:
    """A farm store on a local or mounted folder (the embedded farm's `.farm/blobs`)."""

    root: Path

    def manifest(self, bundle_key: str) -> dict[str, Any]:
        path = self.root / "bundles" / f"{bundle_key}.json"
        if not path.is_file():
            raise NotFound(f"no bundle {bundle_key}; compile it with farm submit <folder> first")
        document: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
        return document

    def open_file(self, sha256: str, offset: int) -> BinaryIO:
        path = self.root / "bundle-files" / sha256
        if not path.is_file():
            raise NotFound(f"bundle file {sha256} is not in the farm's store")
        stream = open(path, "rb")  # noqa: SIM115 - handed to the caller, who closes it
        stream.seek(offset)
        return stream


def staging_folder(out: Path, bundle_key: str) -> Path:
    """Where a pull of `bundle_key` into `out` collects its files (kept to resume)."""
    return out.parent / f".{out.name}.{bundle_key[:16]}.partial"


def pull(
    source: BundleSource,
    bundle_key: str,
    out: Path,
    trusted: TrustedKeys,
    local: Path | None = None,
    progress: Callable[[int], None] | None = None,
) -> BundleManifest:
    """Fetch bundle `bundle_key` into the ready folder `out` (replaced whole when all verified).

    `local` is the edge's own pipeline folder: files listed with the same digest are copied from
    it rather than downloaded."""
    signed = source.manifest(bundle_key)
    manifest = verify(signed, trusted, bundle_key)
    staging = staging_folder(out, bundle_key)
    staging.mkdir(parents=True, exist_ok=True)
    try:
        for entry in manifest.files:
            _fetch(source, entry, staging, local, progress)
    except IntegrityMismatch:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    (staging / MANIFEST_NAME).write_text(json.dumps(signed), encoding="utf-8")
    _replace_folder(staging, out)
    return manifest


def _fetch(
    source: BundleSource,
    entry: BundleFile,
    staging: Path,
    local: Path | None,
    progress: Callable[[int], None] | None,
) -> None:
    dest = staging / entry.path
    done = dest.with_name(dest.name + ".ok")
    if done.is_file() and dest.is_file():
        return
    dest.parent.mkdir(parents=True, exist_ok=True)
    mine = local / entry.path if local is not None else None
    if (
        mine is not None
        and mine.is_file()
        and mine.stat().st_size == entry.size
        and sha256_file(mine) == entry.sha256
    ):
        shutil.copyfile(mine, dest)
        done.touch()
        return
    digest = hashlib.sha256()
    have = dest.stat().st_size if dest.is_file() else 0
    if have > entry.size:
        dest.unlink()
        have = 0
    if have:
        with open(dest, "rb") as kept:  # resume: the bytes already written count
            while chunk := kept.read(CHUNK_BYTES):
                digest.update(chunk)
    with source.open_file(entry.sha256, have) as stream, open(dest, "ab") as sink:
        while have < entry.size and (chunk := stream.read(min(CHUNK_BYTES, entry.size - have))):
            sink.write(chunk)
            digest.update(chunk)
            have += len(chunk)
            if progress is not None:
                progress(len(chunk))
    if have != entry.size or digest.hexdigest() != entry.sha256:
        raise IntegrityMismatch(
            f"bundle file {entry.path}: got {have} bytes with sha256 {digest.hexdigest()}, the "
            f"signed manifest lists {entry.size} bytes with sha256 {entry.sha256}; the bundle "
            "is refused whole"
        )
    done.touch()


def _replace_folder(staging: Path, out: Path) -> None:
    for marker in staging.rglob("*.ok"):
        marker.unlink()
    if out.exists():
        old = out.parent / f".{out.name}.old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out, old)
        os.replace(staging, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staging, out)


def ready_pipeline(
    folder: Path,
    device: str,
    out: Path,
    source: BundleSource,
    trusted: TrustedKeys,
    kind: str | None = None,
    **flags: Any,
) -> Any:
    """The SDK in one call: the bundle key of `folder` (an OpenVINO pipeline folder, or a
    Hugging Face folder the farm exported) for `device` and the GenAI `flags`
    (`max_prompt_len=...`), computed here; the bundle pulled into `out` (files this folder has
    are copied); the ready `openvino_genai` pipeline, nothing compiled."""
    from farm.genai import toolchain

    pipeline = hf_pipeline(folder, kind) if is_huggingface_folder(folder) else detect(folder, kind)
    target = Target.parse(device)
    options = GenAIOptions.create(
        pipeline.kind, target, context_length=context_length(pipeline), **flags
    )
    key = folder_key(pipeline, options, toolchain(target))
    pull(source, key, out, trusted, local=folder)
    return open_bundle(out, trusted)


def read_manifest(ready: Path, trusted: TrustedKeys | None = None) -> BundleManifest:
    """The manifest of a ready folder; its signature checked again when `trusted` is given."""
    signed = json.loads((ready / MANIFEST_NAME).read_text(encoding="utf-8"))
    if trusted is not None:
        return verify(signed, trusted, str(signed.get("manifest", {}).get("bundle_key")))
    return BundleManifest.from_document(signed.get("manifest"))


def open_properties(ready: Path, manifest: BundleManifest) -> dict[str, Any]:
    """The properties that open a ready folder's pipeline without compiling its models."""
    target = Target.parse(manifest.target)
    options = GenAIOptions(kind=manifest.pipeline, target=target, values=dict(manifest.options))
    properties = options.properties()
    if target.is_npu:
        properties["BLOB_PATH"] = str(ready / "openvino_model.blob")
        if options.values.get("cache_mode") == "OPTIMIZE_SIZE":
            properties["WEIGHTS_PATH"] = str(ready / "openvino_model.bin")
    else:
        properties["CACHE_DIR"] = str(ready / CACHE_FOLDER)
    return properties


def open_bundle(ready: Path, trusted: TrustedKeys | None = None) -> Any:
    """A ready `openvino_genai` pipeline (LLMPipeline, WhisperPipeline, Text2ImagePipeline)
    opened from a pulled bundle."""
    from farm.genai import open_pipeline

    manifest = read_manifest(ready, trusted)
    device = Target.parse(manifest.target).device
    return open_pipeline(manifest.pipeline, ready, device, open_properties(ready, manifest))


def cache_state(folder: Path) -> dict[str, tuple[int, int, int]]:
    """Every cache entry's (inode, mtime ns, size): OpenVINO writes or replaces an entry on a
    miss and touches nothing on a hit, so an unchanged state proves nothing was compiled."""
    if not folder.is_dir():
        return {}
    return {
        path.name: (stat.st_ino, stat.st_mtime_ns, stat.st_size)
        for path in sorted(folder.iterdir())
        if path.is_file() and (stat := path.stat())
    }


def check_files(ready: Path, manifest: BundleManifest) -> None:
    """Every listed file of a ready folder is there with its size and sha256; else
    `IntegrityMismatch` naming the first that is not (edited or damaged after the pull)."""
    for entry in manifest.files:
        path = ready / entry.path
        if not path.is_file():
            raise IntegrityMismatch(f"{path}: listed in the bundle's manifest, missing; pull again")
        if path.stat().st_size != entry.size or sha256_file(path) != entry.sha256:
            raise IntegrityMismatch(
                f"{path}: not the file the bundle's signed manifest lists (size or sha256 "
                "differ); pull the bundle again"
            )


def verify_bundle(
    ready: Path, trusted: TrustedKeys | None = None, files: bool = True
) -> dict[str, Any]:
    """Check the ready folder's files (`files`), open its pipeline, run the fixed reference
    input and compare with what was recorded at compile time; raise `VerificationFailed` on any
    difference. The report says which cache entries were compiled on open (none, when the
    bundle is whole)."""
    from farm.genai import open_pipeline, reference_run

    manifest = read_manifest(ready, trusted)
    if files:
        check_files(ready, manifest)
    if not manifest.reference:
        raise VerificationFailed(
            f"bundle {manifest.bundle_key} records no reference run (compiled for "
            f"{manifest.target}, which its worker cannot run): nothing to compare"
        )
    before = cache_state(ready / CACHE_FOLDER)
    device = Target.parse(manifest.target).device
    pipeline = open_pipeline(manifest.pipeline, ready, device, open_properties(ready, manifest))
    after = cache_state(ready / CACHE_FOLDER)
    got = reference_run(manifest.pipeline, pipeline)
    report = {
        "bundle_key": manifest.bundle_key,
        "expected": manifest.reference,
        "got": got,
        "compiled_on_open": sorted(name for name in after if after[name] != before.get(name)),
    }
    if got != manifest.reference:
        raise VerificationFailed(
            f"bundle {manifest.bundle_key}: the pipeline generated {got}, the farm recorded "
            f"{manifest.reference} for the same input with greedy decoding",
            details=report,
        )
    return report


def install_cache(ready: Path, cache_dir: Path) -> list[Path]:
    """The CACHE_DIR drop-in: copy a CPU bundle's cache entries into `cache_dir`, so an app that
    opens its own copy of the folder with ``CACHE_DIR=cache_dir`` (and the bundle's properties,
    `open_properties`) imports them instead of compiling. Each entry is written atomically."""
    written = []
    cache_dir.mkdir(parents=True, exist_ok=True)
    for entry in sorted((ready / CACHE_FOLDER).iterdir()):
        target = cache_dir / entry.name
        partial = cache_dir / f".{entry.name}.partial"
        shutil.copyfile(entry, partial)
        os.replace(partial, target)
        written.append(target)
    return written
