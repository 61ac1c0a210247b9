"""Fleet sync: pull everything a manifest lists, report what the farm does not have yet.

A manifest is TOML (standard library), one table per model and spec; paths are relative to
the manifest; `path` names any source the farm converts (docs §15: IR, ONNX, `.pt2`,
TorchScript, `.tflite`, Paddle, SavedModel, a Hugging Face folder), with `example_input` and
`task` as `farm submit` takes them; the other keys are `CompileSpec.create`'s:

    [[model]]
    path = "models/unet.xml"
    device = "4000"
    tiles = 4
    shapes = ["sample[1,4,64,64]"]

    [[model]]
    path = "models/encoder.pt2"
    device = "CPU"
    example_input = ["x[1,3,224,224]:f32"]

The key comes from the source offline (`farm.core.sourceref.source_ref`, as `farm pull`).
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from farm.core.errors import Incompatible, NotFound
from farm.core.identity import key_for
from farm.core.sourceref import source_ref
from farm.core.spec import CompileSpec, SpecError, Toolchain
from farm.edge.agent import EdgeAgent
from farm.edge.verify import verify_once
from farm.toolchain import host_toolchain


@dataclass(frozen=True)
class ManifestEntry:
    model: Path
    spec: CompileSpec
    toolchain: Toolchain | None = None
    """From the entry's `toolchain` file (`farm toolchain --json`): the blob for edges with that
    toolchain (staged here for them); None: this machine's own."""
    example_input: tuple[str, ...] = ()
    """A source's `--example-input`s (PyTorch); part of its recipe, so of its key."""
    task: str | None = None
    """A Hugging Face folder's `--task` (default: from its config.json)."""


@dataclass(frozen=True)
class SyncResult:
    model: str
    spec: str
    status: str
    """ready (in the cache), missing (the farm has no blob yet), incompatible, or error."""
    cache_key: str | None = None
    detail: str | None = None
    downloaded: bool = False

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def load_manifest(path: Path) -> list[ManifestEntry]:
    try:
        document = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise SpecError(f"{path}: not a TOML manifest: {error}") from error
    tables = document.get("model")
    if not isinstance(tables, list) or not tables:
        raise SpecError(f"{path}: list models as [[model]] tables with path and device")
    entries = []
    for number, table in enumerate(tables, 1):
        table = dict(table)
        where = f"{path}: model #{number}"
        if "path" not in table or "device" not in table:
            raise SpecError(f"{where} needs `path` and `device`")
        model = path.parent / table.pop("path")
        toolchain = None
        if "toolchain" in table:
            toolchain = _toolchain_file(path.parent / table.pop("toolchain"), where)
        example_input = table.pop("example_input", [])
        if isinstance(example_input, str):
            example_input = [example_input]
        task = table.pop("task", None)
        if not all(isinstance(value, str) for value in example_input):
            raise SpecError(f"{where}: example_input takes strings like 'x[1,3,224,224]:f32'")
        if task is not None and not isinstance(task, str):
            raise SpecError(f"{where}: task takes a string (text-classification, ...)")
        try:
            spec = CompileSpec.create(table.pop("device"), **table)
        except TypeError as error:
            raise SpecError(f"{where}: {error}") from None
        except SpecError as error:
            raise SpecError(f"{where}: {error}") from None
        entries.append(ManifestEntry(model, spec, toolchain, tuple(example_input), task))
    return entries


def _toolchain_file(path: Path, where: str) -> Toolchain:
    try:
        return Toolchain.from_json(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError) as error:
        if isinstance(error, SpecError):
            raise SpecError(f"{where}: {path}: {error}") from None
        raise SpecError(f"{where}: toolchain file {path}: {error}") from None


def sync_once(
    agent: EdgeAgent, entries: list[ManifestEntry], do_import: bool, do_verify: bool = False
) -> list[SyncResult]:
    """One pass over the manifest; a failure of one entry never stops the others. With
    `do_verify`, each blob is verified once per device (`farm.edge.verify.verify_once`): its
    result is the entry's status ("verified", or "failed verification")."""
    results = []
    for entry in entries:
        label, summary, key = str(entry.model), entry.spec.summary(), None
        try:
            ref, _ = source_ref(entry.model, entry.example_input, entry.task)
            toolchain = entry.toolchain or host_toolchain(entry.spec.target)
            key = key_for(ref.identity, entry.spec, toolchain, ref.recipe)
            # A weightless blob takes the IR's weights; a converted source's IR is the farm's.
            weights = None if ref.recipe else ref.files.get("bin")
            fetched = agent.fetch(key)
            detail = None
            if do_verify:
                outcome = verify_once(agent, key, weights=weights)
                if outcome is None:
                    detail = "not verified: the blob has no reference outputs"
                elif outcome["error"]:  # could not judge the blob: this machine's error
                    results.append(SyncResult(label, summary, "error", key, outcome["error"]))
                    continue
                elif not outcome["passed"]:
                    why = "outputs outside tolerance"
                    results.append(SyncResult(label, summary, "failed", key, why))
                    continue
            if do_import:
                agent.load(key, weights=weights, blob=fetched.blob, spec=entry.spec)
            elif fetched.downloaded:  # a verification is not a pull; gc counts pulls
                agent.report_download(key)
            results.append(
                SyncResult(label, summary, "ready", key, detail, downloaded=fetched.downloaded)
            )
        except NotFound:
            results.append(SyncResult(label, summary, "missing", key, "the farm has no blob yet"))
        except Incompatible as error:
            results.append(SyncResult(label, summary, "incompatible", key, str(error)))
        except Exception as error:  # one broken entry must not stop the fleet's other models
            results.append(SyncResult(label, summary, "error", key, f"{error}"))
    return results
