"""The stored blob format: an OpenVINO cache entry, read without OpenVINO.

A farm blob is exactly the file OpenVINO writes into its `CACHE_DIR` (``<cache_blob_id>.blob``):
one XML header line, zero padding up to ``header_size_alignment``, then the bytes
`CompiledModel.export_model()` would return. Keeping OpenVINO's own format means the worker
lets OpenVINO write the blob straight to disk (no copy of the blob in Python memory), the edge
imports it from a memory map at `payload_offset`, and a blob dropped into an app's `CACHE_DIR`
is a cache hit. See docs/openvino.md, "OpenVINO's own cache".
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from farm.core.errors import BlobFormatError

MAX_HEADER_BYTES = 64 * 1024
CACHE_ENTRY_MAGIC = b"<?xml"
"""How a cache entry starts; a plain `export_model()` blob starts with the plugin's payload."""
_HEADER = re.compile(rb"^<\?xml[^>]*\?>\s*<compiled_blob\b(?P<attrs>[^>]*)/>\n")
_ATTR = re.compile(rb'(\w+)="([^"]*)"')


@dataclass(frozen=True)
class BlobHeader:
    attributes: dict[str, str]
    payload_offset: int
    """Bytes before the export payload: header line plus alignment padding."""

    @property
    def openvino_build(self) -> str | None:
        return self.attributes.get("ie_version")


def read_header(path: str | Path) -> BlobHeader:
    """Parse the cache-entry header of the blob at `path` and locate its payload."""
    with open(path, "rb") as stream:
        head = stream.read(MAX_HEADER_BYTES)
        size = stream.seek(0, 2)
    return parse_header(head, size, str(path))


def parse_header(head: bytes, size: int, name: str) -> BlobHeader:
    """The header in `head` (the first `MAX_HEADER_BYTES` of a blob of `size` bytes, named
    `name` in errors): for a blob read as a stream (`farm keys resign`)."""
    match = _HEADER.match(head)
    if not match:
        raise BlobFormatError(f"{name}: not an OpenVINO compiled blob (no cache header)")
    attributes = {k.decode(): v.decode() for k, v in _ATTR.findall(match["attrs"])}
    offset = match.end()
    alignment = int(attributes.get("header_size_alignment", "0") or 0)
    if alignment > 0:
        offset = -(-offset // alignment) * alignment
    if offset >= size:
        raise BlobFormatError(f"{name}: blob has a header but no payload ({size} bytes)")
    return BlobHeader(attributes, offset)
