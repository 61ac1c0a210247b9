"""The CLI through the farm API: the submitter holds no database, broker or S3 credentials."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, cast

from farm.cli.backends import Advance, SubmitProgress
from farm.client import FarmClient
from farm.core.errors import ApiError

if TYPE_CHECKING:  # types only: listing loads nothing of a submission
    from farm.core.config import Settings
    from farm.core.identity import ModelRef
    from farm.core.pipelines import GenAIOptions, PipelineFolder
    from farm.core.signing import Parts
    from farm.core.spec import CompileSpec, Toolchain

BUNDLE_FLAGS = ("max_prompt_len", "min_response_len", "generate_hint", "prefill_hint", "cache_mode")
"""The GenAI options a bundle submit carries (the API canonicalizes them again)."""


class Http:
    def __init__(self, client: FarmClient) -> None:
        self.client = client

    @classmethod
    def from_settings(cls, settings: Settings) -> Http:
        assert settings.api_url
        return cls(FarmClient(settings.api_url, settings.token))

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
        return self.client.submit_model(
            ref,
            specs,
            toolchain,
            progress.uploading,
            rebuild,
            reference_inputs,
            extra_files=extra_files,
            max_drift=max_drift,
        )

    def submit_pipeline(self, folder: PipelineFolder, options: GenAIOptions) -> dict[str, Any]:
        """Upload the folder's files the farm lacks and queue its bundle (§17); the build (its
        state and parts), not the manifest: workers compile it."""
        from farm.core.pipelines import identity
        from farm.genai import toolchain

        files = {path: (sha, folder.files[path]) for path, sha in identity(folder).items()}
        values = options.canonical()
        body = {
            "pipeline": folder.kind,
            "target": options.target.name,
            "options": {name: values[name] for name in BUNDLE_FLAGS if name in values},
            "toolchain": toolchain(options.target),
        }
        return self.client.submit_bundle(files, body)

    def bundle_manifest(self, bundle_key: str) -> dict[str, Any]:
        return self.client.bundle_manifest(bundle_key)

    def bundle_build(self, bundle_key: str) -> dict[str, Any] | None:
        return self.client.bundle_build(bundle_key)

    def open_bundle_file(self, sha256: str, offset: int) -> BinaryIO:
        return cast(BinaryIO, self.client.open_bundle_file(sha256, offset))

    def job(self, job_id: int) -> dict[str, Any]:
        return self.client.job(job_id)

    def jobs(self, limit: int = 50, **filters: Any) -> list[dict[str, Any]]:
        since = filters.get("since")
        if since is not None:
            filters["since"] = since.isoformat()
        return self.client.jobs(limit, **filters)

    def log(self, job_id: int) -> dict[str, Any]:
        return self.client.job_log(job_id)

    def cancel(self, job_id: int) -> dict[str, Any]:
        return self.client.cancel(job_id)

    def resolve(self, cache_key: str) -> dict[str, Any] | None:
        return self.client.resolve(cache_key)

    def cache_keys(self, prefix: str) -> list[str]:
        return self.client.cache_keys(prefix)

    def latest_job(self, cache_key: str) -> dict[str, Any] | None:
        """None also for a pull token, which may not read jobs: `farm status` on an edge
        shows the blob."""
        try:
            jobs = self.client.jobs(cache_key=cache_key, limit=1)
        except ApiError as error:
            if error.status != 403:
                raise
            return None
        return jobs[0] if jobs else None

    def blobs(self, target: str | None, limit: int | None = None) -> list[dict[str, Any]]:
        return self.client.blobs(target, limit)

    def workers(self) -> list[dict[str, Any]]:
        return self.client.workers()

    def download(
        self,
        cache_key: str,
        dest: Path,
        progress: Advance | None = None,
        max_bytes: int | None = None,
    ) -> Any:
        return self.client.download(cache_key, dest, progress, max_bytes)

    def download_parts(
        self, cache_key: str, dest: Path, size: int, parts: Parts, progress: Advance | None = None
    ) -> bool:
        return self.client.download_parts(cache_key, dest, size, parts, progress)

    def report_pull(
        self,
        cache_key: str,
        agent_id: str,
        ok: bool,
        import_seconds: float | None = None,
        error: str | None = None,
    ) -> Any:
        return self.client.report_pull(cache_key, agent_id, ok, import_seconds, error)

    def download_reference(self, cache_key: str, dest: Path, max_bytes: int) -> str | None:
        return self.client.download_reference(cache_key, dest, max_bytes)

    def stage(self, stage_key: str) -> dict[str, Any] | None:
        return self.client.stage(stage_key)

    def download_stage_file(self, stage_key: str, role: str, dest: Path) -> None:
        self.client.download_stage_file(stage_key, role, dest)

    def report_verification(self, cache_key: str, report: dict[str, Any]) -> dict[str, Any]:
        return self.client.report_verification(cache_key, report)

    def verifications(self, cache_key: str, limit: int = 100) -> list[dict[str, Any]]:
        return self.client.verifications(cache_key, limit)

    def quarantine(self, cache_key: str, reason: str) -> dict[str, Any]:
        return self.client.quarantine(cache_key, reason)

    def release(self, cache_key: str) -> dict[str, Any]:
        return self.client.release(cache_key)

    def delete_blob(self, cache_key: str) -> None:
        self.client.delete_blob(cache_key)

    def create_channel(self, name: str) -> dict[str, Any]:
        return self.client.create_channel(name)

    def channel(self, name: str, revision: int | None = None) -> dict[str, Any]:
        return self.client.channel(name, revision)

    def set_channel(self, name: str, entries: list[dict[str, Any]]) -> dict[str, Any]:
        return self.client.set_channel(name, entries)

    def promote_channel(
        self, name: str, revision: int, percent: int, force: bool = False
    ) -> dict[str, Any]:
        return self.client.promote_channel(name, revision, percent, force)

    def rollback_channel(self, name: str) -> dict[str, Any]:
        return self.client.rollback_channel(name)

    def channel_document(self, name: str) -> dict[str, Any]:
        return self.client.channel_document(name)

    def report_channel_edge(self, name: str, report: dict[str, Any]) -> None:
        self.client.report_channel_edge(name, report)

    def channel_status(self, name: str, toolchain: dict[str, Any] | None = None) -> dict[str, Any]:
        return self.client.channel_status(name, toolchain)

    def prebuild(
        self, toolchain: dict[str, Any], channel: str | None, pulled_since_days: float | None
    ) -> list[dict[str, Any]]:
        return self.client.prebuild(toolchain, channel, pulled_since_days)

    def close(self) -> None:
        self.client.close()
