"""Export a Hugging Face folder into a GenAI pipeline folder with optimum-intel (§17).

Imported only by the bundle's sandboxed child (`farm.server.jobs.sandbox`, by name, like the
stage kinds of §15): torch, transformers and optimum stay out of every other process.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from farm.core.errors import ConversionError
from farm.core.pipelines import PipelineFolder, detect, hf_pipeline
from farm.toolchain import last_line


def preload() -> None:
    """Import the exporter before the child's switch of user."""
    import optimum.exporters.openvino  # noqa: F401


def export_huggingface(folder: PipelineFolder, work: Path) -> PipelineFolder:
    """Export a Hugging Face folder into a pipeline folder with optimum-intel (the model IR, and
    the tokenizer and detokenizer IR through openvino-tokenizers), offline."""
    from optimum.exporters.openvino import main_export

    out = work / "pipeline"
    try:
        main_export(
            model_name_or_path=str(folder.root),
            output=out,
            task=str(folder.convert_task),
            local_files_only=True,
            convert_tokenizer=True,
        )
    except Exception as error:
        raise ConversionError(
            f"cannot export {folder.root.name} ({folder.convert_task}) with optimum-intel: "
            f"{last_line(error)[:2000]}"
        ) from None
    return detect(out, folder.kind)


def export_in_child(request: Mapping[str, Any]) -> Path | None:
    """The child's first phase, before its switch of user: export a staged Hugging Face folder
    (`work/`, holding the pipeline folder); None when the staged folder is one already."""
    if not request.get("convert_task"):
        return None
    box = Path(str(request["out_dir"]))
    work = box / "work"
    work.mkdir(parents=True, exist_ok=True)
    export_huggingface(hf_pipeline(box / "pipeline", str(request["kind"])), work)
    return work
