"""The CLI straight on the database and store: the embedded farm (compiles here, now), or an
operator on the farm's network (queues jobs for workers, manages tokens, runs gc).

The one door from `farm.cli` into `farm.server` (an import contract): every command that needs
the server side goes through `Direct` or the functions at the end of this module.
"""

from __future__ import annotations

import contextlib
import getpass
import socket
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from farm.cli.backends import Advance, SubmitProgress
from farm.core.clock import now
from farm.core.errors import KeyFileError, NotFound
from farm.core.keyprefix import CANDIDATES_SHOWN
from farm.server import pagination
from farm.server.context import FarmContext
from farm.server.db.reads import Reads
from farm.server.db.session import database_errors, upgrade_database
from farm.server.pagination import MAX_PAGE
from farm.server.views import blob_dict, compression_dict, job_dict, verification_dict

# The read commands (`farm jobs`, `farm blobs`, `farm status`) read through SQLAlchemy Core
# (`Reads`); the ORM services, the doctor, gc, reconcile, resign, signing keys, tokens and
# verifications are imported inside the commands that use them: a read command loads only what
# it needs (bench/startup.py; tests/unit/test_cli_startup.py).
if TYPE_CHECKING:
    from farm.core.checks import Check
    from farm.core.config import Settings
    from farm.core.identity import ModelRef
    from farm.core.pipelines import GenAIOptions, PipelineFolder
    from farm.core.spec import CompileSpec, Toolchain
    from farm.server.blobs import gc, resign
    from farm.server.db.models import ApiToken
    from farm.server.jobs.dispatch import Dispatcher


