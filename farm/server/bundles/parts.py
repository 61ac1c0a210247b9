"""The parts of a pipeline bundle (docs/architecture.md §17, "Parts").

A bundle is the folder's own files plus every part's output files. A *part* is what compiles
as one unit: the whole pipeline as GenAI compiles it (``pipeline``), or a sub-model that GenAI
lets compile apart and then loads from the cache when the pipeline opens (a Stable Diffusion
folder's ``text_encoder``, ``unet``, ``vae_decoder`` on CPU: `farm.core.pipelines.part_files`).
Each part has a part key (`farm.core.pipelines.part_key`: its files, the target, the options
and the toolchain), so the same sub-model in two pipelines compiles once: a compiled part is
stored as a listing of its files by sha256 (the files under ``bundle-files/``) and reused by
every bundle that has it. The listing decides which files a bundle's manifest lists, so the
farm's key signs it (``bundle-parts/<part_key>.<key id>.json``), and a listing no key the farm
trusts signed for that part is compiled again rather than believed.

`plan_parts` is pure (it reads and hashes the folder; `plan_from_identity` plans from digests
alone); `compile_part` compiles one part where its caller runs it: in this process or in the
sandboxed child (`sandboxed_part`).
"""

from __future__ import annotations

import base64
import json
import logging
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from farm.core.bundles import CACHE_FOLDER, BundleFile
from farm.core.errors import (
    AlreadyStored,
    CompileError,
    IntegrityMismatch,
    PipelineError,
    StorageError,
)
from farm.core.hashing import canonical_json, sha256_file, sha256_stream
from farm.core.pipelines import (
    WHOLE_PIPELINE,
    GenAIOptions,
    PipelineFolder,
    compile_memory_bytes,
    detect,
    hf_pipeline,
    identity,
    is_huggingface_folder,
    key_options,
    memory_for_weights,
    part_files,
    part_key,
    part_model,
)
from farm.core.signing import Signer, TrustedKeys
from farm.core.spec import Target
from farm.server.bundles.storage import file_storage_key
from farm.server.jobs.model_cache import download_hashed
from farm.server.jobs.runner import RunLimits
from farm.server.storage import BlobStore

log = logging.getLogger(__name__)

WHOLE = WHOLE_PIPELINE
"""The name of the part that is the whole pipeline as GenAI compiles it."""
PART_VERSION = 2
"""Of a stored part's listing; 2: signed, one per signing key (version 1's unsigned listings
are not read: those parts compile again)."""
_LISTING_PREFIX = b"farm-bundle-part-v2\n"


@dataclass(frozen=True)
class Part:
    name: str
    """``pipeline`` (the whole pipeline as GenAI compiles it) or a sub-model (``text_encoder``,
    ``unet``, ``vae_decoder``)."""
    key: str
    """The part key (`farm.core.pipelines.part_key`): its files, target, options, toolchain."""
    files: dict[str, str]
    """Relative path in the folder -> sha256 of what this part compiles."""
    memory_bytes: int
    """Estimated compile memory (the rule `check_memory` uses)."""


@dataclass(frozen=True)
class PartOutput:
    files: dict[str, Path]
    """The bundle's relative path (``cache/<entry>``, ``openvino_model.blob``, the exported
    folder's files for a Hugging Face folder) -> the file written."""
    metrics: dict[str, Any]
    """What the compile measured; ``reference``: the reference run's output, when recorded."""


def folder_of(folder: Path, kind: str | None) -> PipelineFolder:
    """The pipeline folder at `folder`: an OpenVINO pipeline folder, or a Hugging Face folder
    to export first."""
    if is_huggingface_folder(folder):
        return hf_pipeline(folder, kind)
    return detect(folder, kind)


def options_of(
    kind: str, target: Target, options: GenAIOptions | Mapping[str, Any]
) -> GenAIOptions:
    """`options` as `GenAIOptions` (a canonical mapping, as stored with a job, is accepted;
    its ``convert`` entry belongs to the key, not to the compile)."""
    if isinstance(options, GenAIOptions):
        return options
    values = {name: value for name, value in options.items() if name != "convert"}
    return GenAIOptions(kind=kind, target=target, values=values)


