"""The only place that compiles: read a model, apply shapes, compile with OpenVINO, write the blob.

The blob is written by OpenVINO itself through its model cache (`CACHE_DIR` + `CACHE_BLOB_ID`)
rather than through `CompiledModel.export_model()`, which returns the whole blob as Python bytes:
for a 512 MB model that is ~6x slower and ~0.5 GB more peak memory (docs/openvino.md). The file
is therefore an OpenVINO cache entry; `farm.blobformat` finds the export payload inside it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import openvino as ov

from farm.core.blobformat import read_header
from farm.core.rss import peak_rss_bytes, reset_peak_rss
from farm.core.spec import CompileSpec, Toolchain
from farm.prepare import apply_shapes, check_input_sizes, check_static, read_model
from farm.toolchain import (
    cache_properties,
    classify_failure,
    compile_properties,
    device_name,
    toolchain_of,
    written_blob,
)


@dataclass(frozen=True)
class CompileResult:
    blob_path: Path
    payload_offset: int
    size_bytes: int
    toolchain: Toolchain
    compile_seconds: float
    """Wall time of `compile_model`, minus the time OpenVINO spent writing the blob."""
    export_seconds: float
    """Wall time from the blob file's first appearance to the end of the write."""
    peak_rss_bytes: int
    """Peak resident memory of this process during the compile (VmHWM, reset before)."""
    properties: dict[str, str]


def compile_to_file(
    files: Mapping[str, Path],
    spec: CompileSpec,
    out_dir: Path,
    blob_id: str,
    model: ov.Model | None = None,
    compiling: threading.Event | None = None,
) -> CompileResult:
    """Compile the model for `spec` and let OpenVINO write ``out_dir/<blob_id>.blob``: the
    model in `files`, or `model` when given (one in memory, which the compile may reshape: a
    clone the caller no longer uses). `compiling` is set as OpenVINO's compile starts.

    `out_dir` must not already hold that file: OpenVINO would load it instead of compiling.
    """
    blob_path = Path(out_dir) / f"{blob_id}.blob"
    if blob_path.exists():
        raise FileExistsError(f"{blob_path} exists; compile into an empty folder")
    core = ov.Core()
    if model is None:
        model = read_model(core, files)
    apply_shapes(model, spec)
    check_input_sizes(model)
    if spec.target.is_npu:
        check_static(model, spec.target)
    props = compile_properties(spec)
    run_props = {**props, **cache_properties(Path(out_dir), blob_id)}

    reset_peak_rss()
    watcher = _FileWatcher(blob_path)
    started = time.perf_counter()
    try:
        with watcher:
            if compiling is not None:
                compiling.set()
            compiled = core.compile_model(model, device_name(spec.target), run_props)
    except Exception as error:
        raise classify_failure(spec.target, error) from error
    total = time.perf_counter() - started
    peak = peak_rss_bytes()
    blob_path = written_blob(Path(out_dir), blob_path)
    export_seconds = max(0.0, watcher.finished - watcher.appeared) if watcher.appeared else 0.0
    return CompileResult(
        blob_path=blob_path,
        payload_offset=read_header(blob_path).payload_offset,
        size_bytes=blob_path.stat().st_size,
        toolchain=toolchain_of(compiled, spec.target, blob_path),
        compile_seconds=total - export_seconds,
        export_seconds=export_seconds,
        peak_rss_bytes=peak,
        properties=props,
    )


class _FileWatcher:
    """Notes when a file first appears, to split OpenVINO's compile from its blob write."""

    POLL_SECONDS = 0.005

    def __init__(self, path: Path) -> None:
        self.path = path
        self.appeared: float | None = None
        self.finished = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> _FileWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.finished = time.perf_counter()
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stop.is_set():
            if self.path.exists():
                self.appeared = time.perf_counter()
                return
            self._stop.wait(self.POLL_SECONDS)