class Direct:
    """Embedded (compiles here, now) or served without the API (queues for workers)."""

    reads_database = True
    """An edge agent on this source reads quarantines from the database itself: it needs no
    signed status (`farm.edge.agent_from_settings`)."""

    def __init__(self, farm: FarmContext) -> None:
        self.farm = farm
        self.reads = Reads(farm.engine, farm.settings.resolved_database_url)

    @classmethod
    def open(cls, settings: Settings) -> Direct:
        return cls(FarmContext.open(settings))

    @contextlib.contextmanager
    def _session(self) -> Iterator[Any]:
        with self.farm.session() as session:
            yield session

    # --- jobs --------------------------------------------------------------------------------

    def submit(
        self,
        ref: ModelRef,
        specs: list[CompileSpec],
        toolchain: Toolchain,
        progress: SubmitProgress,
        rebuild: bool = False,
        reference_inputs: Path | None = None,
        extra_files: Mapping[str, Path] | None = None,
        max_drift: str | None = None,
    ) -> dict[str, Any]:
        from farm.core.hashing import sha256_file
        from farm.server.jobs import service as jobs
        from farm.server.storage import model_storage_key

        inputs_sha = None
        if reference_inputs is not None:  # stored like a model file, where the worker reads it
            inputs_sha = sha256_file(reference_inputs)
            self.farm.store.put_file(
                model_storage_key(inputs_sha), reference_inputs, expected_sha256=inputs_sha
            )
        for sha, path in (extra_files or {}).items():  # calibration samples, likewise
            if not self.farm.store.exists(model_storage_key(sha)):
                self.farm.store.put_file(model_storage_key(sha), path, expected_sha256=sha)

        dispatcher = self._dispatcher(progress, ref.name)
        try:
            with self._session() as session:
                submitted = jobs.submit_matrix(
                    session,
                    self.farm.store,
                    self.farm.settings,
                    dispatcher,
                    ref.identity,
                    specs,
                    toolchain,
                    describe_model=lambda: ref.info,
                    upload_from=ref,
                    refuse_uncompilable=not self.farm.settings.served,
                    reference_inputs=inputs_sha,
                    rebuild=rebuild,
                    max_drift=max_drift,
                    recipe=ref.recipe,
                )
        finally:
            dispatcher.close()
        return {
            "submission_id": submitted.submission_id,
            "results": [
                {
                    "cache_key": outcome.cache_key,
                    "target": spec.target.name,
                    "outcome": outcome.outcome,
                    "job": self.job(outcome.job_id) if outcome.job_id else None,
                    "reason": outcome.reason,
                }
                for spec, outcome in submitted.results
            ],
        }

    def _dispatcher(self, progress: SubmitProgress, model_name: str) -> Dispatcher:
        from farm.core.spec import CompileSpec
        from farm.server.jobs import service as jobs
        from farm.server.jobs.dispatch import InlineDispatcher

        if self.farm.settings.served:
            return self.farm.dispatcher()

        def run(job_id: int) -> None:
            with self._session() as session:
                job = jobs.get_job(session, job_id)
                spec = CompileSpec.from_canonical(job.target, job.spec)
            with progress.compiling(f"{model_name} for {spec.summary()}"):
                # The blob's reference run goes on in a process of its own: the command
                # returns when the blob is stored (docs §14).
                self.farm.run(job_id, detach_reference=True)

        return InlineDispatcher(run)

    # --- pipeline bundles (§17) -----------------------------------------------------------------

    def submit_pipeline(self, folder: PipelineFolder, options: GenAIOptions) -> dict[str, Any]:
        if self.farm.settings.served:  # workers compile its parts (§17)
            from farm.server.bundles import builds

            dispatcher = self.farm.dispatcher()
            try:
                with self._session() as session:
                    return builds.submit_folder(
                        session, self.farm.store, self.farm.settings, dispatcher, folder, options
                    )
            finally:
                dispatcher.close()
        from farm.core.pipelines import check_memory
        from farm.server.bundles import service as bundles  # GenAI: only for a pipeline

        check_memory(folder, options.target, self.farm.settings.resolved_compile_memory_bytes)
        signer = self.farm.signer
        if signer is None:
            raise KeyFileError("the embedded farm has no signing key to sign the bundle with")
        limits = self.farm.run_limits
        return bundles.build_bundle(
            self.farm.store,
            signer,
            folder,
            options,
            bundles.sandboxed(limits),
            self.farm.trusted_keys,
            bundles.sandboxed_check(limits),
        )

    def bundle_manifest(self, bundle_key: str) -> dict[str, Any]:
        from farm.server.bundles.storage import require

        return require(self.farm.store, bundle_key)

    def bundle_build(self, bundle_key: str) -> dict[str, Any] | None:
        from farm.server.bundles import builds

        with self._session() as session:
            build = builds.find(session, bundle_key)
            return None if build is None else builds.build_view(session, build)

    def open_bundle_file(self, sha256: str, offset: int) -> BinaryIO:
        from farm.server.bundles.storage import file_storage_key

        stream = self.farm.store.open_read(file_storage_key(sha256))
        stream.seek(offset)
        return stream

    def job(self, job_id: int) -> dict[str, Any]:
        row = self.reads.job(job_id)
        if row is None:
            raise NotFound(f"no job {job_id}")
        if not Reads.needs_routing(row):
            return self.reads.job_view(row)
        # A job queued for workers: its note weighs what the live workers serve (the ORM's).
        from farm.server.jobs import service as jobs
        from farm.server.views import job_view

        with self._session() as session:
            job = jobs.get_job(session, job_id)
            return job_view(session, job, self.farm.settings.worker_heartbeat_seconds)

    def jobs(self, limit: int = 50, **filters: Any) -> list[dict[str, Any]]:
        def page(size: int, cursor: str | None) -> tuple[list[dict[str, Any]], str | None]:
            return self.reads.jobs_page(size, cursor, **filters)

        return _pages(page, limit)

    def log(self, job_id: int) -> dict[str, Any]:
        from farm.server.jobs import service as jobs
        from farm.server.views import log_view

        with self._session() as session:
            return log_view(jobs.get_job(session, job_id))

    def cancel(self, job_id: int) -> dict[str, Any]:
        """An operator with the database's credentials may cancel any job, as an admin."""
        from farm.server.jobs import service as jobs

        with self._session() as session:
            return job_dict(jobs.cancel(session, job_id, by=_operator(), as_admin=True))

    def latest_job(self, cache_key: str) -> dict[str, Any] | None:
        return self.reads.latest_job(cache_key)

    def workers(self) -> list[dict[str, Any]]:
        from farm.server.views import workers_view

        heartbeat = self.farm.settings.worker_heartbeat_seconds

        def page(size: int, cursor: str | None) -> tuple[list[dict[str, Any]], str | None]:
            after = pagination.after_worker(cursor) if cursor else None
            with self._session() as session:
                rows = workers_view(session, heartbeat, size, after)
            following = pagination.worker_cursor(rows[-1]["name"]) if len(rows) == size else None
            return rows, following

        return _pages(page, None)

    # --- blobs (also the edge agent's source in embedded mode) ---------------------------------

    def resolve(self, cache_key: str) -> dict[str, Any] | None:
        found = self.reads.blob(cache_key)
        if found is None:
            return None
        row, shown = found
        if self._reference_run_lost(row):
            from farm.server.jobs import reconcile as reconciler

            with self._session() as session:
                reconciler.resend_lost_references(session, self.farm.settings)
        return {**shown, "status": _signed_status(row, self.farm.status_signer)}

    def _reference_run_lost(self, row: Any) -> bool:
        """The embedded farm runs no reconciler: a command that resolves a blob whose pending
        reference run is lost (its detached process died: the lease expired; or it never
        claimed the row) sends it again, as `farm reconcile` would. `farm verify --wait` asks
        again and again, so it does not wait for a run that will not come. The rule is
        `reference_run.pending_runs`'s, read here from the row: a read that finds nothing lost
        costs nothing more."""
        if row.reference_state != "pending" or self.farm.settings.served:
            return False
        at = now()
        if row.reference_lease_expires_at is not None:
            return bool(row.reference_lease_expires_at < at)
        resend_after = timedelta(seconds=self.farm.settings.resend_after_seconds)
        return bool(row.created_at < at - resend_after)

    def cache_keys(self, prefix: str) -> list[str]:
        return self.reads.cache_keys(prefix, CANDIDATES_SHOWN + 1)

    def blobs(self, target: str | None, limit: int | None = None) -> list[dict[str, Any]]:
        def page(size: int, cursor: str | None) -> tuple[list[dict[str, Any]], str | None]:
            return self.reads.blobs_page(target, size, cursor)

        return _pages(page, limit)

    def download(
        self,
        cache_key: str,
        dest: Path,
        progress: Advance | None = None,
        max_bytes: int | None = None,
    ) -> None:
        """Copy the stored blob to `dest` (the edge agent verifies it, its size included: the
        farm's own store is copied whole, `max_bytes` is checked after)."""
        from farm.server.blobs import service as blobs

        with self._session() as session:
            blob = blobs.resolve(session, cache_key)
            if blob is None:
                raise NotFound(f"the farm has no blob for cache key {cache_key}")
            storage_key = blob.storage_key
        self.farm.store.get_file(storage_key, dest)
        if progress:
            progress(dest.stat().st_size)

    def report_pull(
        self,
        cache_key: str,
        agent_id: str,
        ok: bool,
        import_seconds: float | None = None,
        error: str | None = None,
    ) -> None:
        from farm.server.blobs import service as blobs

        with self._session() as session:
            blobs.record_pull(session, cache_key, agent_id, ok, import_seconds, error)

    def stage(self, stage_key: str) -> dict[str, Any] | None:
        from farm.server.stages import catalog

        with self._session() as session:
            row = catalog.find(session, stage_key)
            return catalog.stage_view(row) if row is not None else None

    def download_stage_file(self, stage_key: str, role: str, dest: Path) -> None:
        """Copy one output file of a done stage to `dest` (the caller checks its sha256)."""
        from farm.server.stages import catalog
        from farm.server.storage import model_storage_key

        with self._session() as session:
            files = dict(catalog.require_done(session, stage_key).output_files or {})
        if role not in files:
            raise NotFound(f"stage {stage_key} has no output {role!r}")
        self.farm.store.get_file(model_storage_key(files[role]), dest)

    def download_reference(self, cache_key: str, dest: Path, max_bytes: int) -> None:
        """Copy the stored reference file to `dest` (the edge agent checks size and digest)."""
        from farm.server.blobs import service as blobs
        from farm.server.storage import reference_storage_key

        with self._session() as session:
            blob = blobs.require(session, cache_key)
            digest = blob.reference_sha256
            if digest is None:
                raise NotFound(f"blob {cache_key} has no reference outputs: {blob.reference_note}")
        self.farm.store.get_file(reference_storage_key(cache_key, digest), dest)

    def report_verification(self, cache_key: str, report: dict[str, Any]) -> dict[str, Any]:
        from farm.server.blobs import verifications

        fields = dict(report)
        with self._session() as session:
            row, quarantined = verifications.record_verification(
                session,
                cache_key,
                fields.pop("blob_sha256"),
                fields,
                self.farm.settings.quarantine_on_failure,
            )
            return {"id": row.id, "passed": row.passed, "quarantined": quarantined}

    def verifications(self, cache_key: str, limit: int = 100) -> list[dict[str, Any]]:
        from farm.server.blobs import verifications

        with self._session() as session:
            rows = verifications.verifications_of(session, cache_key, limit)
            return [verification_dict(row) for row in rows]

    def quarantine(self, cache_key: str, reason: str) -> dict[str, Any]:
        from farm.server.blobs import verifications

        with self._session() as session:
            blob = verifications.quarantine(session, cache_key, f"{reason} (by {_operator()})")
            return blob_dict(blob, compression_dict(session, blob))

    def release(self, cache_key: str) -> dict[str, Any]:
        from farm.server.blobs import verifications

        with self._session() as session:
            released = verifications.release(session, cache_key, _operator())
            return blob_dict(released, compression_dict(session, released))

    def delete_blob(self, cache_key: str) -> None:
        from farm.server.blobs.rebuild import delete_quarantined

        with self._session() as session:
            delete_quarantined(session, self.farm.store, cache_key, _operator())

    # --- channels --------------------------------------------------------------------------------

    def create_channel(self, name: str) -> dict[str, Any]:
        from farm.server.channels import service as channels
        from farm.server.channels import status as channel_status

        with self._session() as session:
            channel = channels.create(session, self.farm.api_signer, name, _operator())
            return channel_status.channel_dict(channel)

    def channel(self, name: str, revision: int | None = None) -> dict[str, Any]:
        from farm.server.channels import status as channel_status

        with self._session() as session:
            return channel_status.show(session, name, revision)

    def set_channel(self, name: str, entries: list[dict[str, Any]]) -> dict[str, Any]:
        from farm.core.channels import Entry
        from farm.server.channels import service as channels
        from farm.server.channels import status as channel_status

        parsed = [Entry.from_dict(entry) for entry in entries]
        with self._session() as session:
            channels.set_revision(session, self.farm.api_signer, name, parsed, _operator())
            return channel_status.show(session, name)

    def promote_channel(
        self, name: str, revision: int, percent: int, force: bool = False
    ) -> dict[str, Any]:
        from farm.server.channels import service as channels
        from farm.server.channels import status as channel_status

        with self._session() as session:
            channel = channels.promote(
                session,
                self.farm.api_signer,
                name,
                revision,
                percent,
                _operator(),
                min_verifications=self.farm.settings.channel_min_verifications,
                force=force,
            )
            return channel_status.channel_dict(channel)

    def rollback_channel(self, name: str) -> dict[str, Any]:
        from farm.server.channels import service as channels
        from farm.server.channels import status as channel_status

        with self._session() as session:
            channel = channels.rollback(session, self.farm.api_signer, name, _operator())
            return channel_status.channel_dict(channel)

    def channel_document(self, name: str) -> dict[str, Any]:
        from farm.server.channels import service as channels

        with self._session() as session:
            return channels.document_of(session, name, self.farm.api_signer)

    def report_channel_edge(self, name: str, report: dict[str, Any]) -> None:
        from farm.server.channels import service as channels

        fields = dict(report)
        with self._session() as session:
            channels.record_edge(session, name, fields.pop("agent_id"), fields)

    def channel_status(self, name: str, toolchain: dict[str, Any] | None = None) -> dict[str, Any]:
        from farm.core.spec import Toolchain
        from farm.server.channels import status as channel_status

        chain = Toolchain.from_json(toolchain) if toolchain is not None else None
        with self._session() as session:
            return channel_status.status(
                session, name, self.farm.settings.channel_min_verifications, chain
            )

    def prebuild(
        self, toolchain: dict[str, Any], channel: str | None, pulled_since_days: float | None
    ) -> list[dict[str, Any]]:
        from farm.core.spec import Toolchain
        from farm.server.channels import prebuild as prebuilds
        from farm.server.jobs.dispatch import InlineDispatcher

        chain = Toolchain.from_json(toolchain)
        served = self.farm.settings.served
        dispatcher = self.farm.dispatcher() if served else InlineDispatcher(self.farm.run)
        try:
            with self._session() as session:
                if channel is not None:
                    entries = prebuilds.channel_entries(session, channel)
                else:
                    entries = prebuilds.pulled_entries(session, pulled_since_days or 30)
                return prebuilds.prebuild(
                    session,
                    self.farm.store,
                    self.farm.settings,
                    dispatcher,
                    entries,
                    chain,
                    _operator(),
                )
        finally:
            dispatcher.close()

    # --- operators -----------------------------------------------------------------------------

    def reconcile(self) -> dict[str, Any]:
        """One reconciler pass; re-sends go to the broker (served) or nowhere (embedded jobs
        run in the command that submitted them)."""
        from farm.server.jobs import reconcile as reconciler

        dispatcher = self.farm.dispatcher() if self.farm.settings.served else None
        try:
            with self._session() as session:
                report = reconciler.reconcile(
                    session, self.farm.store, self.farm.settings, dispatcher
                )
                from farm.server.bundles.reconcile import reconcile_parts

                parts = reconcile_parts(session, self.farm.settings, dispatcher)
        finally:
            if dispatcher is not None:
                dispatcher.close()
        return {**asdict(report), "bundle_parts": asdict(parts)}

    def collect_garbage(
        self,
        unpulled_days: int,
        dry_run: bool,
        on_blob: Callable[[gc.Candidate], None] | None = None,
    ) -> gc.GcReport:
        """`farm gc`; `on_blob` is called with each blob as gc goes (the report then keeps
        only totals: constant memory however many there are)."""
        from farm.server.blobs import gc

        with self._session() as session:
            grace = self.farm.settings.model_grace_seconds
            return gc.collect(
                session, self.farm.store, unpulled_days, dry_run, grace, on_blob=on_blob
            )

    def resign_blobs(self, accept_unverified: bool) -> resign.ResignReport:
        """`farm keys resign`: every blob's manifest signed with this host's FARM_SIGNING_KEY,
        old signatures checked against FARM_TRUSTED_KEYS (farm/server/blobs/resign.py)."""
        from farm.core.signing import TrustedKeys
        from farm.server.blobs import resign

        signer = self.farm.signer
        if signer is None:
            raise KeyFileError("farm keys resign signs with the farm's key: set FARM_SIGNING_KEY")
        trusted = TrustedKeys.from_files(self.farm.settings.trusted_key_paths)
        return resign.resign(
            self.farm.session,
            self.farm.store,
            signer,
            trusted,
            accept_unverified,
            self.farm.settings.blob_part_bytes,
        )

    def create_token(self, name: str, role: str, expires_at: datetime | None) -> str:
        from farm.server import tokens

        with self._session() as session:
            return tokens.create_token(session, name, role, expires_at)

    def revoke_token(self, name: str) -> datetime:
        from farm.server import tokens

        with self._session() as session:
            return tokens.revoke_token(session, name)

    def list_tokens(self) -> list[ApiToken]:
        """Every token by id, read a page at a time."""
        from farm.server import tokens

        found: list[ApiToken] = []
        while True:
            with self._session() as session:
                after = found[-1].id if found else 0
                page = tokens.list_tokens(session, MAX_PAGE, after)
            found += page
            if len(page) < MAX_PAGE:
                return found

    def close(self) -> None:
        pass

    @property
    def embedded(self) -> bool:
        """Whether this process runs the farm's jobs itself (no broker)."""
        return not self.farm.settings.served

    def finish(self) -> None:
        """Close the database's connections (SQLite writes back its journal), for a process
        about to end without the interpreter's teardown (`farm submit`)."""
        self.farm.engine.dispose()