def plan_from_identity(
    kind: str,
    files: Mapping[str, str],
    sizes: Mapping[str, int],
    target: Target,
    key_options: Mapping[str, Any],
    toolchain: Mapping[str, str],
    whole_memory_bytes: int,
) -> list[Part]:
    """The parts of a pipeline known by its digests (`files`: relative path -> sha256, `sizes`:
    relative path -> bytes), for a farm that has not the folder itself. `key_options` are the
    options of the key (`farm.core.pipelines.key_options`); `whole_memory_bytes` the estimate
    for the whole pipeline (`compile_memory_bytes`)."""
    parts = []
    keys = part_keys(kind, files, target, key_options, toolchain)
    for name, paths in part_files(kind, files, target).items():
        mine = {path: files[path] for path in paths}
        if name == WHOLE:
            memory = whole_memory_bytes
        else:
            weights = sum(sizes[path] for path in paths if path.endswith(".bin"))
            memory = memory_for_weights(kind, weights, target)
        parts.append(Part(name=name, key=keys[name], files=mine, memory_bytes=memory))
    return parts


def part_keys(
    kind: str,
    files: Mapping[str, str],
    target: Target,
    key_options: Mapping[str, Any],
    toolchain: Mapping[str, str],
) -> dict[str, str]:
    """Part name -> part key of a pipeline known by its digests (what `plan_from_identity`
    plans, without the memory estimates)."""
    keys = {}
    for name, paths in part_files(kind, files, target).items():
        model = part_model({path: files[path] for path in paths}, name)
        keys[name] = part_key(kind, name, model, target, key_options, toolchain)
    return keys


def plan_parts(
    folder: Path,
    kind: str | None,
    target: Target,
    options: GenAIOptions | Mapping[str, Any],
    toolchain: Mapping[str, str],
) -> list[Part]:
    """The parts that compile `folder` for `target`, in the order to compile them."""
    pipeline = folder_of(Path(folder), kind)
    genai = options_of(pipeline.kind, target, options)
    return plan_from_identity(
        pipeline.kind,
        identity(pipeline),
        {path: file.stat().st_size for path, file in pipeline.files.items()},
        target,
        key_options(pipeline, genai),
        toolchain,
        compile_memory_bytes(pipeline, target),
    )


def compile_part(
    folder: Path,
    kind: str | None,
    part: Part,
    target: Target,
    options: GenAIOptions | Mapping[str, Any],
    out_dir: Path,
) -> PartOutput:
    """Compile `part` of `folder` into the empty folder `out_dir`; its output files by their
    path in the bundle. A Hugging Face folder is exported first (its exported files are among
    the outputs: the bundle ships them, not the source).

    Note: the export imports torch and transformers lazily from the worker's Python; in the
    sandboxed child it runs before the switch of user (`farm.server.bundles.export`)."""
    from farm.server.bundles.compile import compile_pipeline, compile_sub_model

    pipeline = folder_of(Path(folder), kind)
    genai = options_of(pipeline.kind, target, options)
    out_dir.mkdir(parents=True, exist_ok=True)
    if part.name != WHOLE:
        if pipeline.convert_task is not None or part.name not in part_files(
            pipeline.kind, pipeline.files, target
        ):
            raise PipelineError(
                f"{pipeline.root}: {part.name!r} does not compile apart in a {pipeline.kind} "
                f"pipeline for {target}"
            )
        return PartOutput(
            files=compile_sub_model(pipeline, part.name, genai, out_dir / "work"), metrics={}
        )
    exported: dict[str, Path] = {}
    if pipeline.convert_task is not None:
        from farm.server.bundles.export import export_huggingface

        pipeline = export_huggingface(pipeline, out_dir / "export-hf")
        exported = dict(pipeline.files)
    compiled = compile_pipeline(pipeline, genai, out_dir / "work")
    outputs = dict(compiled.outputs)
    clash = sorted(outputs.keys() & exported.keys())
    if clash:
        raise PipelineError(f"the exported folder has files named like compiled outputs: {clash}")
    return PartOutput(files=outputs | exported, metrics={"reference": compiled.reference})


