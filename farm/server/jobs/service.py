"""The job rules: submit a matrix, cancel, find jobs. Shared by the CLI, the API and workers.

The database is the source of truth (docs/architecture.md §6). A submission is a hit (the blob
exists), the job already queued or running for that cache key (single flight, enforced by a
partial unique index), or a new queued job. New jobs are dispatched only after their rows are
committed, so a worker never receives the id of a row that was rolled back.
"""

from __future__ import annotations

import functools
import logging
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, defer

from farm.core import hashing, sources
from farm.core.clock import now
from farm.core.config import Settings
from farm.core.errors import Forbidden, ModelMissing, NotFound
from farm.core.identity import ModelInfo, ModelRef, key_for
from farm.core.spec import CompileSpec, Target, Toolchain
from farm.core.stages import Recipe, converters_needed, recipe_json, stage_keys
from farm.core.vocabulary import ACTIVE_STATES, EMBEDDED_QUEUE, JobState, Outcome
from farm.server import pagination, routing
from farm.server.blobs.rebuild import retire_quarantined
from farm.server.db.models import Blob, Job, Model
from farm.server.db.session import rows_changed
from farm.server.jobs.dispatch import Dispatcher, dispatch
from farm.server.storage import BlobStore, model_storage_key

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Submission:
    outcome: Outcome
    cache_key: str
    job_id: int | None = None
    reason: str | None = None
    """Why an `unavailable` spec was not submitted."""


def submit(
    session: Session,
    store: BlobStore,
    model: ModelInfo,
    spec: CompileSpec,
    toolchain: Toolchain,
    *,
    queue: str = EMBEDDED_QUEUE,
    submitter: str | None = None,
    submission_id: str | None = None,
    max_attempts: int | None = None,
    reference_inputs: str | None = None,
) -> Submission:
    """Return the hit, the active job for the same cache key, or a new queued job (committed).

    The caller sends a new job's message only after this commit (`submit_matrix`). A new job
    needs the model's files in the store: ModelMissing names those it lacks. `max_attempts`:
    claims the new job gets (`Settings.max_attempts`); None: the column's default.
    `reference_inputs`: sha256 of the submitter's reference inputs, stored like a model file
    (it must be in the store too); a hit ignores it (the blob keeps the reference it has).
    """
    known = known_outcome(session, model.identity, spec, toolchain, model.recipe)
    if known is not None:
        return known
    key = key_for(model.identity, spec, toolchain, model.recipe)
    needed = [*model.identity.values(), *([reference_inputs] if reference_inputs else [])]
    missing = missing_model_files(store, needed)
    if missing:
        raise ModelMissing(missing)
    model_row = register_model(session, model)
    job = Job(
        cache_key=key,
        model_id=model_row.id,
        target=spec.target.name,
        queue=queue,
        spec=spec.canonical(),
        toolchain=toolchain.key_part(spec.target),
        state=JobState.QUEUED,
        submitter=submitter,
        submission_id=submission_id,
        created_at=now(),
        reference_inputs=reference_inputs,
        recipe=recipe_json(model.recipe) if model.recipe else None,
        stage_key=stage_keys(model.identity, model.recipe)[-1] if model.recipe else None,
    )
    if max_attempts is not None:
        job.max_attempts = max_attempts
    session.add(job)
    try:
        session.commit()
    except IntegrityError:
        # Another submitter inserted the active job for this key between our check and our
        # insert; the partial unique index refused ours. Theirs is the job to follow.
        session.rollback()
        active = _active_job_id(session, key)
        if active is None:
            raise
        return Submission("existing", key, active)
    return Submission("queued", key, job.id)


def known_outcome(
    session: Session,
    identity: Mapping[str, str],
    spec: CompileSpec,
    toolchain: Toolchain,
    recipe: Recipe = (),
) -> Submission | None:
    """The hit, or the active job for the same cache key; None when a new job is needed.
    Reads only the database: what `submit` answers before it needs the store."""
    key = key_for(identity, spec, toolchain, recipe)
    if session.scalar(select(Blob.id).where(Blob.cache_key == key)) is not None:
        return Submission("hit", key)
    active = _active_job_id(session, key)
    if active is not None:
        return Submission("existing", key, active)
    return None


def missing_model_files(store: BlobStore, digests: Iterable[str]) -> list[str]:
    """The digests among `digests` whose files the store lacks."""
    return sorted({sha for sha in digests if not store.exists(model_storage_key(sha))})


