"""What names a blob: the model files on disk, their digests, and the cache key of a spec.

Pure (hashing and spec only), so an edge computes exactly the key a worker recorded, with no
database, broker or storage client installed.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from farm.core import hashing, sources
from farm.core.spec import CompileSpec, Toolchain
from farm.core.stages import Recipe, model_part

Digest = Callable[[Path, Callable[[int], None] | None], str]
FileVersion = tuple[int, int, int, int, int]
"""(device, inode, size, mtime ns, ctime ns) of a file: any write, truncation, rename over it
or `touch` changes it (the ctime cannot be set by hand)."""


def file_version(path: Path) -> FileVersion:
    return version_of(os.stat(path))


def version_now(path: Path) -> FileVersion | None:
    """`file_version`, or None for a file gone or unreadable."""
    try:
        return file_version(path)
    except OSError:
        return None


def version_of(info: os.stat_result) -> FileVersion:
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)


@dataclass(frozen=True)
class ModelInfo:
    """A model as the farm knows it: the digests of its files by role, a name, its size."""

    identity: dict[str, str]
    name: str
    size_bytes: int
    recipe: Recipe = ()
    """The stages run on it before the compile (farm.core.stages); () for IR and ONNX."""


@dataclass(frozen=True)
class ModelRef:
    """A model on this machine's disk: its files by role, their digests, its display name."""

    files: dict[str, Path]
    identity: dict[str, str]
    name: str
    versions: dict[str, FileVersion] = field(default_factory=dict, compare=False)
    """Each file's `file_version` taken before its digest: while a file still has it, its bytes
    are the ones the digest names (the embedded store copies it without hashing it again)."""
    recipe: Recipe = ()
    """The stages run on it before the compile; () for IR and ONNX (`with_recipe`)."""

    @classmethod
    def from_path(
        cls,
        path: str | Path,
        progress: Callable[[int], None] | None = None,
        digests: Digest = hashing.sha256_file,
    ) -> ModelRef:
        """An IR or ONNX model. `digests` computes one file's sha256 (a cache, for the CLI)."""
        files = hashing.model_files(path)
        return cls._of(path, files, progress, digests)

    @classmethod
    def from_source(
        cls,
        path: str | Path,
        progress: Callable[[int], None] | None = None,
        digests: Digest = hashing.sha256_file,
    ) -> ModelRef:
        """Any source farm knows (`sources.detect`): IR, ONNX, TFLite, a folder, ..."""
        return cls._of(path, sources.detect(path).files, progress, digests)

    @classmethod
    def _of(
        cls,
        path: str | Path,
        files: dict[str, Path],
        progress: Callable[[int], None] | None,
        digests: Digest,
    ) -> ModelRef:
        versions = {role: file_version(file) for role, file in files.items()}
        identity = {role: digests(file, progress) for role, file in sorted(files.items())}
        # The name is only a label; one that is not UTF-8 keeps its readable part.
        name = Path(path).name.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
        return cls(files, identity, name, versions)

    def with_recipe(self, recipe: Recipe) -> ModelRef:
        return ModelRef(self.files, self.identity, self.name, self.versions, tuple(recipe))

    @property
    def key_model(self) -> dict[str, object]:
        """The ``model`` part of its blobs' cache keys (`stages.model_part`)."""
        return model_part(self.identity, self.recipe)

    @property
    def size_bytes(self) -> int:
        return sum(file.stat().st_size for file in self.files.values())

    @property
    def info(self) -> ModelInfo:
        return ModelInfo(dict(self.identity), self.name, self.size_bytes, self.recipe)


def key_for(
    identity: Mapping[str, str], spec: CompileSpec, toolchain: Toolchain, recipe: Recipe = ()
) -> str:
    """The cache key of (model, spec, toolchain): docs/architecture.md §5; with a recipe, of
    the model its last stage makes (§15)."""
    return hashing.cache_key(
        model_part(identity, recipe),
        spec.target.name,
        spec.canonical(),
        toolchain.key_part(spec.target),
    )
