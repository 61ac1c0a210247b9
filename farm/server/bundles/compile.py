"""Compile a GenAI pipeline folder exactly as the edge's pipeline will load it.

CPU (the proof on this machine): build the same pipeline with `CACHE_DIR` set and collect every
cache entry OpenVINO wrote. NPU: GenAI's own ahead-of-time export (`EXPORT_BLOB` + `BLOB_PATH`,
or `export_model` for text-to-image). Either way the fixed reference run is recorded where the
target runs on this host. Facts: docs/openvino.md, "GenAI pipelines".
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from farm.core.bundles import CACHE_FOLDER
from farm.core.errors import CompileError, CompilerUnavailable, ConversionError, PipelineError
from farm.core.pipelines import WHOLE_PIPELINE, GenAIOptions, PipelineFolder, detect
from farm.core.spec import Target
from farm.genai import compile_sub_model as compile_sub_model_with_genai
from farm.genai import open_pipeline, reference_run
from farm.toolchain import classify_failure

EXPORT_FOLDER = "export"
PART_OPTION = "part"
"""The options' entry that names the part the sandboxed child compiles (none: the whole
pipeline); the child's request has no field of its own for it."""
ASSEMBLED = "-assembled"
"""`PART_OPTION`'s value that asks the child to open the pipeline on the cache entries it was
given and check it compiles nothing (`check_assembled`): a name no sub-model folder has."""
NPU_BLOB = "openvino_model.blob"


@dataclass(frozen=True)
class CompiledPipeline:
    outputs: dict[str, Path]
    """What the compile produced, by its path in the ready folder (``cache/<entry>.blob`` on
    CPU, ``<name>.blob`` on NPU)."""
    reference: dict[str, Any]


def export_properties(folder: PipelineFolder, options: GenAIOptions, work: Path) -> dict[str, Any]:
    """The properties a pipeline is compiled with on this worker (into `work`)."""
    properties = options.properties()
    if options.target.is_npu:
        if folder.kind in ("llm", "whisper"):
            properties |= {"EXPORT_BLOB": True, "BLOB_PATH": str(work / EXPORT_FOLDER / NPU_BLOB)}
        elif folder.kind == "vlm":
            raise PipelineError(
                "--pipeline vlm on NPU: GenAI 2026.4 has no ahead-of-time export for VLMs; "
                "compile it for CPU, or let the edge compile it"
            )
    else:
        properties["CACHE_DIR"] = str(work / CACHE_FOLDER)
    return properties


def compile_pipeline(folder: PipelineFolder, options: GenAIOptions, work: Path) -> CompiledPipeline:
    """Compile `folder` for `options.target` into the empty folder `work`. A Hugging Face
    folder is exported first, in the sandboxed child only (`farm.server.bundles.export`)."""
    target: Target = options.target
    if folder.convert_task is not None:
        raise PipelineError(
            f"{folder.root}: a Hugging Face folder is exported in the sandboxed child only "
            "(farm.server.bundles.service.sandboxed)"
        )
    properties = export_properties(folder, options, work)
    (work / CACHE_FOLDER).mkdir(parents=True, exist_ok=True)
    (work / EXPORT_FOLDER).mkdir(parents=True, exist_ok=True)
    try:
        pipeline = open_pipeline(folder.kind, folder.root, target.device, properties)
        if target.is_npu and folder.kind == "text2image":
            pipeline.export_model(str(work / EXPORT_FOLDER))
    except (CompileError, PipelineError):
        raise
    except Exception as error:
        raise classify_failure(target, error) from None
    if target.is_npu:
        outputs = {
            path.relative_to(work / EXPORT_FOLDER).as_posix(): path
            for path in sorted((work / EXPORT_FOLDER).rglob("*.blob"))
        }
        reference: dict[str, Any] = {}
    else:
        outputs = {
            f"{CACHE_FOLDER}/{path.name}": path
            for path in sorted((work / CACHE_FOLDER).iterdir())
            if path.is_file()
        }
        reference = reference_run(folder.kind, pipeline)
    del pipeline
    if not outputs:
        raise CompileError(
            f"OpenVINO GenAI compiled the {folder.kind} pipeline for {target} and wrote no "
            "compiled file: nothing to ship"
        )
    return CompiledPipeline(outputs=outputs, reference=reference)


