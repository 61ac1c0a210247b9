"""A channel's life on the farm: create, set a revision, promote in stages, roll back; each
move signs a new document with the next sequence and is recorded in `channel_moves`.

The first revision of a channel becomes its stable revision at once (there is nothing to
stage from); later ones wait for `promote`. One candidate at a time: promoting another
revision while one is rolled out is refused (finish it, or roll it back first), so an edge
never leaves a candidate for a third revision it was not chosen for.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from farm.core.apikey import CHANNEL_DOCUMENT, ApiSigner
from farm.core.channels import (
    Document,
    Entry,
    Revision,
    check_name,
    check_percent,
    signed_document,
)
from farm.core.clock import now
from farm.core.errors import Conflict, NotFound, PromotionBlocked
from farm.core.hashing import canonical_json, model_digest
from farm.server.channels.gates import gate_problems
from farm.server.db.models import Channel, ChannelEdge, ChannelMove, ChannelRevision, Model


def get(session: Session, name: str, lock: bool = False) -> Channel:
    query = select(Channel).where(Channel.name == check_name(name))
    if lock and session.get_bind().dialect.name == "postgresql":
        query = query.with_for_update()
    channel = session.scalar(query)
    if channel is None:
        raise NotFound(f"no channel {name!r}; create it with `farm channel create {name}`")
    return channel


def create(session: Session, signer: ApiSigner | None, name: str, actor: str) -> Channel:
    check_name(name)
    if session.scalar(select(Channel.id).where(Channel.name == name)) is not None:
        raise Conflict(f"channel {name!r} exists already")
    at = now()
    channel = Channel(
        name=name,
        created_by=actor,
        created_at=at,
        sequence=0,
        stable_revision=None,
        candidate_revision=None,
        percent=0,
        previous_revisions=[],
        document={},
        updated_at=at,
    )
    session.add(channel)
    session.flush()
    _publish(session, signer, channel, "create")
    _audit(session, channel, "create", actor)
    session.commit()
    return channel


def set_revision(
    session: Session, signer: ApiSigner | None, name: str, entries: Sequence[Entry], actor: str
) -> ChannelRevision:
    """A new revision running `entries` (each model must be known to the farm: submitted)."""
    if not entries:
        raise Conflict("a revision runs at least one model")
    for entry in entries:
        if (
            session.scalar(select(Model.id).where(Model.digest == model_digest(entry.model)))
            is None
        ):
            raise NotFound(
                f"the farm does not know model {entry.name or model_digest(entry.model)[:16]}; "
                "submit it first (`farm submit MODEL --device ...`)"
            )
    channel = get(session, name, lock=True)
    latest = session.scalar(
        select(ChannelRevision.number)
        .where(ChannelRevision.channel_id == channel.id)
        .order_by(ChannelRevision.number.desc())
        .limit(1)
    )
    revision = ChannelRevision(
        channel_id=channel.id,
        number=(latest or 0) + 1,
        entries=[entry.as_dict() for entry in entries],
        created_by=actor,
        created_at=now(),
    )
    session.add(revision)
    session.flush()
    if channel.stable_revision is None and channel.candidate_revision is None:
        channel.stable_revision = revision.number
        _publish(session, signer, channel, "set")
    _audit(session, channel, "set", actor, revision=revision.number)
    session.commit()
    return revision


def promote(
    session: Session,
    signer: ApiSigner | None,
    name: str,
    number: int,
    percent: int,
    actor: str,
    *,
    min_verifications: int,
    force: bool = False,
) -> Channel:
    """Roll revision `number` out to `percent` % of the edges (100: it becomes stable). The
    first stage of a revision is not gated; every further one is (`gates.gate_problems`),
    unless `force` (recorded with what the gates said)."""
    check_percent(percent)
    channel = get(session, name, lock=True)
    revision = _revision(session, channel, number)
    if channel.candidate_revision not in (None, number):
        raise Conflict(
            f"channel {name!r} is rolling out revision {channel.candidate_revision} "
            f"({channel.percent} %); promote it to 100 or roll it back before revision {number}"
        )
    if channel.candidate_revision is None and channel.stable_revision == number:
        raise Conflict(f"revision {number} is channel {name!r}'s stable revision already")
    if channel.candidate_revision == number and percent < channel.percent:
        raise Conflict(
            f"revision {number} runs on {channel.percent} % of the edges already; a smaller "
            "share is a rollback (`farm channel rollback`)"
        )
    first_stage = channel.candidate_revision is None and percent < 100
    problems = [] if first_stage else gate_problems(session, _entries(revision), min_verifications)
    if problems and not force:
        raise PromotionBlocked(
            f"promoting channel {name!r} revision {number} to {percent} % is refused: "
            + "; ".join(problems)
            + " (an admin may --force it; the force is recorded)",
            details={"problems": problems},
        )
    if percent == 100:
        if channel.stable_revision is not None:
            channel.previous_revisions = [*channel.previous_revisions, channel.stable_revision]
        channel.stable_revision, channel.candidate_revision, channel.percent = number, None, 0
    else:
        channel.candidate_revision, channel.percent = number, percent
    _publish(session, signer, channel, "promote")
    _audit(
        session,
        channel,
        "promote",
        actor,
        revision=number,
        percent=percent,
        forced=bool(problems),
        gate_report="; ".join(problems) or None,
    )
    session.commit()
    return channel


def rollback(session: Session, signer: ApiSigner | None, name: str, actor: str) -> Channel:
    """Everyone back to the previous revision at their next sync: a candidate is withdrawn;
    without one, the stable revision before the current one becomes stable again."""
    channel = get(session, name, lock=True)
    if channel.candidate_revision is not None:
        channel.candidate_revision, channel.percent = None, 0
    elif channel.previous_revisions:
        *earlier, back = channel.previous_revisions
        channel.previous_revisions = earlier
        channel.stable_revision = back
    else:
        raise Conflict(f"channel {name!r} has no earlier revision to roll back to")
    _publish(session, signer, channel, "rollback")
    _audit(session, channel, "rollback", actor, revision=channel.stable_revision)
    session.commit()
    return channel


def document_of(session: Session, name: str, signer: ApiSigner | None = None) -> dict[str, Any]:
    """What an edge fetches: the signed document, its signature, signer and the signer's
    certificate. A document an earlier key signed (before the API's key was replaced, or by
    an operator's CLI with the blob signing key) is served signed by `signer`, the key this
    farm signs with now: the same bytes, so no edge sees a move, and edges that trust only
    the blob signing key still find a certificate they can check."""
    channel = get(session, name)
    signed: dict[str, Any] = {
        "signature": channel.signature,
        "signing_key_id": channel.signing_key_id,
    }
    if signer is not None and channel.document and signer.may_sign(CHANNEL_DOCUMENT):
        if channel.signing_key_id != signer.key_id:
            signed = signed_document(signer, Document.from_dict(channel.document))
        signed["certificate"] = signer.certificate
    return {"document": channel.document, "certificate": None, **signed}


EDGE_FIELDS = (
    "revision",
    "wanted_revision",
    "sequence",
    "openvino",
    "runtime_requirements",
    "targets",
    "ok",
    "error",
)


def record_edge(session: Session, name: str, agent_id: str, report: dict[str, Any]) -> None:
    """Upsert what `agent_id` runs (one row per channel and edge)."""
    channel_id = session.scalar(select(Channel.id).where(Channel.name == check_name(name)))
    if channel_id is None:
        raise NotFound(f"no channel {name!r}")
    values = {field: report.get(field) for field in EDGE_FIELDS}
    values["targets"] = list(values["targets"] or [])
    values["ok"] = bool(values["ok"])
    values["reported_at"] = now()
    dialect = session.get_bind().dialect.name
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    statement = insert(ChannelEdge).values(channel_id=channel_id, agent_id=agent_id, **values)
    session.execute(
        statement.on_conflict_do_update(index_elements=["channel_id", "agent_id"], set_=values)
    )
    session.commit()


def revisions_of(session: Session, channel: Channel, number: int | None = None) -> list[Revision]:
    query = select(ChannelRevision).where(ChannelRevision.channel_id == channel.id)
    if number is not None:
        query = query.where(ChannelRevision.number == number)
    rows = list(session.scalars(query.order_by(ChannelRevision.number)))
    if number is not None and not rows:
        raise NotFound(f"channel {channel.name!r} has no revision {number}")
    return [Revision(row.number, _entries(row)) for row in rows]


def revision_rows(session: Session, channel: Channel) -> list[ChannelRevision]:
    return list(
        session.scalars(
            select(ChannelRevision)
            .where(ChannelRevision.channel_id == channel.id)
            .order_by(ChannelRevision.number)
        )
    )


def moves_of(session: Session, channel: Channel, limit: int = 100) -> list[ChannelMove]:
    return list(
        session.scalars(
            select(ChannelMove)
            .where(ChannelMove.channel_id == channel.id)
            .order_by(ChannelMove.id.desc())
            .limit(limit)
        )
    )


def kept_revisions(session: Session) -> list[Revision]:
    """Every revision a channel runs or may return to (stable, candidate, earlier stables):
    gc keeps their blobs."""
    kept = []
    for channel in session.scalars(select(Channel)):
        numbers = {channel.stable_revision, channel.candidate_revision, *channel.previous_revisions}
        numbers.discard(None)
        kept += [r for r in revisions_of(session, channel) if r.number in numbers]
    return kept


def kept_by_channels(session: Session) -> set[tuple[int, str, bytes]]:
    """(model id, target, canonical spec JSON) of every entry of a kept revision: the blobs gc
    never deletes, whatever their toolchain."""
    kept = set()
    for revision in kept_revisions(session):
        for entry in revision.entries:
            model_id = session.scalar(
                select(Model.id).where(Model.digest == model_digest(entry.model))
            )
            if model_id is not None:
                spec = canonical_json(entry.spec.canonical())
                kept.add((model_id, entry.spec.target.name, spec))
    return kept


def _revision(session: Session, channel: Channel, number: int) -> ChannelRevision:
    row = session.scalar(
        select(ChannelRevision).where(
            ChannelRevision.channel_id == channel.id, ChannelRevision.number == number
        )
    )
    if row is None:
        raise NotFound(f"channel {channel.name!r} has no revision {number}")
    return row


def _entries(row: ChannelRevision) -> tuple[Entry, ...]:
    return tuple(Entry.from_dict(entry) for entry in row.entries)


def _publish(session: Session, signer: ApiSigner | None, channel: Channel, move: str) -> None:
    """The channel's next document: its rollout columns, the revisions' entries, the next
    sequence; signed by the API's key (or the blob signing key where this host holds it)."""

    def revision(number: int | None) -> Revision | None:
        return (
            None
            if number is None
            else Revision(number, _entries(_revision(session, channel, number)))
        )

    document = Document(
        channel.name,
        channel.sequence + 1,
        revision(channel.stable_revision),
        revision(channel.candidate_revision),
        channel.percent,
        move,
    )
    channel.sequence = document.sequence
    channel.document = document.as_dict()
    signed = signed_document(signer, document) if signer else {}
    channel.signature, channel.signing_key_id = (
        signed.get("signature"),
        signed.get("signing_key_id"),
    )
    channel.updated_at = now()


def _audit(
    session: Session,
    channel: Channel,
    action: str,
    actor: str,
    *,
    revision: int | None = None,
    percent: int | None = None,
    forced: bool = False,
    gate_report: str | None = None,
) -> None:
    session.add(
        ChannelMove(
            channel_id=channel.id,
            sequence=channel.sequence,
            action=action,
            revision=revision,
            percent=percent,
            stable_revision=channel.stable_revision,
            candidate_revision=channel.candidate_revision,
            forced=forced,
            gate_report=gate_report,
            actor=actor,
            created_at=now(),
        )
    )