# --- parts in the store (compiled once, reused) ------------------------------------------------

PARTS = "bundle-parts/"


def part_storage_key(key: str, signer_id: str) -> str:
    """Where the listing of part `key` signed by key `signer_id` is stored: one name per key,
    so farms of two keys on one store never write over each other's listing."""
    return f"{PARTS}{key}.{signer_id}.json"


def part_key_of(storage_key: str) -> str:
    """The part key a stored listing's name starts with (of this version's names, and of
    version 1's ``bundle-parts/<part_key>.json``)."""
    return storage_key.removeprefix(PARTS).split(".", 1)[0]


def is_signed_name(storage_key: str) -> bool:
    """A listing of this version's names (version 1's, ``<part_key>.json``, were unsigned)."""
    return storage_key.removeprefix(PARTS).count(".") == 2


def listing_keys(signer: Signer, others: TrustedKeys | None = None) -> TrustedKeys:
    """The keys whose part listings a farm reuses: its own first, then `others`
    (FARM_TRUSTED_KEYS: the keys its edges trust with the bundles themselves)."""
    return TrustedKeys({signer.key_id: signer.public_key, **(others.keys if others else {})})


StoredPart = tuple[list[BundleFile], dict[str, Any]]
"""A compiled part's files (by their path in a bundle) and metrics, from its signed listing."""


def stored_part(store: BlobStore, key: str, trusted: TrustedKeys) -> StoredPart | None:
    """Compiled part `key` from a listing one of the `trusted` keys signed for it, or None.
    A listing that does not verify (altered in the store, another part's, unsigned as version
    1 wrote them, not JSON) is not believed: the part compiles again."""
    for signer_id, public in trusted.keys.items():
        found = _read_listing(store, key, signer_id, public)
        if found is not None:
            return found
    return None


def _read_listing(
    store: BlobStore, key: str, signer_id: str, public: Ed25519PublicKey
) -> StoredPart | None:
    storage_key = part_storage_key(key, signer_id)
    if not store.exists(storage_key):
        return None
    try:
        with store.open_read(storage_key) as stream:
            stored = json.load(stream)
    except FileNotFoundError:  # removed since (farm gc)
        return None
    except (ValueError, RecursionError) as error:
        log.warning("bundle part %s: %s is not JSON (%s); not used", key, storage_key, error)
        return None
    except StorageError:
        if not store.exists(storage_key):
            return None
        raise
    try:
        listing = _verified(stored, key, signer_id, public)
        files = [BundleFile(f["path"], f["sha256"], int(f["size"])) for f in listing["files"]]
        return files, dict(listing.get("metrics") or {})
    except (ValueError, TypeError, KeyError, AttributeError) as error:
        log.warning("bundle part %s: %s is not used: %s", key, storage_key, error)
        return None


def _verified(stored: Any, key: str, signer_id: str, public: Ed25519PublicKey) -> dict[str, Any]:
    """The listing of `stored` if `public` signed exactly it for part `key`; else ValueError."""
    if not isinstance(stored, dict) or not isinstance(stored.get("listing"), dict):
        raise ValueError("not a signed listing")
    listing = stored["listing"]
    if listing.get("v") != PART_VERSION or listing.get("part_key") != key:
        raise ValueError(f"a listing of version {listing.get('v')} for {listing.get('part_key')}")
    if stored.get("signer") != signer_id:
        raise ValueError(f"it names key {stored.get('signer')}, not {signer_id}")
    try:
        signature = base64.b64decode(str(stored.get("signature")), validate=True)
        public.verify(signature, _LISTING_PREFIX + canonical_json(listing))
    except (InvalidSignature, ValueError):
        raise ValueError("its signature does not verify") from None
    return listing


