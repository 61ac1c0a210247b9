"""An edge following a channel (docs/architecture.md §16): fetch the channel's signed document,
check it, pick this edge's revision, compute each key offline with this machine's toolchain,
fetch (and verify, import) every blob, and only then switch.

The revision an edge runs is its `current` pointer, `FARM_CACHE_DIR/channels/<name>/current.json`:
the document it accepted (with its signature), the revision, and each entry's cache key. It is
replaced by a rename, after every blob of the new revision is in the cache, verified and (with
`do_import`) imported: a switch that fails or is killed leaves the old pointer, so the edge
keeps running the old revision. The pointer's sequence is the highest this edge accepted; a
document with a lower one is refused (`ChannelReplay`).

Edge-safe: core, the agent and the toolchain only.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from farm.core.channels import Document, Revision, check_name, check_successor, verify_document
from farm.core.errors import IntegrityMismatch, VerificationFailed
from farm.core.spec import Target, Toolchain
from farm.edge.agent import EdgeAgent

REPORT_EVERY_SECONDS = 300.0
"""An edge whose state did not change reports again after this long (the status's freshness)."""


class ChannelSource(Protocol):
    def channel_document(self, name: str) -> dict[str, Any]: ...

    def report_channel_edge(self, name: str, report: dict[str, Any]) -> None: ...


@dataclass
class Current:
    """What `current.json` holds: the accepted document and the revision this edge runs."""

    document: dict[str, Any]
    signature: str | None
    signing_key_id: str | None
    revision: int | None
    keys: list[dict[str, Any]] = field(default_factory=list)
    """Per entry of the revision: name, target, spec summary, cache key."""
    reported_at: float = 0.0
    certificate: dict[str, Any] | None = None
    """The signer's certificate, when the API's key signed the document (farm.core.apikey)."""


@dataclass
class ChannelSync:
    channel: str
    status: str
    """unchanged, switched, failed (still on `revision`), or empty (no revision yet)."""
    revision: int | None
    wanted_revision: int | None
    sequence: int | None
    keys: list[dict[str, Any]] = field(default_factory=list)
    downloaded: int = 0
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def state_dir(cache_dir: Path, name: str) -> Path:
    return Path(cache_dir) / "channels" / check_name(name)


def load_current(folder: Path) -> Current | None:
    """The pointer, or None before the first switch. A pointer that is not one (edited by
    hand, a disk fault) is an error, never silently 'nothing': the edge would accept any
    older document."""
    path = folder / "current.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return Current(**data)
    except FileNotFoundError:
        return None
    except (ValueError, TypeError) as error:
        raise IntegrityMismatch(
            f"{path} is not a channel pointer ({error}); remove it to follow the channel afresh"
        ) from None


def save_current(folder: Path, current: Current) -> None:
    """Write the pointer whole, then rename it over the old one (atomic on POSIX)."""
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / f".current.{os.getpid()}.partial"
    with open(partial, "w", encoding="utf-8") as sink:
        json.dump(asdict(current), sink, sort_keys=True)
        sink.flush()
        os.fsync(sink.fileno())
    os.replace(partial, folder / "current.json")
    with contextlib.suppress(OSError):  # the rename itself durable, where the OS allows
        descriptor = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


def sync_channel(
    agent: EdgeAgent,
    source: ChannelSource,
    name: str,
    cache_dir: Path,
    *,
    do_import: bool = False,
    do_verify: bool = False,
    on_fetched: Callable[[str], None] | None = None,
) -> ChannelSync:
    """One pass: follow channel `name` to the revision its document gives this edge."""
    folder = state_dir(cache_dir, name)
    current = load_current(folder)
    accepted = Document.from_dict(current.document) if current else None
    running = current.revision if current else None
    offered = source.channel_document(name)
    document = Document.from_dict(offered.get("document"))
    if document.channel != name:
        raise IntegrityMismatch(
            f"asked for channel {name!r}, got the document of {document.channel!r}; refusing "
            "it (a proxy or the farm's API swapped it)"
        )
    if agent.trust is not None:
        verify_document(
            agent.trust,
            document,
            offered.get("signing_key_id"),
            offered.get("signature"),
            offered.get("certificate"),
        )
    check_successor(accepted, document)
    revision = document.revision_for(agent.agent_id)
    wanted = revision.number if revision else None
    result = ChannelSync(name, "unchanged", running, wanted, document.sequence)
    if current is not None and accepted is not None and wanted == running:
        result.keys = current.keys
        if document.sequence != accepted.sequence:  # a move that leaves this edge where it is
            current.document = document.as_dict()
            current.signature, current.signing_key_id, current.certificate = _signed(offered)
            save_current(folder, current)
        elif time.time() - current.reported_at < REPORT_EVERY_SECONDS:
            return result  # nothing changed and reported lately: no request at all
        _report(agent, source, name, result, current, folder)
        return result
    try:
        keys, downloaded = _fetch_all(agent, revision, do_import, do_verify, on_fetched)
    except Exception as error:  # the old revision stays; the farm hears why
        result.status, result.error = "failed", f"{type(error).__name__}: {error}"
        if current is None:
            current = Current(document={}, signature=None, signing_key_id=None, revision=None)
            _report(agent, source, name, result, current, folder=None)
        else:
            _report(agent, source, name, result, current, folder)
        return result
    signature, signing_key_id, certificate = _signed(offered)
    current = Current(
        document.as_dict(), signature, signing_key_id, wanted, keys, certificate=certificate
    )
    save_current(folder, current)
    result.status = "switched" if revision is not None else "empty"
    result.revision, result.keys, result.downloaded = wanted, keys, downloaded
    _report(agent, source, name, result, current, folder)
    return result


def _fetch_all(
    agent: EdgeAgent,
    revision: Revision | None,
    do_import: bool,
    do_verify: bool,
    on_fetched: Callable[[str], None] | None,
) -> tuple[list[dict[str, Any]], int]:
    """Every blob of `revision` in the cache, verified (and imported): its entries' keys."""
    keys, downloaded, imported = [], 0, []
    for entry in revision.entries if revision else ():
        toolchain: Toolchain = agent.toolchain(entry.spec.target)
        key = entry.cache_key(toolchain)
        fetched = agent.fetch(key)
        downloaded += fetched.downloaded
        if on_fetched is not None:
            on_fetched(key)
        if do_verify and not entry.spec.weightless:
            from farm.edge.verify import verify_once  # numpy and the reference: only when asked

            outcome = verify_once(agent, key)
            if outcome is not None and not outcome["passed"]:
                why = outcome["error"] or "outputs outside tolerance"
                raise VerificationFailed(f"blob {key} of {entry.name} failed verification: {why}")
        if do_import and not entry.spec.weightless:
            imported.append(agent.load(key, blob=fetched.blob, spec=entry.spec))
        elif fetched.downloaded:
            agent.report_download(key)
        keys.append(
            {
                "name": entry.name,
                "target": entry.spec.target.name,
                "spec": entry.spec.summary(),
                "cache_key": key,
            }
        )
    imported.clear()  # imported to prove they load; the app imports them from the cache
    return keys, downloaded


def _signed(offered: dict[str, Any]) -> tuple[str | None, str | None, dict[str, Any] | None]:
    certificate = offered.get("certificate")
    return (
        offered.get("signature"),
        offered.get("signing_key_id"),
        certificate if isinstance(certificate, dict) else None,
    )


def _report(
    agent: EdgeAgent,
    source: ChannelSource,
    name: str,
    result: ChannelSync,
    current: Current,
    folder: Path | None,
) -> None:
    """Tell the farm what this edge runs; a farm that cannot hear it changes nothing here."""
    targets = sorted({key["target"] for key in current.keys})
    toolchain = _toolchain_of(agent, targets)
    report = {
        "agent_id": agent.agent_id,
        "revision": current.revision,
        "wanted_revision": result.wanted_revision,
        "sequence": Document.from_dict(current.document).sequence if current.document else None,
        "openvino": toolchain.openvino if toolchain else None,
        "runtime_requirements": toolchain.runtime_requirements if toolchain else None,
        "targets": targets,
        "ok": result.status != "failed",
        "error": result.error[:4000] if result.error else None,
    }
    with contextlib.suppress(Exception):
        source.report_channel_edge(name, report)
        if folder is not None and result.status != "failed":
            current.reported_at = time.time()
            save_current(folder, current)


def _toolchain_of(agent: EdgeAgent, targets: list[str]) -> Toolchain | None:
    with contextlib.suppress(Exception):
        cpu = "CPU" in targets or not targets
        return agent.toolchain(Target.parse("CPU" if cpu else targets[0]))
    return None
