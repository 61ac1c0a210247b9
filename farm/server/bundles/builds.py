"""Pipeline bundles in the served farm (docs/architecture.md §17): the `bundle_builds` and
`bundle_parts` rows, submit, status, and the reconciler's share.

A submit names a folder by its files (uploaded as model files), a target, the GenAI options and
the toolchain the edge runs. The farm checks the folder as the embedded farm does (the small
files read, the weights only by size), computes the bundle key itself, and plans the parts:
one `bundle_parts` row per part key (unique), so a part two bundles share compiles once. Each
new or failed part is queued and its id sent to the queue of its toolchain with `.with-genai`
(`farm.server.routing.bundle_queue`), `.large` when not every worker there has the memory it
needs; a part no live worker could hold is refused here, naming both figures. Workers claim a
part with a conditional UPDATE and a lease (`farm.server.bundles.served`); the last part to
finish publishes the signed manifest.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from farm.core.clock import now
from farm.core.config import Settings
from farm.core.errors import ModelMissing, NotInstalled, PipelineError, SpecError
from farm.core.hashing import sha256_file
from farm.core.pipelines import (
    GENAI_TOOLS,
    KINDS,
    GenAIOptions,
    PipelineFolder,
    bundle_key,
    compile_memory_bytes,
    context_length,
    detect,
    hf_pipeline,
    is_huggingface_folder,
    key_options,
)
from farm.core.spec import Target
from farm.server.bundles.parts import Part, plan_from_identity
from farm.server.bundles.storage import published
from farm.server.db.models import BundleBuild, BundleBuildPart, BundlePart
from farm.server.jobs.dispatch import Dispatcher
from farm.server.routing import bundle_queue, live_workers
from farm.server.storage import BlobStore, model_storage_key

log = logging.getLogger(__name__)

QUEUED, RUNNING, DONE, FAILED = "queued", "running", "done", "failed"
BUNDLE_PART_TASK = "farm.bundle_part"
"""The Celery task that compiles one part (`workers.tasks.bundle_part`); its argument: the
`bundle_parts` row id."""
READ_IN_FULL_BYTES = 16 << 20
"""At submit, folder files up to this size (configs, IR .xml, tokenizers) are read to check the
folder; larger ones (weights) only by their size."""
FLAGS = ("max_prompt_len", "min_response_len", "generate_hint", "prefill_hint", "cache_mode")
"""The GenAI options a submit may carry (`farm submit FOLDER` flags)."""


@dataclass(frozen=True)
class BundleRequest:
    """What a submitter asks for: the folder by its files, the target, the flags, and the
    toolchain part of the edges that will open it (`farm.genai.toolchain`)."""

    pipeline: str | None
    files: dict[str, str]
    target: str
    options: dict[str, Any] = field(default_factory=dict)
    toolchain: dict[str, str] = field(default_factory=dict)
    weightless: bool = False


# --- sending ---------------------------------------------------------------------------------


def check_sender(dispatcher: Dispatcher) -> None:
    """Refuse, before anything is recorded, a farm whose parts no worker could receive."""
    from farm.server.jobs.dispatch import CeleryDispatcher, StubDispatcher

    if not isinstance(dispatcher, (CeleryDispatcher, StubDispatcher)):
        raise NotInstalled(
            "this farm has no broker: pipeline bundles through the API need the served farm "
            "(FARM_BROKER_URL and farm workers with farm[genai]); the embedded farm compiles "
            "them with farm submit <folder> and no FARM_API_URL"
        )


def send_part(dispatcher: Dispatcher, part_id: int, queue: str) -> None:
    """Hand part `part_id` to `queue`'s workers through the broker (served mode only)."""
    from farm.server.jobs.dispatch import CeleryDispatcher, StubDispatcher

    check_sender(dispatcher)
    if isinstance(dispatcher, StubDispatcher):
        dispatcher.sent.append((-part_id, queue))  # rule tests: parts as negative ids
        return
    assert isinstance(dispatcher, CeleryDispatcher)
    from kombu.exceptions import OperationalError

    from farm.core.errors import BrokerUnavailable

    try:
        dispatcher.app.send_task(BUNDLE_PART_TASK, args=[part_id], queue=queue)
    except OperationalError as error:
        raise BrokerUnavailable(
            f"the broker (FARM_BROKER_URL) did not take bundle part {part_id}: {error}"
        ) from error