def compile_sub_model(
    folder: PipelineFolder, name: str, options: GenAIOptions, work: Path
) -> dict[str, Path]:
    """Compile the sub-model `name` (``unet``) of `folder` apart, on CPU, with the GenAI class
    its pipeline uses and the pipeline's properties: the cache entries it writes (by their path
    in the bundle) are the ones the pipeline loads (docs/openvino.md, "Parts")."""
    target: Target = options.target
    if target.is_npu:
        raise PipelineError(f"the {name} sub-model compiles apart on CPU only; NPU: one part")
    cache = work / CACHE_FOLDER
    cache.mkdir(parents=True, exist_ok=True)
    properties = options.properties() | {"CACHE_DIR": str(cache)}
    try:
        model = compile_sub_model_with_genai(name, folder.root / name, target.device, properties)
    except (CompileError, PipelineError):
        raise
    except Exception as error:
        raise classify_failure(target, error) from None
    del model
    outputs = {
        f"{CACHE_FOLDER}/{path.name}": path for path in sorted(cache.iterdir()) if path.is_file()
    }
    if not outputs:
        raise CompileError(f"OpenVINO GenAI compiled {folder.root / name} and cached nothing")
    return outputs


def check_assembled(folder: PipelineFolder, options: GenAIOptions, cache: Path) -> dict[str, Any]:
    """Open the pipeline on `cache`, which holds only its parts' entries (each compiled apart):
    the reference run, or `CompileError` naming what the pipeline compiled on open (a part
    whose entry is not the one the pipeline loads). OpenVINO writes an entry on a miss and
    touches nothing on a hit."""

    def state() -> dict[str, tuple[int, int, int]]:
        return {
            p.name: (s.st_ino, s.st_mtime_ns, s.st_size)
            for p in sorted(cache.iterdir())
            if p.is_file() and (s := p.stat())
        }

    before = state()
    properties = options.properties() | {"CACHE_DIR": str(cache)}
    try:
        pipeline = open_pipeline(folder.kind, folder.root, options.target.device, properties)
    except (CompileError, PipelineError):
        raise
    except Exception as error:
        raise classify_failure(options.target, error) from None
    written = sorted(name for name, seen in state().items() if before.get(name) != seen)
    if written:
        raise CompileError(
            f"the {folder.kind} pipeline compiled {', '.join(written)} on open although each "
            "part was compiled apart: this GenAI release does not load these parts from the "
            "cache; compile the folder as one part"
        )
    return reference_run(folder.kind, pipeline)


def _check_given(
    folder: PipelineFolder, options: GenAIOptions, entries: Path, box: Path
) -> dict[str, Any]:
    """`check_assembled` on copies of the entries given (read-only) in a cache folder of the
    child's own, where OpenVINO can write the entry of anything it compiles (a miss)."""
    cache = box / "work" / CACHE_FOLDER
    cache.mkdir(parents=True, exist_ok=True)
    for entry in sorted(entries.iterdir()):
        shutil.copyfile(entry, cache / entry.name)
    return check_assembled(folder, options, cache)


def preload() -> None:
    """Import GenAI in the child before it switches user."""
    import openvino_genai  # noqa: F401


def child_main(request: Mapping[str, Any]) -> dict[str, Any]:
    """The sandboxed child's side (`farm.server.jobs.sandbox.pipeline_in_child`): compile the
    staged (or exported) folder, or one sub-model part of it (named by the options' ``part``
    entry, `PART_OPTION`); the outputs by their bundle path -> path relative to the box."""
    box = Path(str(request["out_dir"]))
    converted = bool(request.get("convert_task"))
    values = dict(request["options"])
    part = values.pop(PART_OPTION, None)
    try:
        folder = detect(box / ("work/pipeline" if converted else "pipeline"), str(request["kind"]))
        options = GenAIOptions(
            kind=folder.kind, target=Target.parse(str(request["target"])), values=values
        )
        if part == ASSEMBLED:
            if not request.get("cache_entries"):
                raise CompileError("the assembled check was given no cache entries to open")
            entries = box / str(request["cache_entries"])
            return {"outputs": {}, "reference": _check_given(folder, options, entries, box)}
        if part is not None and part != WHOLE_PIPELINE:
            written = compile_sub_model(folder, str(part), options, box / "work")
            return {
                "outputs": {
                    name: path.relative_to(box).as_posix() for name, path in written.items()
                },
                "reference": {},
            }
        compiled = compile_pipeline(folder, options, box / "work")
    except (CompileError, PipelineError, CompilerUnavailable, ConversionError) as error:
        return {"error": error.code, "message": str(error)}
    outputs = dict(compiled.outputs)
    if converted:  # the exported folder ships with the compiled files
        clash = sorted(outputs.keys() & folder.files.keys())
        if clash:
            return {
                "error": CompileError.code,
                "message": f"the exported folder has files named like compiled outputs: {clash}",
            }
        outputs |= folder.files
    return {
        "outputs": {name: path.relative_to(box).as_posix() for name, path in outputs.items()},
        "reference": compiled.reference,
    }
