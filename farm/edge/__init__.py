"""The edge: get a ready `openvino.CompiledModel` from the farm instead of compiling.

    import farm.edge
    compiled = farm.edge.compile_model("unet.xml", device="4000", tiles=4)
    compiled = farm.edge.compile_model("unet.pt2", device="4000")  # converted on the farm

Needs `FARM_API_URL` (and a `pull` token in `FARM_TOKEN`); installs with ``farm[edge]``
(openvino and an HTTP client, no compiler, database, broker or storage client).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, cast

import openvino as ov

from farm.client import FarmClient
from farm.core.config import Settings, get_settings
from farm.core.digests import digest_cache
from farm.core.errors import BlobNotAvailable, Incompatible, NotFound, VerificationFailed
from farm.core.filecache import BlobCache
from farm.core.identity import ModelRef, key_for
from farm.core.signing import TrustedKeys, public_key_path
from farm.core.sourceref import source_ref
from farm.core.spec import CompileSpec
from farm.edge.agent import EdgeAgent
from farm.edge.channel import ChannelSource, ChannelSync, sync_channel
from farm.edge.importer import ImportedBlob, import_blob, infer_once
from farm.prepare import apply_shapes, read_model
from farm.toolchain import compile_properties, host_toolchain

__all__ = [
    "BlobNotAvailable",
    "EdgeAgent",
    "ImportedBlob",
    "Incompatible",
    "VerificationFailed",
    "agent_from_settings",
    "compile_model",
    "follow_channel",
    "import_blob",
    "infer_once",
]


def agent_from_settings(settings: Settings | None = None, source: Any = None) -> EdgeAgent:
    """An agent on this machine's cache (`FARM_CACHE_DIR`) talking to `FARM_API_URL`, or to
    `source` (the embedded farm), trusting the keys of `FARM_TRUSTED_KEYS`."""
    settings = settings or get_settings()
    trusted = settings.trusted_key_paths
    if source is None:
        if not settings.api_url:
            raise BlobNotAvailable("set FARM_API_URL (and FARM_TOKEN) to pull from a farm")
        source = FarmClient(settings.api_url, settings.token)
    else:
        own = public_key_path(settings.embedded_signing_key)
        trusted = [*trusted, own] if own.exists() else trusted
    trust = None if settings.allow_unsigned else TrustedKeys.from_files(trusted)
    cache = BlobCache(settings.cache_dir / "blobs", settings.cache_max_bytes)
    # The farm's own database (an operator's direct CLI) needs no signed status: its
    # quarantine field is the database's own word, not an answer a proxy could rewrite.
    direct = getattr(source, "reads_database", False) is True
    return EdgeAgent(source, cache, trust, settings.agent_id, status_required=not direct)


def compile_model(
    model_path: str | Path,
    device: str = "CPU",
    *,
    example_input: str | Sequence[str | Mapping[str, Any]] = (),
    task: str | None = None,
    fallback: Literal["compile"] | None = None,
    submit: bool = False,
    verify: bool = False,
    agent: EdgeAgent | None = None,
    **spec: Any,
):
    """A ready `openvino.CompiledModel` for `model_path` compiled for `device` with `spec`
    (the keyword arguments of `CompileSpec.create`: tiles, performance_hint, shapes...).

    `model_path`: any source the farm converts (docs §15) as well as IR and ONNX: a `.pt2`,
    a TorchScript archive, a `.tflite`, a Paddle model, a SavedModel or frozen `.pb`, a
    Hugging Face folder. `example_input` and `task` are `farm submit`'s `--example-input`
    (``"x[1,3,224,224]:f32"``) and `--task`: the key is computed from the source and its
    recipe offline (`farm.core.sourceref.source_ref`, as `farm pull SOURCE` does), without
    torch, transformers or any framework here.

    Pulls the farm's blob for the key this machine computes. When the farm has none, raises
    `BlobNotAvailable`, unless `fallback="compile"`: then compiles here (and with
    `submit=True` also submits the model, so the rest of the fleet gets the blob); a source
    that needs converting cannot be compiled here (the edge has no converter): it is then
    submitted when `submit=True`, and `BlobNotAvailable` says so.
    `verify=True` first verifies the blob against its reference outputs on this device, once
    per device (`farm.edge.verify.verify_once`), and raises `VerificationFailed` when it does
    not compute them (the farm then quarantines it). The returned model keeps its
    memory-mapped blob (and cache lease) alive as long as it lives.
    """
    compile_spec = CompileSpec.create(device, **spec)
    # Digests through the cache `farm submit` and `farm pull MODEL` use (path, size, mtime):
    # hashing a 512 MB .bin on every start took as long as importing the blob (bench/edge.py).
    digests = digest_cache(get_settings().cache_dir)
    ref, _ = source_ref(model_path, example_input, task, digests=digests.sha256)
    key = key_for(ref.identity, compile_spec, host_toolchain(compile_spec.target), ref.recipe)
    # A weightless blob takes the IR's weights; a converted source's IR is the farm's.
    weights = None if ref.recipe else ref.files.get("bin")
    owned = agent is None
    agent = agent or agent_from_settings()
    try:
        try:
            if verify:
                _verify(agent, key, compile_spec.target.device, weights)
            imported = agent.load(key, compile_spec.target.device, weights, spec=compile_spec)
        except NotFound:
            if fallback != "compile":
                raise BlobNotAvailable(
                    f"the farm has no blob for {ref.name} ({compile_spec.summary()}, key {key}); "
                    "submit it with `farm submit`, or pass fallback='compile'"
                ) from None
            return _compile_here(ref, compile_spec, agent if submit else None)
    finally:
        if owned:
            agent.source.close()
    # OpenVINO reads the blob through the memory map for as long as the model lives.
    imported.compiled.farm_import = imported
    return imported.compiled


def follow_channel(
    name: str, *, do_import: bool = False, verify: bool = False, agent: EdgeAgent | None = None
) -> ChannelSync:
    """Follow channel `name` once (`farm agent sync --channel NAME`): check its signed document,
    fetch (verify, import) the blobs of the revision it gives this edge, computed offline for
    this machine's toolchain, and switch the edge's `current` pointer only when all are in.
    The result's `keys` are the cache keys the app imports (`compile_model` finds them)."""
    owned = agent is None
    agent = agent or agent_from_settings()
    try:
        source = cast(ChannelSource, agent.source)
        return sync_channel(
            agent, source, name, get_settings().cache_dir, do_import=do_import, do_verify=verify
        )
    finally:
        if owned:
            agent.source.close()