def record_sent(session: Session, part_ids: list[int]) -> None:
    """When these parts' messages were handed to the broker (`bundle_parts.sent_at`)."""
    if part_ids:
        session.execute(update(BundlePart).where(BundlePart.id.in_(part_ids)).values(sent_at=now()))
        session.commit()


# --- the folder, checked at submit -------------------------------------------------------------


def stage_folder(store: BlobStore, files: Mapping[str, str], dest: Path, *, full: bool) -> None:
    """Lay the folder's files out under `dest` from the store (`models/<sha256>`). `full`:
    every file's bytes (a worker compiling it); else the small files read and the others
    sparse files of their size (what `detect` and the memory estimate need)."""
    from farm.core.bundles import safe_path

    missing = []
    for path, sha in sorted(files.items()):
        if not safe_path(path):
            raise SpecError(f"bundle file path {path!r} is not a plain relative path")
        stored = store.stat(model_storage_key(sha))
        if stored is None:
            missing.append(sha)
            continue
        out = dest / path
        out.parent.mkdir(parents=True, exist_ok=True)
        if full or stored.size <= READ_IN_FULL_BYTES:
            _fetch_checked(store, sha, out, path)
        else:
            with open(out, "wb") as sparse:
                sparse.truncate(stored.size)
    if missing:
        raise ModelMissing(sorted(set(missing)))


def recognise(root: Path, kind: str | None) -> PipelineFolder:
    """The folder at `root` as a pipeline (or a Hugging Face folder to export), refused as
    `farm submit FOLDER` refuses it, naming the file."""
    if is_huggingface_folder(root):
        return hf_pipeline(root, kind)
    return detect(root, kind)


def genai_options(folder: PipelineFolder, target: Target, request: BundleRequest) -> GenAIOptions:
    unknown = sorted(set(request.options) - set(FLAGS))
    if unknown:
        raise SpecError(f"unknown pipeline option {', '.join(unknown)}; known: {', '.join(FLAGS)}")
    return GenAIOptions.create(
        folder.kind,
        target,
        **{name: request.options.get(name) for name in FLAGS},
        weightless=request.weightless,
        context_length=context_length(folder),
    )


def check_toolchain(toolchain: Mapping[str, str], target: Target) -> dict[str, str]:
    needed = [*GENAI_TOOLS, *([] if target.is_npu else ["runtime_requirements"])]
    absent = [name for name in needed if not toolchain.get(name)]
    if absent:
        raise SpecError(
            f"a bundle's toolchain names {', '.join(needed)}; this one lacks "
            f"{', '.join(absent)} (farm.genai.toolchain on the edge that opens it)"
        )
    extra = sorted(set(toolchain) - set(needed))
    if extra:
        raise SpecError(f"a bundle's toolchain for {target} has no {', '.join(extra)}")
    return {name: str(toolchain[name]) for name in needed}


def plan(
    folder: PipelineFolder,
    files: Mapping[str, str],
    options: GenAIOptions,
    toolchain: Mapping[str, str],
) -> list[Part]:
    """The parts of the bundle from the folder's digests (`plan_from_identity`: the weights are
    not here to hash, only their sizes), in the order to compile them."""
    return plan_from_identity(
        folder.kind,
        files,
        {path: local.stat().st_size for path, local in folder.files.items()},
        options.target,
        key_options(folder, options),
        toolchain,
        compile_memory_bytes(folder, options.target),
    )