def _operator() -> str:
    """Who cancels through the database directly: the operator's login and host."""
    return f"{getpass.getuser()}@{socket.gethostname()}"


def _pages(
    page: Callable[[int, str | None], tuple[list[dict[str, Any]], str | None]],
    limit: int | None,
) -> list[dict[str, Any]]:
    """Rows from `page(size, cursor)` calls, one short transaction each, until `limit` rows
    (None: all) or the last page: no query reads an unbounded result."""
    rows: list[dict[str, Any]] = []
    cursor: str | None = None
    while limit is None or len(rows) < limit:
        size = MAX_PAGE if limit is None else min(MAX_PAGE, limit - len(rows))
        found, cursor = page(size, cursor)
        rows += found
        if cursor is None:
            break
    return rows


def preload_submit() -> None:
    """Import what the embedded `farm submit` runs next (its job service and runner), ahead of
    the call (`farm.cli.hash_ahead`: beside the model's hash)."""
    from farm.server.jobs import runner, service  # noqa: F401


def upgrade_schema(settings: Settings) -> str | None:
    """Bring the database to the latest migration; returns the revision it is at."""
    url = settings.resolved_database_url
    with database_errors(url):
        return upgrade_database(url)


def farm_checks(settings: Settings) -> list[Check]:
    """`farm doctor` on the farm itself: the signing key, and each service."""
    from farm.server import doctor

    return [doctor.signing_check(settings), *doctor.service_checks(settings)]


