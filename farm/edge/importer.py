"""Edge side: import a farm blob with the least memory OpenVINO allows, and run it.

Imports openvino and numpy only (the edge install has no compiler, database or broker).
"""

from __future__ import annotations

import logging
import mmap
import re
import threading
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import openvino as ov

from farm.core.blobformat import CACHE_ENTRY_MAGIC, read_header
from farm.core.errors import BlobFormatError, FarmError, Incompatible
from farm.core.filecache import write_atomically
from farm.core.hashing import cache_key
from farm.core.spec import CompileSpec, Target, Toolchain, compile_properties
from farm.toolchain import last_line

log = logging.getLogger(__name__)

COPY_CHUNK = 1 << 20

DROP_BEHIND_SECONDS = 0.01
"""While OpenVINO imports, the blob's mapped pages are released from this process this often."""


@dataclass
class ImportedBlob:
    """A compiled model imported from a blob file, and the memory map it still reads from.

    OpenVINO may keep reading the mapped file after `import_model` (the CPU plugin on some
    processors runs weights in place): the map lives as long as `compiled` does, whether or
    not this object is kept (`import_blob`).
    """

    compiled: ov.CompiledModel
    mapping: np.ndarray
    """The blob's payload, a copy-on-write memory map of the file."""
    import_seconds: float
    lease: BinaryIO | None = None
    """An open, share-locked handle on the cached file: the cache will not evict it."""


def payload_offset(path: str | Path) -> int:
    """Where the `export_model()` bytes start in the file at `path`: after the header of an
    OpenVINO cache entry (what the farm stores and caches), or at 0 in a plain exported blob
    (what `farm pull -o` writes and `CompiledModel.export_model()` returns)."""
    with open(path, "rb") as stream:
        head = stream.read(len(CACHE_ENTRY_MAGIC))
    return read_header(path).payload_offset if head == CACHE_ENTRY_MAGIC else 0


def write_export(entry: str | Path, output: str | Path) -> Path:
    """Write the plain `export_model()` bytes of the cache entry at `entry` to `output`,
    streamed (never whole in memory), atomically: the file any OpenVINO program imports
    (`core.import_model(data, device)`, `benchmark_app -m`, a C++ app)."""
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    with open(entry, "rb") as source, write_atomically(output, mode=0o644) as target:
        source.seek(read_header(entry).payload_offset)
        while chunk := source.read(COPY_CHUNK):
            target.write(chunk)
    return output


def import_config(record: Mapping[str, Any], spec: CompileSpec | None = None) -> dict[str, str]:
    """What a CPU blob is imported with: the properties it was compiled with (the CPU plugin
    takes them from the import's config, not from the blob: a blob compiled in f32 on a CPU
    whose default is bf16 ran parts of its graph in bf16 when imported without them;
    docs/openvino.md). OpenVINO's own cache imports with the compile's config. `spec`: the one
    the caller computed the blob's key from, itself; else the record's, only when the signed
    cache key was computed from it (`signed_spec`: the record's spec is not signed). Nothing
    for NPU blobs (their config is the compiler's), nor when no spec can be trusted."""
    spec = spec or signed_spec(record)
    if spec is None:
        given = record.get("spec")
        asked = isinstance(given, Mapping) and (
            given.get("config") or given.get("performance_hint")
        )
        if asked and not str(record.get("target", "")).startswith("NPU"):
            log.warning(
                "blob %s: its record's spec is not the one its signed key was computed from "
                "(a blob made through a recipe, or an altered answer): imported with the "
                "device's defaults",
                record.get("cache_key"),
            )
        return {}
    if spec.target.is_npu:
        return {}
    properties = compile_properties(spec)
    properties.pop("CACHE_MODE", None)  # a weightless blob's: `import_blob` sets it
    return properties


def signed_spec(record: Mapping[str, Any]) -> CompileSpec | None:
    """The record's spec when the cache key, with the record's signed model digests, target and
    toolchain, was computed from it as stored (a compiled IR or ONNX model's record; a recipe's
    key holds its last stage, which the record does not); None otherwise, or when malformed."""
    try:
        target = Target.parse(record["target"])
        toolchain = Toolchain.from_json(record["toolchain"]).key_part(target)
        key = cache_key(record["model"], target.name, record["spec"], toolchain)
        if key != record.get("cache_key"):
            return None
        return CompileSpec.from_canonical(target, record["spec"])
    except (FarmError, KeyError, TypeError, ValueError, AttributeError):
        return None


def import_blob(
    path: str | Path,
    device: str,
    weights_path: str | Path | None = None,
    lease: BinaryIO | None = None,
    config: Mapping[str, str] | None = None,
) -> ImportedBlob:
    """Import the blob at `path` for `device` ("CPU", "NPU") from a memory map.

    A weightless blob needs `weights_path`, the model's own `.bin`; the caller must have
    checked its digest, because OpenVINO imports a wrong `.bin` of the same size silently.
    `config`: the compile properties to import with (`import_config`).
    """
    started = time.perf_counter()
    offset = payload_offset(path)
    # Copy-on-write mapping: pages come from the file on demand; nothing is read up front.
    # (OpenVINO wants a writable array; it never writes to the blob it imports.)
    with open(path, "rb") as stream:
        whole = mmap.mmap(stream.fileno(), 0, access=mmap.ACCESS_COPY)
    mapping = np.frombuffer(whole, dtype=np.uint8, offset=offset)
    tensor = ov.Tensor(mapping, shared_memory=True)
    properties = dict(config or {})
    if weights_path is not None:
        properties |= {"CACHE_MODE": "OPTIMIZE_SIZE", "WEIGHTS_PATH": str(weights_path)}
    with _DropBehind(whole):
        compiled = ov.Core().import_model(tensor, device, properties)
    # A caller that keeps only the compiled model must not lose the memory it runs from:
    # unmapped under it, its next inference crashed the process (AMD EPYC, OpenVINO 2026.4).
    weakref.finalize(compiled, _unmapped, mapping)
    return ImportedBlob(compiled, mapping, time.perf_counter() - started, lease)