def _verify(agent: EdgeAgent, key: str, device: str, weights: Path | None) -> None:
    from farm.edge.verify import verify_once

    outcome = verify_once(agent, key, device, weights)
    if outcome is None:
        warnings.warn(f"blob {key} has no reference outputs: imported unverified", stacklevel=3)
    elif outcome["error"]:  # could not judge the blob here; the import says why, if it fails
        warnings.warn(f"blob {key} could not be verified: {outcome['error']}", stacklevel=3)
    elif not outcome["passed"]:
        why = f"outputs outside tolerance {outcome['tolerance']}"
        raise VerificationFailed(f"blob {key} does not compute its reference outputs: {why}")


def _compile_here(ref: ModelRef, spec: CompileSpec, submit_with: EdgeAgent | None) -> Any:
    if submit_with is not None:
        if not isinstance(submit_with.source, FarmClient):
            raise BlobNotAvailable("submit=True needs the farm API (FARM_API_URL)")
        submit_with.source.submit_model(ref, [spec], host_toolchain(spec.target))
    if ref.recipe:
        submitted = " (submitted: the farm converts and compiles it)" if submit_with else ""
        raise BlobNotAvailable(
            f"the farm has no blob for {ref.name} ({spec.summary()}) and this edge cannot "
            f"compile it: it needs converting on the farm first{submitted}"
        )
    core = ov.Core()
    model = read_model(core, ref.files)
    apply_shapes(model, spec)
    return core.compile_model(model, spec.target.device, compile_properties(spec))