def publish_part(store: BlobStore, part: Part, output: PartOutput, signer: Signer) -> StoredPart:
    """Store a compiled part's files under ``bundle-files/<sha256>`` (once each), then its
    listing, signed by `signer`, last: a part exists only when its files do. Another build of
    the part may have published first: its listing, signed by `signer`, is the part (its
    files and metrics returned); one that does not verify is replaced."""
    if not output.files:
        raise CompileError(f"the {part.name} part compiled no file: nothing to ship")
    entries = []
    for path, local in sorted(output.files.items()):
        sha = sha256_file(local)
        if not store.exists(file_storage_key(sha)):
            store.put_file(file_storage_key(sha), local, expected_sha256=sha)
        entries.append(BundleFile(path, sha, local.stat().st_size))
    listing = {
        "v": PART_VERSION,
        "part": part.name,
        "part_key": part.key,
        "files": [{"path": e.path, "sha256": e.sha256, "size": e.size} for e in entries],
        "metrics": output.metrics,
    }
    listing = json.loads(json.dumps(listing))  # signed as it will be read back
    signature = signer.sign_message(_LISTING_PREFIX + canonical_json(listing))
    own = listing_keys(signer)
    storage_key = part_storage_key(part.key, signer.key_id)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as out:
        json.dump({"listing": listing, "signer": signer.key_id, "signature": signature}, out)
    try:
        for _ in range(2):
            try:
                store.put_file(storage_key, out.name)
                return entries, dict(listing["metrics"])
            except AlreadyStored:
                found = stored_part(store, part.key, own)
                if found is not None:  # published first by another build of the part
                    return found
                store.delete(storage_key)  # written once: an untrusted listing goes first
        raise AlreadyStored(f"{storage_key} was written again while this part was published")
    finally:
        Path(out.name).unlink(missing_ok=True)


PartCompile = Callable[[PipelineFolder, GenAIOptions, Part, Path], PartOutput]
"""Compiles one part of a folder into an empty work folder: in this process (`in_process`) or
in the sandboxed child with the farm's limits (`sandboxed_part`)."""


def in_process(folder: PipelineFolder, options: GenAIOptions, part: Part, work: Path) -> PartOutput:
    return compile_part(folder.root, folder.kind, part, options.target, options, work)


AssembledCheck = Callable[[PipelineFolder, GenAIOptions, Path], dict[str, Any]]
"""Opens a pipeline whose sub-models compiled apart on a cache folder holding exactly their
entries, and fails if it compiles anything on open; the reference run. In this process
(`check_in_process`) or in the sandboxed child (`sandboxed_check`)."""


def check_in_process(folder: PipelineFolder, options: GenAIOptions, cache: Path) -> dict[str, Any]:
    from farm.server.bundles.compile import check_assembled

    return check_assembled(folder, options, cache)


@dataclass(frozen=True)
class BuiltParts:
    files: list[BundleFile]
    """Every part's output files, by their path in the bundle."""
    reference: dict[str, Any]
    compiled: list[str]
    """The parts compiled by this build (the others were reused from the store)."""


def build_parts(
    store: BlobStore,
    folder: PipelineFolder,
    options: GenAIOptions,
    toolchain: Mapping[str, str],
    signer: Signer,
    compile: PartCompile = in_process,
    files: Mapping[str, str] | None = None,
    trusted: TrustedKeys | None = None,
    check: AssembledCheck = check_in_process,
) -> BuiltParts:
    """Compile each part of `folder` not yet in the store (a part another bundle compiled is
    reused when `signer` or one of `trusted` signed its listing), store it, and return the
    outputs of all parts: the embedded farm's build. `files`: the folder's `identity`, when
    the caller has it (not hashed again). `check`: where a bundle of sub-model parts is opened
    whole at the end (`check_parts`)."""
    trusted = listing_keys(signer, trusted)
    parts = plan_from_identity(
        folder.kind,
        identity(folder) if files is None else files,
        {path: file.stat().st_size for path, file in folder.files.items()},
        options.target,
        key_options(folder, options),
        toolchain,
        compile_memory_bytes(folder, options.target),
    )
    outputs: list[BundleFile] = []
    reference: dict[str, Any] = {}
    compiled: list[str] = []
    for part in parts:
        found = stored_part(store, part.key, trusted)
        if found is None:
            with tempfile.TemporaryDirectory(prefix=f"farm-part-{part.name}-") as scratch:
                output = compile(folder, options, part, Path(scratch))
                found = publish_part(store, part, output, signer)
            compiled.append(part.name)
        entries, metrics = found
        outputs.extend(entries)
        if part.name == WHOLE:
            reference = dict(metrics.get("reference") or {})
    if all(part.name != WHOLE for part in parts):
        reference = check_parts(store, folder, options, outputs, check)
    return BuiltParts(files=outputs, reference=reference, compiled=compiled)