def _unmapped(mapping: np.ndarray) -> None:
    """Called once the compiled model that read `mapping` is gone: the last reference to the
    map then goes with this call, and the map with it."""


class _DropBehind:
    """Unmaps the blob's pages from this process, every DROP_BEHIND_SECONDS while OpenVINO
    imports and once after, so they are never all resident at once.

    The CPU plugin copies (and repacks) the weights while importing: without this, the peak
    is the copy plus every page of the blob it read (2x the blob for a 512 MB model; the same
    as OpenVINO's own cache-dir hit). The pages stay in the page cache; a page read again is
    mapped again (a minor fault), so a compiled model that still reads the blob (NPU) works.

    Note: `MADV_DONTNEED` would also drop pages this process wrote to the copy-on-write
    mapping; nothing writes to it (OpenVINO takes the imported blob as constant).
    """

    def __init__(self, mapping: mmap.mmap) -> None:
        self.mapping = mapping
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="farm-drop-behind", daemon=True)

    def __enter__(self) -> _DropBehind:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._drop()

    def _run(self) -> None:
        while not self._stop.wait(DROP_BEHIND_SECONDS):
            self._drop()

    def _drop(self) -> None:
        self.mapping.madvise(mmap.MADV_DONTNEED)


WEIGHTLESS_SIGNS = (
    "Empty weights data in bin file",
    "bin file cannot be found",
    "Attribute and shape size are inconsistent for Const op",
)
"""What OpenVINO says when it imports a weightless blob without its weights (2025.4, 2026.4)."""
OTHER_DEVICE_SIGNS = ("No backend registered during model import",)
"""What the NPU plugin says of a blob that is not an NPU blob (a CPU blob, for one)."""


def import_failure(path: Path, target: Target, weights: Path | None, error: Exception) -> FarmError:
    """Why OpenVINO could not import the blob at `path` for `target`, as the farm error a person
    can act on: weights to give (bad input), a blob of another device or OpenVINO (this host
    cannot import it, exit 4), or a file that is no blob (bad input)."""
    said = last_line(error)
    text = str(error)
    if weights is None and any(sign in text for sign in WEIGHTLESS_SIGNS):
        # The farm's cache and --into-cache-dir name a blob after its cache key.
        key = path.stem if re.fullmatch("[0-9a-f]{64}", path.stem) else "CACHE_KEY"
        return BlobFormatError(
            f"{path} is a weightless blob (compiled with --weightless): import it with "
            f"--weights MODEL.bin, the weights file of the very model it was compiled from (its "
            f"sha256 is the model's `bin` digest, in `farm status {key} --json`). "
            f"OpenVINO said: {said}"
        )
    if any(sign in text for sign in OTHER_DEVICE_SIGNS):
        return Incompatible(
            f"cannot import {path} on {target}: it is not a blob for {target.device} "
            f"(compiled for another device?); OpenVINO said: {said}"
        )
    built = _built_with(path)
    if built is not None and built != ov.get_version():
        return Incompatible(
            f"cannot import {path}: it was written by OpenVINO {built}, this machine has "
            f"{ov.get_version()}; OpenVINO said: {said}"
        )
    return BlobFormatError(
        f"OpenVINO cannot import {path} (neither an exported blob nor an OpenVINO cache "
        f"entry it can read): {said}"
    )


def _built_with(path: Path) -> str | None:
    """The OpenVINO build that wrote the cache entry at `path` (None for a plain blob)."""
    try:
        return read_header(path).openvino_build if payload_offset(path) else None
    except (OSError, BlobFormatError):
        return None


def infer_once(imported: ImportedBlob, seed: int = 0) -> dict[str, Any]:
    """Run one inference on random input; dynamic dimensions are taken as 1."""
    rng = np.random.default_rng(seed)
    inputs = {}
    for port in imported.compiled.inputs:
        shape = [1 if dim.is_dynamic else dim.get_length() for dim in port.get_partial_shape()]
        dtype = port.get_element_type().to_dtype()
        if np.issubdtype(dtype, np.integer):
            inputs[port.get_any_name()] = rng.integers(0, 2, size=shape, dtype=dtype)
        else:
            inputs[port.get_any_name()] = rng.random(shape).astype(dtype)
    request = imported.compiled.create_infer_request()
    started = time.perf_counter()
    request.infer(inputs)
    latency = time.perf_counter() - started
    outputs = {
        port.get_any_name() if port.get_names() else f"output{i}": list(
            request.get_output_tensor(i).shape
        )
        for i, port in enumerate(imported.compiled.outputs)
    }
    return {"latency_seconds": latency, "outputs": outputs}