# --- routing by memory -------------------------------------------------------------------------


def choose_queue(
    session: Session,
    settings: Settings,
    target: Target,
    toolchain: Mapping[str, str],
    needed: int,
) -> str:
    """The queue of a part that needs `needed` bytes to compile: its toolchain's genai queue
    when every live worker there has that memory, else `.large` (only workers with
    FARM_LARGE_WORKER_BYTES take it); refused when no live worker of the toolchain has it.
    With no live worker for the toolchain the plain queue (it waits, as jobs do)."""
    plain, large = bundle_queue(target, toolchain), bundle_queue(target, toolchain, large=True)
    workers = live_workers(session, settings.worker_heartbeat_seconds)
    takers = [w for w in workers if plain in (w.queues or [])]
    if not takers:
        return plain
    if all(w.memory_bytes >= needed for w in takers):
        return plain
    gib = 1 << 30
    biggest = max(takers, key=lambda w: w.memory_bytes)
    large_takers = [w for w in takers if large in (w.queues or []) and w.memory_bytes >= needed]
    if not large_takers:
        raise PipelineError(
            f"compiling this pipeline for {target} needs about {needed / gib:.1f} GiB; the "
            f"largest live worker for its toolchain ({biggest.name}) has "
            f"{biggest.memory_bytes / gib:.1f} GiB (FARM_WORKER_MEMORY_BYTES): add a worker "
            f"with more memory (at least FARM_LARGE_WORKER_BYTES, "
            f"{settings.large_worker_bytes / gib:.1f} GiB, to take .large queues)"
        )
    return large


# --- submit ----------------------------------------------------------------------------------


def submit(
    session: Session,
    store: BlobStore,
    settings: Settings,
    dispatcher: Dispatcher,
    request: BundleRequest,
    submitter: str | None = None,
) -> dict[str, Any]:
    """Check the folder, plan its parts, queue those not done (single flight per part key);
    the build's view. A published bundle is returned as it is: nothing is compiled again."""
    check_sender(dispatcher)
    if request.pipeline is not None and request.pipeline not in KINDS:
        raise SpecError(f"unknown pipeline {request.pipeline!r}; known: {', '.join(KINDS)}")
    if not request.files:
        raise SpecError("a bundle submit names its folder's files")
    target = Target.parse(request.target)
    toolchain = check_toolchain(request.toolchain, target)
    with tempfile.TemporaryDirectory(prefix="farm-bundle-submit-") as scratch:
        root = Path(scratch) / "folder"
        stage_folder(store, request.files, root, full=False)
        folder = recognise(root, request.pipeline)
        _check_digests(folder, request.files)
        options = genai_options(folder, target, request)
        key_opts = key_options(folder, options)
        key = bundle_key(folder.kind, request.files, target, key_opts, toolchain)
        parts = plan(folder, request.files, options, toolchain)
    build = _build_row(session, key)
    if build is not None and build.state == DONE and published(store, key) is not None:
        return build_view(session, build)
    queues = {
        p.key: choose_queue(session, settings, target, toolchain, p.memory_bytes) for p in parts
    }
    at = now()
    if build is None:
        build = BundleBuild(
            bundle_key=key,
            pipeline=folder.kind,
            files=dict(request.files),
            convert_task=folder.convert_task,
            target=target.name,
            options=key_opts,
            toolchain=toolchain,
            memory_bytes=max(p.memory_bytes for p in parts),
            state=QUEUED,
            submitter=submitter,
            created_at=at,
            updated_at=at,
        )
        session.add(build)
        try:
            session.commit()
        except IntegrityError:  # another submit inserted it first: use its row
            session.rollback()
            build = _build_row(session, key)
            assert build is not None
    elif build.state == FAILED or (build.state == DONE and published(store, key) is None):
        build.state, build.error, build.finished_at = QUEUED, None, None
        build.submitter, build.updated_at = submitter, at
        session.commit()
    to_send = []
    for part in parts:
        row = _part_row(session, part, build, queues[part.key])
        if row.state in (QUEUED, FAILED) and (row.state == FAILED or row.sent_at is None):
            if row.state == FAILED:
                row.state, row.error, row.finished_at, row.queue = (
                    QUEUED,
                    None,
                    None,
                    queues[part.key],
                )
                row.attempts = 0
            to_send.append((row.id, row.queue))
        if session.get(BundleBuildPart, (build.id, row.id)) is None:
            session.add(BundleBuildPart(bundle_build_id=build.id, part_id=row.id))
        session.commit()
    if not to_send and all(p.state == DONE for p in parts_of(session, build.id)):
        # Every part done already (shared with a published bundle): one message to a part
        # makes a worker publish this one (the API holds no signing key).
        first = parts_of(session, build.id)[0]
        to_send.append((first.id, first.queue))
    sent = []
    try:
        for part_id, queue in to_send:
            send_part(dispatcher, part_id, queue)
            sent.append(part_id)
    finally:
        record_sent(session, sent)
    session.refresh(build)
    return build_view(session, build)


