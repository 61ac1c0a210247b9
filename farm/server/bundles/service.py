"""Build and publish a pipeline bundle: compile, store every file once (content-addressed, so a
tokenizer or VAE shared by two bundles is stored once), sign the manifest, store it last (a
bundle is visible only when all its files are)."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from farm.core.bundles import BundleFile, BundleManifest, sign
from farm.core.errors import PipelineError
from farm.core.hashing import sha256_file
from farm.core.pipelines import (
    GenAIOptions,
    PipelineFolder,
    bundle_key,
    context_length,
    folder_key,
    identity,
    key_options,
)
from farm.core.signing import Signer
from farm.core.spec import Target
from farm.genai import toolchain
from farm.server.bundles.compile import CompiledPipeline, compile_pipeline
from farm.server.bundles.storage import file_storage_key, manifest_storage_key, published
from farm.server.jobs.runner import RunLimits
from farm.server.jobs.sandbox import pipeline_in_child
from farm.server.storage import BlobStore


def key_of(folder: PipelineFolder, options: GenAIOptions) -> str:
    """The bundle key of `folder` compiled with `options` by this host's releases."""
    return folder_key(folder, options, toolchain(options.target))


def options_for(folder: PipelineFolder, target: Target, **flags: Any) -> GenAIOptions:
    """The canonical options of the flags, checked against the model's context length."""
    return GenAIOptions.create(folder.kind, target, context_length=context_length(folder), **flags)


Compile = Callable[[PipelineFolder, GenAIOptions, Path, str], CompiledPipeline]
"""Compiles a folder into a work folder for a bundle key: in this process (tests, benchmarks),
or in the sandboxed child with the farm's limits (`sandboxed`)."""


def in_process(
    folder: PipelineFolder, options: GenAIOptions, work: Path, key: str
) -> CompiledPipeline:
    return compile_pipeline(folder, options, work)


def sandboxed(limits: RunLimits) -> Compile:
    """Compile in a child with the compile's limits (time, memory, user, environment)."""

    def run(
        folder: PipelineFolder, options: GenAIOptions, work: Path, key: str
    ) -> CompiledPipeline:
        done = pipeline_in_child(
            folder.files,
            folder.kind,
            options.target.name,
            options.canonical(),
            work / "out",
            key,
            timeout_seconds=limits.max_run_seconds,
            memory_bytes=limits.memory_bytes,
            compile_user=limits.compile_user,
            convert_task=folder.convert_task,
        )
        return CompiledPipeline(outputs=done.outputs, reference=done.reference)

    return run


def build_bundle(
    store: BlobStore,
    signer: Signer,
    folder: PipelineFolder,
    options: GenAIOptions,
    compile: Compile = in_process,
) -> dict[str, Any]:
    """Compile `folder`, upload what the edge needs and the signed manifest; the signed
    manifest. An existing bundle is returned as it is (compiled once)."""
    files = identity(folder)
    key = bundle_key(
        folder.kind, files, options.target, key_options(folder, options), toolchain(options.target)
    )
    existing = published(store, key)
    if existing is not None:
        return existing
    with tempfile.TemporaryDirectory(prefix="farm-bundle-") as scratch:
        compiled = compile(folder, options, Path(scratch), key)
        # A Hugging Face folder ships its exported pipeline folder (among the outputs), not
        # itself; an OpenVINO pipeline folder ships its own files beside the compiled ones.
        shipped = {} if folder.convert_task else files
        entries = [
            BundleFile(path, shipped[path], folder.files[path].stat().st_size)
            for path in sorted(shipped)
        ]
        for path, output in sorted(compiled.outputs.items()):
            if path in shipped:
                raise PipelineError(f"{folder.root / path}: a compiled output has this name")
            entries.append(BundleFile(path, sha256_file(output), output.stat().st_size))
        sources = {**{p: folder.files[p] for p in shipped}, **compiled.outputs}
        for entry in entries:
            storage_key = file_storage_key(entry.sha256)
            if not store.exists(storage_key):
                store.put_file(storage_key, sources[entry.path], expected_sha256=entry.sha256)
        manifest = BundleManifest(
            bundle_key=key,
            pipeline=folder.kind,
            target=options.target.name,
            options=options.canonical(),
            toolchain=toolchain(options.target),
            files=tuple(entries),
            reference=compiled.reference,
        )
    signed = sign(manifest, signer)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as out:
        json.dump(signed, out)
    try:
        store.put_file(manifest_storage_key(key), out.name)
    finally:
        Path(out.name).unlink(missing_ok=True)
    return signed