def upload_model_files(store: BlobStore, model: ModelRef, only: Iterable[str] | None = None):
    """Upload the model's files (those in `only`, or all), each verified against its digest
    (or, where the store copies without reading, against the version it was hashed at)."""
    wanted = set(model.identity.values()) if only is None else set(only)
    for role, path in model.files.items():
        sha = model.identity[role]
        if sha not in wanted:
            continue
        if role in model.versions:
            store.put_version(model_storage_key(sha), path, sha, model.versions[role])
        else:
            store.put_file(model_storage_key(sha), path, expected_sha256=sha)


@dataclass(frozen=True)
class MatrixSubmission:
    """What `submit_matrix` answers: one `Submission` per spec, in the order given."""

    submission_id: str
    results: list[tuple[CompileSpec, Submission]]


def submit_matrix(
    session: Session,
    store: BlobStore,
    settings: Settings,
    dispatcher: Dispatcher,
    identity: Mapping[str, str],
    specs: Sequence[CompileSpec],
    toolchain: Toolchain,
    *,
    describe_model: Callable[[], ModelInfo],
    upload_from: ModelRef | None = None,
    submitter: str | None = None,
    refuse_uncompilable: bool = False,
    reference_inputs: str | None = None,
    rebuild: bool = False,
    recipe: Recipe = (),
) -> MatrixSubmission:
    """Submit one model for every spec of a matrix: the one submit use case of the farm.

    Per spec: the hit or the active job (read from the database only), or a new job on the
    queue its target and model size route it to. Every new row is committed before any job is
    dispatched. `describe_model` (name, digests, size) is called only when a job is to be
    created, at most once: a hit asks the store nothing. `upload_from`: the model's files on
    this host, uploaded when the store lacks them (the direct CLI); without it a new job whose
    files the store lacks raises ModelMissing (the API answers 409 and the client uploads).
    `refuse_uncompilable`: an embedded farm (its CLI and its API) compiles on this host only,
    so a spec that would need a new job for a target (or toolchain) this host cannot compile is
    answered `unavailable` with the reason, and no job is recorded for it; the other specs of
    the matrix go on (a hit stays a hit: nothing needs compiling).
    `reference_inputs`: the sha256 of the submitter's reference inputs, for every new job.
    `rebuild`: first retire the specs' quarantined blobs (`blobs.rebuild`), those this farm
    can compile again (an embedded farm never deletes a blob it could not replace).
    `recipe`: the stages run on the model before its compile (docs §15); `describe_model`'s
    answer carries the same recipe.
    """
    submission_id = uuid.uuid4().hex
    if rebuild:
        compilable = [
            spec
            for spec in specs
            if not (refuse_uncompilable and _cannot_compile_here(spec.target, toolchain))
        ]
        retire_quarantined(session, store, identity, compilable, toolchain)
    known = [known_outcome(session, identity, spec, toolchain, recipe) for spec in specs]
    if refuse_uncompilable:
        for index, (spec, outcome) in enumerate(zip(specs, known, strict=True)):
            reason = None
            if outcome is None:
                reason = _cannot_compile_here(spec.target, toolchain) or _cannot_convert_here(
                    recipe
                )
            if reason:
                key = key_for(identity, spec, toolchain, recipe)
                known[index] = Submission("unavailable", key, reason=reason)
    results: list[tuple[CompileSpec, Submission]] = []
    to_send: list[tuple[int, str]] = []
    model: ModelInfo | None = None
    for spec, outcome in zip(specs, known, strict=True):
        if outcome is None:
            model = model or describe_model()
            queue = route(settings, spec.target, model.size_bytes, toolchain, recipe)
            new = functools.partial(
                submit,
                session,
                store,
                model,
                spec,
                toolchain,
                queue=queue,
                submitter=submitter,
                submission_id=submission_id,
                max_attempts=settings.max_attempts,
                reference_inputs=reference_inputs,
            )
            try:
                outcome = new()
            except ModelMissing as missing:
                if upload_from is None:
                    raise
                upload_model_files(store, upload_from, missing.missing)
                outcome = new()
            if outcome.outcome == "queued":
                assert outcome.job_id is not None
                to_send.append((outcome.job_id, queue))
        results.append((spec, outcome))
    for job_id, queue in to_send:
        dispatch(session, dispatcher, job_id, queue)
    return MatrixSubmission(submission_id, results)


def _cannot_compile_here(target: Target, toolchain: Toolchain) -> str | None:
    """Why this host cannot make the blob a submission for `toolchain` asks for, or None."""
    from farm import toolchain as host  # OpenVINO: only to submit, never to list or show

    reason = host.unavailable_reason(target)
    if reason:
        return reason
    here, wanted = host.host_toolchain(target).key_part(target), toolchain.key_part(target)
    if here != wanted:
        return (
            f"this host's toolchain for {target} is {here}, but the submission asks for "
            f"{wanted} (--toolchain): submit it to a farm with a worker that has it"
        )
    return None