def submit_folder(
    session: Session,
    store: BlobStore,
    settings: Settings,
    dispatcher: Dispatcher,
    folder: PipelineFolder,
    options: GenAIOptions,
    submitter: str | None = None,
) -> dict[str, Any]:
    """`submit` from a folder on this host (`farm submit FOLDER` with the farm's database):
    its files stored as model files first."""
    from farm.core.pipelines import identity

    files = identity(folder)
    for path, sha in files.items():
        if not store.exists(model_storage_key(sha)):
            store.put_file(model_storage_key(sha), folder.files[path], expected_sha256=sha)
    values = options.canonical()
    from farm.genai import toolchain

    request = BundleRequest(
        pipeline=folder.kind,
        files=files,
        target=options.target.name,
        options={name: values[name] for name in FLAGS if name in values},
        toolchain=toolchain(options.target),
    )
    return submit(session, store, settings, dispatcher, request, submitter)


def _fetch_checked(store: BlobStore, sha: str, out: Path, path: str) -> None:
    """Copy `models/<sha>` to `out`, hashed as it arrives. Other bytes: read again, and when
    the stored file itself is corrupt it is deleted, so the next submit uploads it
    (`condemn_model_file`, as a compile's fetch does)."""
    from farm.server.jobs.model_cache import condemn_model_file, download_hashed

    key = model_storage_key(sha)
    if download_hashed(store, key, out) != sha:
        out.unlink(missing_ok=True)
        condemn_model_file(store, key, sha, f"the folder's {path}")


def _check_digests(folder: PipelineFolder, files: Mapping[str, str]) -> None:
    """The folder's files the submit names are those the pipeline reads (the key's files)."""
    expected = set(folder.files)
    named = set(files)
    if expected != named:
        extra, lacking = sorted(named - expected), sorted(expected - named)
        raise SpecError(
            "a bundle names exactly the files its pipeline reads; "
            + "; ".join(
                filter(
                    None,
                    [
                        f"not read by the pipeline: {', '.join(extra)}" if extra else "",
                        f"missing: {', '.join(lacking)}" if lacking else "",
                    ],
                )
            )
        )
    for path, local in folder.files.items():  # the small files were read: check them
        if local.stat().st_size <= READ_IN_FULL_BYTES and sha256_file(local) != files[path]:
            raise SpecError(f"{path}: its stored bytes do not have the digest named for it")


def _build_row(session: Session, key: str) -> BundleBuild | None:
    return session.scalar(
        select(BundleBuild)
        .where(BundleBuild.bundle_key == key)
        .execution_options(populate_existing=True)
    )


