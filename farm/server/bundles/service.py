"""Build and publish a pipeline bundle: compile, store every file once (content-addressed, so a
tokenizer or VAE shared by two bundles is stored once), sign the manifest, store it last (a
bundle is visible only when all its files are)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from farm.core.bundles import BundleFile, BundleManifest, sign
from farm.core.errors import PipelineError
from farm.core.pipelines import (
    GenAIOptions,
    PipelineFolder,
    bundle_key,
    context_length,
    folder_key,
    identity,
    key_options,
)
from farm.core.signing import Signer, TrustedKeys
from farm.core.spec import Target
from farm.genai import toolchain
from farm.server.bundles import parts
from farm.server.bundles.parts import PartCompile
from farm.server.bundles.storage import file_storage_key, manifest_storage_key, published
from farm.server.jobs.runner import RunLimits
from farm.server.storage import BlobStore


def key_of(folder: PipelineFolder, options: GenAIOptions) -> str:
    """The bundle key of `folder` compiled with `options` by this host's releases."""
    return folder_key(folder, options, toolchain(options.target))


def options_for(folder: PipelineFolder, target: Target, **flags: Any) -> GenAIOptions:
    """The canonical options of the flags, checked against the model's context length."""
    return GenAIOptions.create(folder.kind, target, context_length=context_length(folder), **flags)


Compile = PartCompile
"""Compiles one part of a folder into a work folder: in this process (tests, benchmarks), or in
the sandboxed child with the farm's limits (`sandboxed`)."""
in_process = parts.in_process


def sandboxed(limits: RunLimits) -> Compile:
    """Compile each part in a child with the compile's limits (time, memory, user, environment)."""
    return parts.sandboxed_part(limits)


check_in_process = parts.check_in_process


def sandboxed_check(limits: RunLimits) -> parts.AssembledCheck:
    """Open a pipeline of sub-model parts whole in a child with the compile's limits."""
    return parts.sandboxed_check(limits)


def build_bundle(
    store: BlobStore,
    signer: Signer,
    folder: PipelineFolder,
    options: GenAIOptions,
    compile: Compile = in_process,
    trusted: TrustedKeys | None = None,
    check: parts.AssembledCheck = check_in_process,
) -> dict[str, Any]:
    """Compile `folder`, upload what the edge needs and the signed manifest; the signed
    manifest. An existing bundle is returned as it is (compiled once); so is a part whose
    listing `signer` or one of `trusted` signed. `check`: where a pipeline of sub-model parts
    is opened whole at the end (`parts.check_parts`)."""
    files = identity(folder)
    key = bundle_key(
        folder.kind, files, options.target, key_options(folder, options), toolchain(options.target)
    )
    existing = published(store, key)
    if existing is not None:
        return existing
    # Each part compiles once: a part another bundle compiled (the same VAE) is reused.
    built = parts.build_parts(
        store, folder, options, toolchain(options.target), signer, compile, files, trusted, check
    )
    # A Hugging Face folder ships its exported pipeline folder (among the outputs), not
    # itself; an OpenVINO pipeline folder ships its own files beside the compiled ones.
    shipped = {} if folder.convert_task else files
    entries = [
        BundleFile(path, shipped[path], folder.files[path].stat().st_size)
        for path in sorted(shipped)
    ]
    for entry in entries:
        storage_key = file_storage_key(entry.sha256)
        if not store.exists(storage_key):
            store.put_file(storage_key, folder.files[entry.path], expected_sha256=entry.sha256)
    for entry in built.files:
        if entry.path in shipped:
            raise PipelineError(f"{folder.root / entry.path}: a compiled output has this name")
    manifest = BundleManifest(
        bundle_key=key,
        pipeline=folder.kind,
        target=options.target.name,
        options=options.canonical(),
        toolchain=toolchain(options.target),
        files=tuple(entries + built.files),
        reference=built.reference,
    )
    signed = sign(manifest, signer)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as out:
        json.dump(signed, out)
    try:
        store.put_file(manifest_storage_key(key), out.name)
    finally:
        Path(out.name).unlink(missing_ok=True)
    return signed