def check_parts(
    store: BlobStore,
    folder: PipelineFolder,
    options: GenAIOptions,
    files: list[BundleFile],
    check: AssembledCheck,
) -> dict[str, Any]:
    """The last step of a bundle of sub-model parts: open the pipeline on a cache of exactly
    the parts' entries (from the store, checked) with `check`, which fails if it compiles
    anything; the reference run."""
    with tempfile.TemporaryDirectory(prefix="farm-parts-check-") as scratch:
        cache = Path(scratch) / CACHE_FOLDER
        cache.mkdir()
        for entry in files:
            if not entry.path.startswith(f"{CACHE_FOLDER}/"):
                continue
            _copy_checked(store, entry, Path(scratch) / entry.path)
        return check(folder, options, cache)


def _copy_checked(store: BlobStore, entry: BundleFile, dest: Path) -> None:
    """Copy the stored file of `entry` to `dest`, hashed on the way. Other bytes: read again,
    to tell a transfer gone wrong (StorageError, retried) from a corrupt file."""
    key = file_storage_key(entry.sha256)
    if download_hashed(store, key, dest) == entry.sha256:
        return
    with store.open_read(key) as stream:
        stored = sha256_stream(stream)
    if stored == entry.sha256:
        raise StorageError(f"bundle file {key} changed on its way from storage; retrying")
    raise IntegrityMismatch(
        f"bundle file {entry.path} is corrupt in storage: its sha256 is {stored}"
    )


def sandboxed_check(limits: RunLimits) -> AssembledCheck:
    """Open the assembled pipeline in a child with the compile's limits, as its parts compiled:
    GenAI reads the folder and the parts' cache entries there, never in the process that holds
    the signing key (`farm.server.bundles.compile.child_main`, part `ASSEMBLED`)."""
    from farm.server.bundles.compile import ASSEMBLED, PART_OPTION
    from farm.server.jobs.sandbox import pipeline_in_child

    def run(folder: PipelineFolder, options: GenAIOptions, cache: Path) -> dict[str, Any]:
        done = pipeline_in_child(
            folder.files,
            folder.kind,
            options.target.name,
            options.canonical() | {PART_OPTION: ASSEMBLED},
            cache.parent / "out",
            "assembled",
            timeout_seconds=limits.max_run_seconds,
            memory_bytes=limits.memory_bytes,
            compile_user=limits.compile_user,
            compile_launcher=limits.compile_launcher,
            cache_entries={entry.name: entry for entry in sorted(cache.iterdir())},
        )
        return done.reference

    return run


def sandboxed_part(limits: RunLimits) -> PartCompile:
    """Compile a part in a child with the compile's limits (time, memory, user, environment):
    `farm.server.bundles.compile.child_main`, the part named in its options (`PART_OPTION`)."""
    from farm.server.bundles.compile import PART_OPTION
    from farm.server.jobs.sandbox import pipeline_in_child

    def run(folder: PipelineFolder, options: GenAIOptions, part: Part, work: Path) -> PartOutput:
        done = pipeline_in_child(
            folder.files,
            folder.kind,
            options.target.name,
            options.canonical() | {PART_OPTION: part.name},
            work / "out",
            part.key,
            timeout_seconds=limits.max_run_seconds,
            memory_bytes=limits.memory_bytes,
            compile_user=limits.compile_user,
            compile_launcher=limits.compile_launcher,
            convert_task=folder.convert_task,
        )
        return PartOutput(files=dict(done.outputs), metrics={"reference": done.reference})

    return run
