"""Queues per target and toolchain, and the registry of workers that serve them (the `workers`
table).

A blob is keyed by the toolchain that will import it (its OpenVINO release; for CPU also the
runtime requirements string), and only a worker with that very toolchain produces a blob under
that key. So each target has one queue per toolchain class, `compile.<target>.<release>.<tag>`
(`tag`: 8 hex characters of the sha256 of the toolchain's key part), a job goes to the queue of
the toolchain it was submitted for, and a worker consumes only the queues of the toolchains it
has: a mixed pool (two OpenVINO releases, AVX2 and AVX-512 hosts) sends each job to a worker
that can compile it, and no worker takes a job it would refuse.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from farm.core.clock import now
from farm.core.hashing import canonical_json
from farm.core.spec import Target
from farm.core.vocabulary import EMBEDDED_QUEUE, JobState
from farm.server.db.models import Worker

MISSED_HEARTBEATS = 3
"""A worker silent for this many heartbeat intervals counts as gone."""


def toolchain_tag(part: Mapping[str, str]) -> str:
    """``2026.4.1.1a2b3c4d``: the release, then 8 hex of the sha256 of the whole key part."""
    digest = hashlib.sha256(canonical_json(dict(part))).hexdigest()[:8]
    return f"{part['openvino']}.{digest}"


NEEDS_PREFIX = ".with-"


def queue_name(
    target: str | Target,
    toolchain: Mapping[str, str],
    large: bool = False,
    needs: Iterable[str] = (),
) -> str:
    """``compile.npu.4000.2026.4.1.1a2b3c4d``; ``.large`` for big models; ``.with-torch`` (the
    converters a job's stages need, sorted, joined by ``+``). `toolchain`: the toolchain's key
    part for the target (`Toolchain.key_part`, what `jobs.toolchain` holds)."""
    target = target if isinstance(target, Target) else Target.parse(target)
    name = f"compile.{target.name.lower()}.{toolchain_tag(toolchain)}"
    if large:
        name = f"{name}.large"
    needed = sorted(set(needs))
    return f"{name}{NEEDS_PREFIX}{'+'.join(needed)}" if needed else name


def needs_of(queue: str) -> list[str]:
    """The converters a queue's jobs need (its ``.with-`` suffix)."""
    _, found, needs = queue.partition(NEEDS_PREFIX)
    return needs.split("+") if found else []


def worker_queues(
    toolchains: Mapping[str, Mapping[str, str]],
    memory_bytes: int,
    large_worker_bytes: int,
    converters: Iterable[str] = (),
) -> list[str]:
    """The queues a worker consumes: for each target it compiles (target → its toolchain's key
    part), the queue of that toolchain, plus the `.large` ones if it has the memory; each also
    for every combination of the converters it has."""
    have = sorted(set(converters))
    combos = [
        list(combo) for size in range(len(have) + 1) for combo in itertools.combinations(have, size)
    ]
    sizes = [False, True] if memory_bytes >= large_worker_bytes else [False]
    return [
        queue_name(t, part, large=large, needs=combo)
        for large in sizes
        for combo in combos
        for t, part in toolchains.items()
    ]


GENAI_CONVERTER = "genai"
"""What a worker reports among its converters when openvino-genai and openvino-tokenizers are
installed (`farm.converters.probe`): it compiles pipeline bundle parts (§17)."""


def bundle_queue(target: str | Target, toolchain: Mapping[str, str], large: bool = False) -> str:
    """The queue of a pipeline bundle's part: ``compile.cpu.<release>.<tag>[.large].with-genai``,
    where the tag hashes the bundle key's toolchain part (OpenVINO, GenAI and tokenizers
    releases, CPU runtime requirements): only a worker whose GenAI releases the edge runs
    consumes it."""
    return queue_name(target, toolchain, large=large, needs=[GENAI_CONVERTER])


def worker_bundle_queues(
    genai_toolchains: Mapping[str, Mapping[str, str]], memory_bytes: int, large_worker_bytes: int
) -> list[str]:
    """The bundle queues a worker with GenAI consumes: per target it compiles (target → the
    bundle key's toolchain part on this host, `farm.genai.toolchain`), the plain one, and the
    `.large` one with the memory for it."""
    sizes = [False, True] if memory_bytes >= large_worker_bytes else [False]
    return [
        bundle_queue(target, part, large)
        for large in sizes
        for target, part in genai_toolchains.items()
    ]


def register_worker(session: Session, **fields) -> None:
    at = now()
    row = session.get(Worker, fields["name"])
    if row is None:
        session.add(Worker(started_at=at, heartbeat_at=at, **fields))
    else:
        for key, value in fields.items():
            setattr(row, key, value)
        row.started_at = row.heartbeat_at = at
        row.stopped_at = None
    session.commit()


def heartbeat(session: Session, name: str) -> None:
    row = session.get(Worker, name)
    if row is not None:
        row.heartbeat_at = now()
        session.commit()


def mark_stopped(session: Session, name: str) -> None:
    row = session.get(Worker, name)
    if row is not None:
        row.stopped_at = now()
        session.commit()


def live_workers(session: Session, heartbeat_seconds: int) -> list[Worker]:
    since = now() - timedelta(seconds=heartbeat_seconds * MISSED_HEARTBEATS)
    query = select(Worker).where(Worker.heartbeat_at >= since, Worker.stopped_at.is_(None))
    return list(session.scalars(query.order_by(Worker.name)))


def all_workers(session: Session) -> list[Worker]:
    return list(session.scalars(select(Worker).order_by(Worker.heartbeat_at.desc())))


def workers_page(session: Session, limit: int, after: str | None = None) -> list[Worker]:
    """At most `limit` workers by name (a stable order: heartbeats move), after `after`."""
    query = select(Worker).order_by(Worker.name).limit(limit)
    if after is not None:
        query = query.where(Worker.name > after)
    return list(session.scalars(query))


def served_queues(session: Session, heartbeat_seconds: int) -> set[str]:
    """Every queue some live worker consumes: read once, for any number of jobs."""
    return {queue for w in live_workers(session, heartbeat_seconds) for queue in w.queues}


def is_served(session: Session, queue: str, heartbeat_seconds: int) -> bool:
    return queue in served_queues(session, heartbeat_seconds)


@dataclass(frozen=True)
class _Served:
    """What the live workers serve, read once for a page of jobs."""

    queues: set[str]
    npu_compiler: bool
    """Some live worker compiles for an NPU (has an NPU compiler)."""

    @classmethod
    def of(cls, workers: list[Worker]) -> _Served:
        queues = {queue for w in workers for queue in w.queues}
        npu = any(Target.parse(name).is_npu for w in workers for name in (w.toolchains or {}))
        return cls(queues, npu)


def waiting_notes(session: Session, jobs, heartbeat_seconds: int) -> dict[int, str | None]:
    """The note of each job of a page (None: nothing to say), with the workers read once (not
    once per job): a queued job that no live worker can take says so."""
    waiting = {j.id for j in jobs if j.state == JobState.QUEUED and j.queue != EMBEDDED_QUEUE}
    served = _Served.of(live_workers(session, heartbeat_seconds) if waiting else [])
    return {job.id: note_for(job, served) if job.id in waiting else None for job in jobs}


def note_for(job, served: _Served) -> str | None:
    """The note of a queued job given what the live workers serve: one the broker did not take
    (yet), one that no live worker can take, or both."""
    notes = [unsent_note(job.id) if job.sent_at is None else None, _no_taker_note(job, served)]
    return "; ".join(filter(None, notes)) or None


def unsent_note(job_id: int) -> str:
    """What a queued job not sent yet says: at submit, that the broker did not take it."""
    return (
        f"job {job_id} is recorded, but the broker (FARM_BROKER_URL) has not taken it: it will "
        "be sent when the broker is back (the reconciler sends it: a worker started with "
        "--beat, or `farm reconcile`)"
    )


def _no_taker_note(job, served: _Served) -> str | None:
    if job.queue in served.queues:
        return None
    if Target.parse(job.target).is_npu and not served.npu_compiler:
        return (
            f"no live worker has an NPU compiler, so none can compile for {job.target} (queue "
            f"{job.queue}): install one on a worker (farm toolchain install-npu-compiler); the "
            "job waits until such a worker starts (farm workers)"
        )
    needs = needs_of(job.queue)
    if needs:
        without = job.queue.partition(NEEDS_PREFIX)[0]
        if any(queue.partition(NEEDS_PREFIX)[0] == without for queue in served.queues):
            from farm.converters import missing_message

            return (
                f"{missing_message(needs, 'any live worker')} (queue {job.queue}); the job waits "
                "until one starts (farm workers)"
            )
    return (
        f"no live worker has the toolchain {json.dumps(job.toolchain, sort_keys=True)} for "
        f"{job.target} (queue {job.queue}); the job waits until one starts (farm workers)"
    )
