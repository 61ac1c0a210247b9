"""Edge side: import a farm blob with the least memory OpenVINO allows, and run it.

Imports openvino and numpy only (the edge install has no compiler, database or broker).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import openvino as ov

from farm.blobformat import read_header


@dataclass
class ImportedBlob:
    """A compiled model imported from a blob file, and the memory map it still reads from.

    Note: OpenVINO keeps pointing into the mapped file after `import_model`; dropping
    `mapping` while `compiled` is alive crashes the process. Keep this object, not just
    `compiled`.
    """

    compiled: ov.CompiledModel
    mapping: np.memmap
    import_seconds: float
    lease: BinaryIO | None = None
    """An open, share-locked handle on the cached file: the cache will not evict it."""


def import_blob(
    path: str | Path,
    device: str,
    weights_path: str | Path | None = None,
    lease: BinaryIO | None = None,
) -> ImportedBlob:
    """Import the blob at `path` for `device` ("CPU", "NPU") from a memory map.

    A weightless blob needs `weights_path`, the model's own `.bin`; the caller must have
    checked its digest, because OpenVINO imports a wrong `.bin` of the same size silently.
    """
    started = time.perf_counter()
    offset = read_header(path).payload_offset
    # Copy-on-write mapping: pages come from the file on demand; nothing is read up front.
    mapping = np.memmap(path, dtype=np.uint8, mode="c", offset=offset)
    tensor = ov.Tensor(mapping, shared_memory=True)
    properties: dict[str, str] = {}
    if weights_path is not None:
        properties = {"CACHE_MODE": "OPTIMIZE_SIZE", "WEIGHTS_PATH": str(weights_path)}
    compiled = ov.Core().import_model(tensor, device, properties)
    return ImportedBlob(compiled, mapping, time.perf_counter() - started, lease)


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
