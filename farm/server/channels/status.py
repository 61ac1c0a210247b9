"""What `farm channel show` and `farm channel status` answer, one dict shape for the API and
the direct backend: a channel's revisions and moves; its rollout as the edges report it (per
revision, toolchain and targets; the failures); the gates; what a toolchain still lacks."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from farm.core.channels import Entry
from farm.core.errors import NotFound, SpecError
from farm.core.spec import Toolchain
from farm.core.vocabulary import ACTIVE_STATES
from farm.server.channels import service
from farm.server.channels.gates import gate_problems
from farm.server.db.models import Blob, Channel, ChannelEdge, Job

FAILURES_SHOWN = 50


def channel_dict(channel: Channel) -> dict[str, Any]:
    return {
        "channel": channel.name,
        "sequence": channel.sequence,
        "stable_revision": channel.stable_revision,
        "candidate_revision": channel.candidate_revision,
        "percent": channel.percent,
        "previous_revisions": list(channel.previous_revisions),
        "created_by": channel.created_by,
        "created_at": channel.created_at.isoformat(),
        "updated_at": channel.updated_at.isoformat(),
        "signing_key_id": channel.signing_key_id,
    }


def show(session: Session, name: str, number: int | None = None) -> dict[str, Any]:
    channel = service.get(session, name)
    rows = service.revision_rows(session, channel)
    if number is not None:
        rows = [row for row in rows if row.number == number]
        if not rows:
            raise NotFound(f"channel {name!r} has no revision {number}")
    return {
        **channel_dict(channel),
        "revisions": [
            {
                "revision": row.number,
                "entries": row.entries,
                "created_by": row.created_by,
                "created_at": row.created_at.isoformat(),
            }
            for row in rows
        ],
        "moves": [
            {
                "sequence": move.sequence,
                "action": move.action,
                "revision": move.revision,
                "percent": move.percent,
                "stable_revision": move.stable_revision,
                "candidate_revision": move.candidate_revision,
                "forced": move.forced,
                "gate_report": move.gate_report,
                "actor": move.actor,
                "created_at": move.created_at.isoformat(),
            }
            for move in service.moves_of(session, channel)
        ],
    }


def status(
    session: Session,
    name: str,
    min_verifications: int,
    toolchain: Toolchain | None = None,
) -> dict[str, Any]:
    channel = service.get(session, name)
    edges = list(session.scalars(select(ChannelEdge).where(ChannelEdge.channel_id == channel.id)))
    groups: dict[tuple, dict[str, Any]] = defaultdict(lambda: {"edges": 0, "failing": 0})
    for edge in edges:
        key = (edge.revision, edge.openvino, edge.runtime_requirements, tuple(edge.targets))
        group = groups[key]
        group["edges"] += 1
        group["failing"] += 0 if edge.ok else 1
    failures = sorted((e for e in edges if not e.ok), key=lambda e: e.reported_at, reverse=True)
    running = [
        revision
        for revision in service.revisions_of(session, channel)
        if revision.number in (channel.stable_revision, channel.candidate_revision)
    ]
    candidate = next((r for r in running if r.number == channel.candidate_revision), None)
    answer: dict[str, Any] = {
        **channel_dict(channel),
        "edges": len(edges),
        "by_revision": [
            {
                "revision": revision,
                "openvino": openvino,
                "runtime_requirements": requirements,
                "targets": list(targets),
                **counts,
            }
            for (revision, openvino, requirements, targets), counts in sorted(
                groups.items(), key=lambda item: (item[0][0] or 0, str(item[0][1]))
            )
        ],
        "failures": [
            {
                "agent_id": edge.agent_id,
                "revision": edge.revision,
                "wanted_revision": edge.wanted_revision,
                "error": edge.error,
                "reported_at": edge.reported_at.isoformat(),
            }
            for edge in failures[:FAILURES_SHOWN]
        ],
        "gates": (
            gate_problems(session, candidate.entries, min_verifications) if candidate else []
        ),
    }
    if toolchain is not None:
        entries = [entry for revision in running for entry in revision.entries]
        answer["toolchain"] = toolchain.as_dict()
        answer["prebuilt"] = [_built_for(session, entry, toolchain) for entry in entries]
        answer["missing"] = [e for e in answer["prebuilt"] if e["state"] != "built"]
    return answer


def _built_for(session: Session, entry: Entry, toolchain: Toolchain) -> dict[str, Any]:
    """Whether the farm has `entry`'s blob for `toolchain`: built, building (a job), missing."""
    found: dict[str, Any] = {"name": entry.name, "spec": entry.spec.summary()}
    try:
        key = entry.cache_key(toolchain)
    except SpecError as error:
        return {**found, "cache_key": None, "state": "missing", "detail": str(error)}
    found["cache_key"] = key
    if session.scalar(select(Blob.id).where(Blob.cache_key == key)) is not None:
        return {**found, "state": "built"}
    job = session.scalar(select(Job.id).where(Job.cache_key == key, Job.state.in_(ACTIVE_STATES)))
    if job is not None:
        return {**found, "state": "building", "job": job}
    return {**found, "state": "missing"}


def dashboard_rows(session: Session, toolchains: list[Toolchain]) -> list[dict[str, Any]]:
    """Per channel, for the dashboard: its rollout, its edges, and for each toolchain the
    farm's workers compile with, how many of the entries it runs are built (prebuilt before
    the fleet upgrades, or not)."""
    rows = []
    for channel in session.scalars(select(Channel).order_by(Channel.name)):
        running = [
            entry
            for revision in service.revisions_of(session, channel)
            if revision.number in (channel.stable_revision, channel.candidate_revision)
            for entry in revision.entries
        ]
        counts = session.execute(
            select(ChannelEdge.ok, func.count())
            .where(ChannelEdge.channel_id == channel.id)
            .group_by(ChannelEdge.ok)
        ).all()
        by_ok = {bool(ok): count for ok, count in counts}
        built = {}
        for toolchain in toolchains:
            states = [_built_for(session, entry, toolchain)["state"] for entry in running]
            built[toolchain.openvino] = (states.count("built"), len(states))
        rows.append(
            {
                **channel_dict(channel),
                "edges": sum(by_ok.values()),
                "failing": by_ok.get(False, 0),
                "built": built,
            }
        )
    return rows