def run_worker(settings: Settings, **options: Any) -> None:
    """Start a Celery compile worker in this process (returns when it shuts down)."""
    from farm.workers.main import run_worker as start  # loads Celery: only `farm worker` needs it

    start(settings, **options)


def serve_api(host: str, port: int, processes: int, settings: Settings) -> None:
    """Serve the HTTP API with uvicorn (the app is built in each worker process), with
    deadlines for slow clients: request heads (`HeadTimeoutProtocol`), idle keep-alive
    connections here, and bodies in the app (`BodyLimit`). farm's own log lines go where
    uvicorn's go, in its format."""
    import copy

    import uvicorn  # only `farm api` needs the server
    from uvicorn.config import LOGGING_CONFIG

    from farm.server.api.timeouts import HeadTimeoutProtocol

    log_config = copy.deepcopy(LOGGING_CONFIG)
    log_config["loggers"]["farm"] = {"handlers": ["default"], "level": "INFO", "propagate": False}
    uvicorn.run(
        "farm.server.api.main:app",
        host=host,
        port=port,
        workers=processes,
        proxy_headers=True,
        log_level="info",
        log_config=log_config,
        http=HeadTimeoutProtocol,
        timeout_keep_alive=settings.api_keep_alive_seconds,
    )


def _signed_status(blob: Any, signer: Any) -> dict[str, Any] | None:
    """`signatures.signed_status`, imported only by the commands that sign (cryptography)."""
    from farm.server.blobs.signatures import signed_status

    return signed_status(blob, signer)