def _cannot_convert_here(recipe: Recipe) -> str | None:
    """Why this host cannot run the recipe's stages (a converter it lacks), or None."""
    from farm import converters  # the frameworks' metadata only: nothing imported

    missing = converters.missing(converters_needed(recipe))
    return converters.missing_message(missing, "this host") if missing else None


def route(
    settings: Settings,
    target: Target,
    model_bytes: int,
    toolchain: Toolchain,
    recipe: Recipe = (),
) -> str:
    """The queue of a new job: its target's and toolchain's (`routing`), `.large` for big
    models, and the converters its recipe needs; embedded: no broker."""
    if not settings.served:
        return EMBEDDED_QUEUE
    large = model_bytes > settings.large_model_bytes
    return routing.queue_name(
        target, toolchain.key_part(target), large, needs=converters_needed(recipe)
    )


def register_model(session: Session, model: ModelInfo) -> Model:
    """The model's row, created on first sight."""
    digest = hashing.model_digest(model.identity)
    row = session.scalar(select(Model).where(Model.digest == digest))
    if row is not None:
        return row
    row = Model(
        digest=digest,
        format=sources.format_of(model.identity),
        files=dict(model.identity),
        size_bytes=model.size_bytes,
        name=model.name,
        created_at=now(),
    )
    try:
        with session.begin_nested():
            session.add(row)
    except IntegrityError:
        # Same model registered concurrently: use the row that won.
        return session.scalars(select(Model).where(Model.digest == digest)).one()
    return row


def cancel(session: Session, job_id: int, *, by: str, as_admin: bool) -> Job:
    """Cancel a job: a queued one never starts; a running one is stopped by its worker.

    Only the job's submitter (`by`, a token's name) or an admin may: a submitter who joined
    the job by single flight (submitted the same key while it was active) did not start it,
    and cannot stop it for the one who did. `by` is recorded in `jobs.cancelled_by`.
    """
    job = get_job(session, job_id)
    if not as_admin and (job.submitter is None or job.submitter != by):
        owner = f"token {job.submitter!r}" if job.submitter else "an operator"
        raise Forbidden(
            f"job {job_id} was submitted by {owner}; only its submitter or an admin token "
            f"may cancel it ({by!r} may not)"
        )
    dropped = rows_changed(
        session,
        update(Job)
        .where(Job.id == job_id, Job.state == JobState.QUEUED)
        .values(
            state=JobState.CANCELLED,
            cancel_requested=True,
            cancelled_by=by,
            finished_at=now(),
            error="cancelled before it started",
        ),
    )
    if dropped == 0:  # running (perhaps claimed a moment ago) or already finished
        session.execute(
            update(Job)
            .where(Job.id == job_id, Job.state == JobState.RUNNING)
            .values(cancel_requested=True, cancelled_by=by)
        )
    session.commit()
    session.refresh(job)
    return job


def get_job(session: Session, job_id: int) -> Job:
    job = session.get(Job, job_id)
    if job is None:
        raise NotFound(f"no job {job_id}")
    return job


def latest_job_for_key(session: Session, cache_key: str) -> Job | None:
    return session.scalar(
        select(Job).where(Job.cache_key == cache_key).order_by(Job.id.desc()).limit(1)
    )


def list_jobs(
    session: Session,
    state: str | None = None,
    target: str | None = None,
    limit: int = 50,
    *,
    model: str | None = None,
    submitter: str | None = None,
    since: datetime | None = None,
    cache_key: str | None = None,
    cursor: str | None = None,
) -> list[Job]:
    """Newest first, at most `limit`. `model` is a model digest or a model's file name; a
    `since` without a time zone is UTC; `cursor` (`pagination.job_cursor` of the last job of
    the page before) continues after that job."""
    # A list never shows the compiler's log, which may be megabytes a job: not read at all.
    query = select(Job).options(defer(Job.log)).order_by(Job.id.desc()).limit(limit)
    if cursor:
        query = query.where(Job.id < pagination.after_job(cursor))
    if state:
        query = query.where(Job.state == state)
    if target:
        query = query.where(Job.target == Target.parse(target).name)
    if model:
        query = query.join(Model, Model.id == Job.model_id).where(
            (Model.digest == model) | (Model.name == model)
        )
    if submitter:
        query = query.where(Job.submitter == submitter)
    if since:
        if since.tzinfo is None:
            since = since.replace(tzinfo=UTC)
        query = query.where(Job.created_at >= since)
    if cache_key:
        query = query.where(Job.cache_key == cache_key)
    return list(session.scalars(query))


def _active_job_id(session: Session, key: str) -> int | None:
    return session.scalar(select(Job.id).where(Job.cache_key == key, Job.state.in_(ACTIVE_STATES)))
