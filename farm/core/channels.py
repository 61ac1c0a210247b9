"""Channels: what a fleet runs, as a signed document every edge acts on (docs/architecture.md
§16). Pure and edge-safe: an edge checks the document, picks its revision and computes each
cache key with nothing but this module, `identity` and its own toolchain.

A channel document names no cache key and no blob: each entry is a model (the sha256 of each
of its files) and a compile spec, and each edge computes the key with its own toolchain. The
blob it then fetches carries its own signed manifest (the model digests included), so no one
between the farm's signer and the edge can point it at another blob. The document is signed
by the API's key (farm.core.apikey: certified by a blob signing key for channel documents,
never for manifests) under its own domain (`CHANNEL_DOMAIN`), never readable as a blob
manifest or the reverse, and carries a `sequence` that grows with every move of the channel:
an edge keeps the highest it accepted and refuses anything lower (an old document replayed by
a proxy, or by an API whose database was rolled back), so a fleet returns to an older
revision only through a newer, signed document (a rollback).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from farm.core.errors import ChannelReplay, IntegrityMismatch, SpecError
from farm.core.hashing import canonical_json
from farm.core.identity import key_for
from farm.core.spec import CompileSpec, Toolchain

if TYPE_CHECKING:  # signing needs cryptography: loaded by the functions that sign or check
    from farm.core.apikey import ApiSigner
    from farm.core.signing import Signer, TrustedKeys

CHANNEL_VERSION = 1
CHANNEL_DOMAIN = b"farm-channel-v1\n"
"""Prefix of a channel document's signed bytes: never a manifest's or a reference's."""
BUCKETS = 10_000
"""An edge's place in a staged rollout, in basis points: percent P takes buckets below P·100."""
MOVES = ("create", "set", "promote", "rollback")

_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def check_name(name: str) -> str:
    """A channel name: 1 to 63 lower-case letters, digits, '.', '_' or '-'."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise SpecError(
            f"channel name {str(name)[:80]!r} must be 1 to 63 lower-case letters, digits, "
            "'.', '_' or '-', starting with a letter or digit"
        )
    return name


def check_percent(percent: object) -> int:
    if isinstance(percent, bool) or not isinstance(percent, int) or not 1 <= percent <= 100:
        raise SpecError(f"--percent {percent!r} must be a whole number from 1 to 100")
    return percent


@dataclass(frozen=True)
class Entry:
    """One model of a revision: its files' digests, a display name, and the spec to run."""

    name: str
    model: dict[str, str]
    spec: CompileSpec

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "model": dict(sorted(self.model.items())),
            "target": self.spec.target.name,
            "spec": self.spec.canonical(),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Entry:
        model = data.get("model")
        if not (
            isinstance(model, Mapping)
            and model
            and all(isinstance(k, str) and _hex(v) for k, v in model.items())
        ):
            raise IntegrityMismatch("a channel entry's model digests are malformed")
        spec = data.get("spec")
        if not isinstance(spec, Mapping):
            raise IntegrityMismatch("a channel entry has no compile spec")
        return cls(
            str(data.get("name") or ""),
            dict(model),
            CompileSpec.from_canonical(str(data.get("target")), spec),
        )

    def cache_key(self, toolchain: Toolchain) -> str:
        """The key of this entry's blob for an edge with `toolchain` (computed offline)."""
        return key_for(self.model, self.spec, toolchain)


