"""Where the CLI's commands go: through the HTTP API (`FARM_API_URL` set) or straight to the
database and store (embedded, or an operator on the farm's network). Both implement `Backend`
and answer in the same dicts (`farm.server.views` shapes them, and the API returns them), so
each command prints one way whatever the mode.

`farm.cli` reaches `farm.server` only through `backends.direct` (an import contract), and
imports it only when no API is configured: an edge install has no SQLAlchemy. The one other
door is `backends.ahead`: what an embedded `farm submit` starts beside the hash, before
`backends.direct` loads (the compile child, the model's store copies; no SQLAlchemy).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol

if TYPE_CHECKING:  # types only: a command that never submits need not load them
    from farm.core.config import Settings
    from farm.core.identity import ModelRef
    from farm.core.pipelines import GenAIOptions, PipelineFolder
    from farm.core.spec import CompileSpec, Toolchain

Advance = Callable[[int], None]
"""Reports bytes done to a progress bar."""


class SubmitProgress(Protocol):
    """How a submission shows its slow steps: uploads (HTTP) or compiles (embedded)."""

    def uploading(self, total_bytes: int) -> AbstractContextManager[Advance]: ...

    def compiling(self, what: str) -> AbstractContextManager[object]: ...


class Backend(Protocol):
    """What a CLI command asks of the farm, in either mode."""

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
        """`{"submission_id", "results": [{"cache_key", "target", "outcome", "job"}]}`.
        `rebuild`: replace the specs' quarantined blobs with new compiles. `reference_inputs`:
        an .npz the new jobs compute their reference outputs from. `extra_files`: files a
        stage reads besides the model (calibration samples), by sha256, stored like model
        files. `max_drift`: the bound the new jobs' compressed model must meet (§15)."""
        ...

    def submit_pipeline(self, folder: PipelineFolder, options: GenAIOptions) -> dict[str, Any]:
        """Compile a GenAI pipeline folder into a bundle (§17); its signed manifest."""
        ...

    def bundle_manifest(self, bundle_key: str) -> dict[str, Any]:
        """The signed manifest of a published bundle (`NotFound` if there is none)."""
        ...

    def open_bundle_file(self, sha256: str, offset: int) -> BinaryIO:
        """A bundle file's bytes from `offset` on."""
        ...

    def bundle_build(self, bundle_key: str) -> dict[str, Any] | None:
        """A bundle's build on the served farm (state, parts), or None (never asked for, or
        the embedded farm, which compiles bundles at submit)."""
        ...

    def job(self, job_id: int) -> dict[str, Any]: ...

    def stage(self, stage_key: str) -> dict[str, Any] | None:
        """A stage's record (docs §15), or None."""
        ...

    def download_stage_file(self, stage_key: str, role: str, dest: Path) -> None:
        """One output file (xml, bin) of a done stage to `dest`."""
        ...

    def jobs(self, limit: int = 50, **filters: Any) -> list[dict[str, Any]]:
        """Newest first, up to `limit`, read a page at a time."""
        ...

    def log(self, job_id: int) -> dict[str, Any]:
        """`{"id", "state", "log"}`."""
        ...

    def cancel(self, job_id: int) -> dict[str, Any]: ...

    def resolve(self, cache_key: str) -> dict[str, Any] | None: ...

    def cache_keys(self, prefix: str) -> list[str]:
        """Keys of blobs and jobs starting with `prefix` (a few: `farm.core.keyprefix`)."""
        ...

    def latest_job(self, cache_key: str) -> dict[str, Any] | None: ...

    def blobs(self, target: str | None, limit: int | None = None) -> list[dict[str, Any]]:
        """Newest first, up to `limit` (None: all), read a page at a time."""
        ...

    def workers(self) -> list[dict[str, Any]]: ...

    def download(
        self,
        cache_key: str,
        dest: Path,
        progress: Advance | None = None,
        max_bytes: int | None = None,
    ) -> Any:
        """Append the stored blob to `dest`, no longer than `max_bytes` (the edge agent
        verifies it)."""
        ...

    def report_pull(
        self,
        cache_key: str,
        agent_id: str,
        ok: bool,
        import_seconds: float | None = None,
        error: str | None = None,
    ) -> Any: ...

    def download_reference(self, cache_key: str, dest: Path, max_bytes: int) -> str | None:
        """Write the blob's reference outputs file to `dest`, no longer than `max_bytes`; its
        sha256 when computed on the way (the edge agent verifies it)."""
        ...

    def report_verification(self, cache_key: str, report: dict[str, Any]) -> dict[str, Any]:
        """`{"id", "passed", "quarantined"}` of an edge's verification report."""
        ...

    def verifications(self, cache_key: str, limit: int = 100) -> list[dict[str, Any]]: ...

    def quarantine(self, cache_key: str, reason: str) -> dict[str, Any]: ...

    def release(self, cache_key: str) -> dict[str, Any]: ...

    def delete_blob(self, cache_key: str) -> None:
        """Delete a quarantined blob (admin)."""
        ...

    # --- channels (docs/architecture.md §16) -------------------------------------------------

    def create_channel(self, name: str) -> dict[str, Any]: ...

    def channel(self, name: str, revision: int | None = None) -> dict[str, Any]:
        """The channel, its revisions (or only `revision`) and its last moves."""
        ...

    def set_channel(self, name: str, entries: list[dict[str, Any]]) -> dict[str, Any]:
        """A new revision running `entries` (`farm.core.channels.Entry.as_dict`)."""
        ...

    def promote_channel(
        self, name: str, revision: int, percent: int, force: bool = False
    ) -> dict[str, Any]: ...

    def rollback_channel(self, name: str) -> dict[str, Any]: ...

    def channel_document(self, name: str) -> dict[str, Any]:
        """`{document, signature, signing_key_id, certificate}`: what an edge verifies."""
        ...

    def report_channel_edge(self, name: str, report: dict[str, Any]) -> None: ...

    def channel_status(
        self, name: str, toolchain: dict[str, Any] | None = None
    ) -> dict[str, Any]: ...

    def prebuild(
        self, toolchain: dict[str, Any], channel: str | None, pulled_since_days: float | None
    ) -> list[dict[str, Any]]:
        """Submit what the fleet runs for `toolchain`: one result per model and spec."""
        ...

    def close(self) -> None: ...


def open_backend(settings: Settings) -> Backend:
    """The HTTP API when FARM_API_URL is set, else the database and store directly."""
    if settings.api_url:
        from farm.cli.backends.http import Http  # httpx: only when an API is configured

        return Http.from_settings(settings)
    # Only here: the direct backend needs farm[embedded] (SQLAlchemy, the compiler).
    from farm.cli.backends.direct import Direct

    return Direct.open(settings)
