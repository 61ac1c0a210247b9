"""What the embedded backend starts before it is loaded, beside the model's hash: the compile
child of the job a `farm submit` is about to run (`sandbox.prestart_compile_child`) and the
model's copies into the store (`LocalStore.prestage`).

Kept apart from `farm.cli.backends.direct`, whose import (SQLAlchemy, the job service: about
0.4 s of CPU) neither need wait for: the copy of a new model is disk-bound and the longest
thing the submit waits for before its compile (bench/README.md "submit_overhead").
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator, Mapping
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from farm.core.config import Settings
from farm.core.errors import FarmError
from farm.core.spec import CompileSpec, Target

if TYPE_CHECKING:
    from farm.core.identity import ModelRef
    from farm.server.storage.local import LocalStore


def embedded_here(settings: Settings) -> bool:
    """Whether this process runs the embedded farm: neither served nor through an API, with
    farm[embedded] installed (without it `backend()` says what is missing)."""
    if settings.api_url or settings.served:
        return False
    return importlib.util.find_spec("sqlalchemy") is not None


def prestart_compile(settings: Settings, target: Target) -> bool:
    """The embedded farm: start the compile child for `target` now; whether it did
    (`discard_prestaged` ends it if no job took it)."""
    if not embedded_here(settings):
        return False
    try:
        from farm.server.jobs.sandbox import prestart_compile_child
    except ModuleNotFoundError:  # no farm[embedded]: `backend()` says so
        return False
    prestart_compile_child(target, settings.compile_user, settings.compile_launcher)
    return True


def compile_ahead(settings: Settings, spec: CompileSpec, files: Mapping[str, Path]) -> bool:
    """The embedded farm, for a model compiled as it is, whose copies into its local store
    `prestage_unhashed` started: give the compile child `prestart_compile` started the request
    of the job this submit will make for `spec`, reading `files` (by role) where they are, so
    that the compile runs beside the hash and the database layer's import. The job takes the
    child only if it asks for the very same (`sandbox.request_compile_ahead`). Whether the
    child was given it."""
    store = _local_store(settings)
    if store is None:  # only a local store's copy lets the job read in place
        return False
    from farm.core.identity import file_version
    from farm.server.jobs.limits import blob_size_limit
    from farm.server.jobs.sandbox import request_compile_ahead
    from farm.server.storage import BLOBS_FOLDER

    try:
        in_place = {role: (path, file_version(path)) for role, path in files.items()}
    except OSError:  # gone already: the hash says so
        return False
    model_bytes = sum(version[2] for _, version in in_place.values())  # its size
    max_blob_bytes = blob_size_limit(
        model_bytes,
        settings.max_blob_bytes,
        settings.max_blob_ratio,
        settings.blob_bytes_over_model,
    )
    return request_compile_ahead(
        spec,
        in_place,
        settings.resolved_compile_memory_bytes,
        max_blob_bytes,
        # As the child ends: its blob copied into the store and hashed, beside the command.
        on_blob=partial(store.adopt_ahead, BLOBS_FOLDER),
    )


def prestage_model(settings: Settings, ref: ModelRef, compiled_as_is: bool = False) -> bool:
    """The embedded farm: start copying the model's files into its store now, on threads,
    while the command goes on (`LocalStore.prestage`); the submit's `put_version` takes the
    copies, `discard_prestaged` deletes those it did not. `compiled_as_is`: the job's compile
    child reads these files (no stage first): where it may read them in place, their copies
    are written around the page cache. Whether it started them."""
    store = _local_store(settings)
    if store is None:
        return False
    from farm.server.storage import model_storage_key

    uncached = compiled_as_is and _compiled_in_place(settings, list(ref.files.values()))
    with _discarded_on_error():
        for role, version in ref.versions.items():
            key = model_storage_key(ref.identity[role])
            store.prestage(key, ref.files[role], version, uncached=uncached)
    return True


def prestage_unhashed(settings: Settings, files: list[Path], compiled_as_is: bool = False) -> bool:
    """The embedded farm: start copying model files into its store while they are hashed,
    before their keys are known (`LocalStore.prestage_unnamed`; `prestage_model` names them).
    `compiled_as_is`: as for `prestage_model`. Whether it started them."""
    store = _local_store(settings)
    if store is None:
        return False
    from farm.core.identity import file_version
    from farm.server.storage import MODELS_FOLDER

    uncached = compiled_as_is and _compiled_in_place(settings, files)
    with _discarded_on_error():
        for path in files:
            version = file_version(path)
            store.prestage_unnamed(MODELS_FOLDER, path, version, uncached=uncached)
    return True


def discard_prestaged() -> None:
    """End a compile child started ahead that no job took (`sandbox.prestart_compile_child`),
    and delete the copies into the store that the submit did not take: of the model's files
    (`prestage_model`) and of a blob compiled ahead (`compile_ahead`)."""
    from farm.server.jobs.sandbox import discard_prestarted
    from farm.server.storage.local import discard_prestaged as discard_copies

    try:
        discard_prestarted()  # first: a child's end may still be copying its blob in
    finally:
        discard_copies()


def _compiled_in_place(settings: Settings, paths: list[Path]) -> bool:
    """Whether the job's compile child may read all of `paths` where they are (one model's
    files are read in place all together or not at all): then their copies in the store are
    written around the page cache, and the child reads the user's files, in memory."""
    from farm.server.jobs.compile_user import compile_identity
    from farm.server.jobs.sandbox import readable_in_place

    try:
        identity = compile_identity(settings.compile_user, settings.compile_launcher)
    except FarmError:  # the job says why it cannot compile
        return False
    return all(readable_in_place(Path(path), identity) for path in paths)


def _local_store(settings: Settings) -> LocalStore | None:
    """The embedded farm's store when it is a local folder (the store copies can go to);
    None elsewhere, having loaded nothing of the server side when the farm is not embedded."""
    if not embedded_here(settings):
        return None
    from farm.server.storage import open_store, scheme_of
    from farm.server.storage.local import LocalStore

    if scheme_of(settings.resolved_storage_url) == "s3":  # not opened: a client each time
        return None
    store = open_store(settings.resolved_storage_url, settings)
    return store if isinstance(store, LocalStore) else None


@contextlib.contextmanager
def _discarded_on_error() -> Iterator[None]:
    """Copies started before an error (a file gone, an interrupt) are deleted: the caller
    learns of none of them."""
    try:
        yield
    except BaseException:
        discard_prestaged()
        raise