def _part_row(session: Session, part: Part, build: BundleBuild, queue: str) -> BundlePart:
    for _ in range(3):
        row = session.scalar(
            select(BundlePart)
            .where(BundlePart.part_key == part.key)
            .execution_options(populate_existing=True)
        )
        if row is not None:
            return row
        row = BundlePart(
            part_key=part.key,
            name=part.name,
            bundle_build_id=build.id,
            queue=queue,
            memory_bytes=part.memory_bytes,
            state=QUEUED,
            attempts=0,
            created_at=now(),
        )
        session.add(row)
        try:
            session.commit()
            return row
        except IntegrityError:  # another submit inserted it first: read its row
            session.rollback()
    raise AssertionError(f"bundle part {part.key} could not be inserted or read")


def parts_of(session: Session, build_id: int) -> list[BundlePart]:
    return list(
        session.scalars(
            select(BundlePart)
            .join(BundleBuildPart, BundleBuildPart.part_id == BundlePart.id)
            .where(BundleBuildPart.bundle_build_id == build_id)
            .order_by(BundlePart.id)
            .execution_options(populate_existing=True)
        )
    )


def builds_of_part(session: Session, part_id: int) -> list[BundleBuild]:
    return list(
        session.scalars(
            select(BundleBuild)
            .join(BundleBuildPart, BundleBuildPart.bundle_build_id == BundleBuild.id)
            .where(BundleBuildPart.part_id == part_id)
            .order_by(BundleBuild.id)
            .execution_options(populate_existing=True)
        )
    )


# --- status ----------------------------------------------------------------------------------


def find(session: Session, key: str) -> BundleBuild | None:
    return _build_row(session, key)


def build_view(session: Session, build: BundleBuild) -> dict[str, Any]:
    """A bundle as `GET /v1/bundles/{key}/build` and `farm status KEY` see it."""
    return {
        "bundle_key": build.bundle_key,
        "pipeline": build.pipeline,
        "target": build.target,
        "options": build.options,
        "toolchain": build.toolchain,
        "state": build.state,
        "error": build.error,
        "memory_bytes": build.memory_bytes,
        "submitter": build.submitter,
        "created_at": build.created_at,
        "finished_at": build.finished_at,
        "parts": [
            {
                "name": p.name,
                "part_key": p.part_key,
                "state": p.state,
                "queue": p.queue,
                "worker": p.worker,
                "attempts": p.attempts,
                "memory_bytes": p.memory_bytes,
                "seconds": p.seconds,
                "error": p.error,
            }
            for p in parts_of(session, build.id)
        ],
    }


PULL_RECORD_SECONDS = 3600
"""`bundle_builds.pulled_at` is written at most this often per bundle (gc counts days)."""


def record_pull(session: Session, key: str) -> None:
    """An edge fetched bundle `key`'s manifest: keep `pulled_at` within the hour."""
    at = now()
    session.execute(
        update(BundleBuild)
        .where(
            BundleBuild.bundle_key == key,
            or_(
                BundleBuild.pulled_at.is_(None),
                BundleBuild.pulled_at < at - timedelta(seconds=PULL_RECORD_SECONDS),
            ),
        )
        .values(pulled_at=at)
    )
    session.commit()


def not_published(session: Session, key: str) -> str:
    """Why `bundles/<key>.json` is absent, for a 404 that says what to do."""
    build = _build_row(session, key)
    if build is None:
        return f"no bundle {key}; compile it with farm submit <folder> first"
    if build.state == FAILED:
        return f"bundle {key} failed: {build.error}"
    return f"bundle {key} is {build.state}; its parts are compiling (farm status {key})"


# --- failure, and the reconciler -------------------------------------------------------------


def fail_builds(session: Session, part: BundlePart, reason: str) -> None:
    """The bundles of a failed part fail with its reason (committed by the caller)."""
    at = now()
    for build in builds_of_part(session, part.id):
        if build.state in (QUEUED, RUNNING):
            build.state, build.finished_at, build.updated_at = FAILED, at, at
            build.error = f"part {part.name} ({part.part_key[:12]}): {reason}"[:4000]
