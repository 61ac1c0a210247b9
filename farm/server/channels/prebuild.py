"""Prebuild for the next toolchain: submit every model and spec a fleet runs for a toolchain
its edges do not have yet (a new OpenVINO release, driver or NPU compiler), so the edges that
upgrade find hits. Through `submit_matrix`, the farm's one submit use case."""

from __future__ import annotations

import functools
from collections import defaultdict
from datetime import timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from farm.core.channels import Entry
from farm.core.clock import now
from farm.core.config import Settings
from farm.core.errors import SpecError
from farm.core.hashing import model_digest
from farm.core.identity import ModelInfo
from farm.core.spec import CompileSpec, Toolchain
from farm.server.channels import service
from farm.server.db.models import Blob, Channel, Model, Pull
from farm.server.jobs.dispatch import Dispatcher
from farm.server.jobs.service import submit_matrix
from farm.server.storage import BlobStore


def channel_entries(session: Session, name: str) -> list[Entry]:
    """What a channel's fleet runs: its stable and candidate revisions' entries."""
    channel: Channel = service.get(session, name)
    wanted = {channel.stable_revision, channel.candidate_revision}
    return [
        entry
        for revision in service.revisions_of(session, channel)
        if revision.number in wanted
        for entry in revision.entries
    ]


def pulled_entries(session: Session, days: float) -> list[Entry]:
    """Every model and spec whose blob an edge pulled in the last `days`, any toolchain."""
    since = now() - timedelta(days=days)
    rows = session.execute(
        select(Model.files, Model.name, Blob.target, Blob.spec)
        .join(Blob, Blob.model_id == Model.id)
        .where(select(Pull.id).where(Pull.blob_id == Blob.id, Pull.created_at >= since).exists())
    ).all()
    entries = {}
    for files, name, target, spec in rows:
        entry = Entry(name, dict(files), CompileSpec.from_canonical(target, spec))
        entries[(model_digest(entry.model), target, str(entry.spec.canonical()))] = entry
    return list(entries.values())


def prebuild(
    session: Session,
    store: BlobStore,
    settings: Settings,
    dispatcher: Dispatcher,
    entries: list[Entry],
    toolchain: Toolchain,
    submitter: str,
) -> list[dict[str, Any]]:
    """Submit `entries` for `toolchain`, one matrix per model; one result per entry."""
    if not entries:
        raise SpecError("nothing to prebuild: the fleet runs no model")
    by_model: dict[str, list[Entry]] = defaultdict(list)
    for entry in entries:
        by_model[model_digest(entry.model)].append(entry)
    results = []
    for digest, group in by_model.items():
        model = session.scalar(select(Model).where(Model.digest == digest))
        files = group[0].model
        info = ModelInfo(
            dict(files), model.name if model else group[0].name, model.size_bytes if model else 0
        )
        submitted = submit_matrix(
            session,
            store,
            settings,
            dispatcher,
            files,
            [entry.spec for entry in group],
            toolchain,
            describe_model=functools.partial(_same, info),
            submitter=submitter,
            refuse_uncompilable=not settings.served,
        )
        for entry, (spec, outcome) in zip(group, submitted.results, strict=True):
            results.append(
                {
                    "name": entry.name,
                    "spec": spec.summary(),
                    "target": spec.target.name,
                    "cache_key": outcome.cache_key,
                    "outcome": outcome.outcome,
                    "job": outcome.job_id,
                    "reason": outcome.reason,
                }
            )
    return results


def _same(info: ModelInfo) -> ModelInfo:
    return info