@dataclass(frozen=True)
class Revision:
    number: int
    entries: tuple[Entry, ...]

    def as_dict(self) -> dict[str, Any]:
        return {"revision": self.number, "entries": [e.as_dict() for e in self.entries]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Revision:
        number = data.get("revision")
        entries = data.get("entries")
        if not _count(number) or not isinstance(entries, list):
            raise IntegrityMismatch("a channel revision is malformed")
        return cls(int(str(number)), tuple(Entry.from_dict(e) for e in entries))


@dataclass(frozen=True)
class Document:
    """What an edge following a channel acts on, and exactly what is signed.

    `stable` runs everywhere; `candidate`, when set, runs on the edges whose bucket is under
    `percent` (`in_stage`). `move` is what made this document (an audit hint: the sequence,
    not the move, is what orders documents)."""

    channel: str
    sequence: int
    stable: Revision | None
    candidate: Revision | None
    percent: int
    move: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "v": CHANNEL_VERSION,
            "channel": self.channel,
            "sequence": self.sequence,
            "stable": self.stable.as_dict() if self.stable else None,
            "candidate": self.candidate.as_dict() if self.candidate else None,
            "percent": self.percent,
            "move": self.move,
        }

    def message(self) -> bytes:
        return CHANNEL_DOMAIN + canonical_json(self.as_dict())

    def digest(self) -> str:
        return hashlib.sha256(self.message()).hexdigest()

    @classmethod
    def from_dict(cls, data: Any) -> Document:
        if not isinstance(data, Mapping) or data.get("v") != CHANNEL_VERSION:
            raise IntegrityMismatch(
                f"not a version {CHANNEL_VERSION} channel document; refusing it (an edge older "
                "than the farm? upgrade farm on this edge)"
            )
        percent, sequence = data.get("percent"), data.get("sequence")
        if not (_count(sequence) and _count(percent) and int(str(percent)) <= 100):
            raise IntegrityMismatch("a channel document's sequence or percent is malformed")
        if data.get("move") not in MOVES:
            raise IntegrityMismatch("a channel document's move is malformed")
        stable, candidate = data.get("stable"), data.get("candidate")
        return cls(
            check_name(str(data.get("channel"))),
            int(str(sequence)),
            Revision.from_dict(stable) if stable is not None else None,
            Revision.from_dict(candidate) if candidate is not None else None,
            int(str(percent)),
            str(data["move"]),
        )

    def revision_for(self, agent_id: str) -> Revision | None:
        """The revision the edge `agent_id` runs under this document (None: nothing yet)."""
        if self.candidate is not None and in_stage(self.channel, agent_id, self.percent):
            return self.candidate
        return self.stable


def bucket(channel: str, agent_id: str) -> int:
    """An edge's stable place in a channel's staged rollouts, 0 to `BUCKETS` - 1: sha256 of the
    channel and the agent id, so the same edges go first every time in one channel, and other
    channels pick other edges first."""
    digest = hashlib.sha256(f"{channel}\n{agent_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % BUCKETS


def in_stage(channel: str, agent_id: str, percent: int) -> bool:
    """Whether `agent_id` is among the `percent` % of edges that run a channel's candidate."""
    return bucket(channel, agent_id) < percent * (BUCKETS // 100)


def sign_document(signer: Signer, document: Document) -> str:
    """The signature (base64) of `document` under `CHANNEL_DOMAIN`."""
    return signer.sign_message(document.message())


def signed_document(api: ApiSigner, document: Document) -> dict[str, Any]:
    """`{signing_key_id, signature, certificate}` of `document`, by the API's key."""
    from farm.core.apikey import CHANNEL_DOCUMENT

    return api.sign(CHANNEL_DOCUMENT, document.message())


def verify_document(
    trust: TrustedKeys,
    document: Document,
    signer_id: str | None,
    signature: str | None,
    certificate: Mapping[str, Any] | None = None,
) -> None:
    """Raise `SignatureError` unless a key in `trust`, or a key a key in `trust` certified for
    channel documents (`certificate`: the API's key), signed exactly `document`."""
    from farm.core.apikey import CHANNEL_DOCUMENT, check_signed

    check_signed(
        trust,
        CHANNEL_DOCUMENT,
        document.message(),
        signer_id,
        signature,
        certificate,
        f"the document of channel {document.channel!r}",
    )


def check_successor(accepted: Document | None, offered: Document) -> None:
    """Raise `ChannelReplay` unless `offered` may follow `accepted` (the last document this
    edge accepted): the same channel, and a higher sequence, or the very same document."""
    if accepted is None:
        return
    if offered.channel != accepted.channel:
        raise IntegrityMismatch(
            f"asked for channel {accepted.channel!r}, got the document of {offered.channel!r}; "
            "refusing it (a proxy or the farm's API swapped it)"
        )
    if offered.sequence < accepted.sequence:
        raise ChannelReplay(
            f"channel {offered.channel!r}: offered sequence {offered.sequence}, older than "
            f"sequence {accepted.sequence} this edge already accepted; refusing it (a replayed "
            "document); staying on the current revision"
        )
    if offered.sequence == accepted.sequence and offered.digest() != accepted.digest():
        raise ChannelReplay(
            f"channel {offered.channel!r}: a second, different document with sequence "
            f"{offered.sequence}; refusing it, staying on the current revision"
        )


def _hex(value: object) -> bool:
    return isinstance(value, str) and bool(_HEX64.match(value))


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
