"""A model as the user has it (a source): its format, its files by role, its identity.

`detect` recognises a source from its path (a file, or a folder) without any framework: the
edge computes the same identity offline with farm[edge] (docs/architecture.md §15). OpenVINO
IR and ONNX keep the roles they always had (``xml``/``bin``, ``onnx``), so their identity, and
every existing cache key, is unchanged. Single-file formats name their file by a role; folders
(a TensorFlow SavedModel, a Hugging Face model) name every file by its path relative to the
folder, in POSIX form.

Pure: the standard library and farm.core only.
"""

from __future__ import annotations

import json
import os
import zipfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from farm.core.errors import ModelFileError

IR, ONNX = "ir", "onnx"
TFLITE, PADDLE, SAVEDMODEL, FROZEN_PB = "tflite", "paddle", "savedmodel", "pb"
PT2, TORCHSCRIPT, HUGGINGFACE = "pt2", "torchscript", "huggingface"

PADDLE_PIR = "pir"
"""A Paddle 3 program (`.json`, PIR): format `paddle`, its convert stage's `program`."""
NATIVE_FORMATS = (TFLITE, PADDLE, SAVEDMODEL, FROZEN_PB)
"""Read by OpenVINO's own frontends: converting them needs no framework on the worker."""
TORCH_FORMATS = (PT2, TORCHSCRIPT)
FORMATS = (IR, ONNX, *NATIVE_FORMATS, *TORCH_FORMATS, HUGGINGFACE)
COMPILED_FORMATS = (IR, ONNX)
"""Formats the compiler reads as they are: no convert stage."""

SUPPORTED = (
    "OpenVINO IR (.xml + .bin), ONNX (.onnx), TensorFlow Lite (.tflite), PaddlePaddle "
    "(.pdmodel or Paddle 3 .json, with .pdiparams beside it), a TensorFlow SavedModel folder "
    "(saved_model.pb), a frozen TensorFlow graph (.pb), a torch.export program (.pt2), a "
    "TorchScript archive (.pt, .jit) or a Hugging Face model folder (config.json + weights)"
)
MAX_FOLDER_FILES = 10_000
"""A source folder with more files than this is refused (a folder of a dataset, not a model)."""
HF_WEIGHTS = (".safetensors", ".bin", ".index.json")
HF_SKIPPED = (".git", ".cache", "__pycache__")
"""Folder entries that are no part of a model (a git checkout, a hub cache, bytecode)."""
_ZIP_MAGIC = b"PK\x03\x04"
_PICKLE_MAGIC = (b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05")


@dataclass(frozen=True)
class Source:
    """A source on this machine's disk: its format and its files by role (or relative path)."""

    format: str
    files: dict[str, Path]
    path: Path
    """What the user named: the file, or the folder."""

    @property
    def is_folder(self) -> bool:
        return self.format in (SAVEDMODEL, HUGGINGFACE)

    @property
    def needs_conversion(self) -> bool:
        return self.format not in COMPILED_FORMATS


def detect(path: str | Path) -> Source:
    """The source at `path`, its format recognised from its name and first bytes.

    Raises ModelFileError naming the supported formats when it is none of them, and naming the
    missing file when a format's companion file is absent (a .pdmodel without its .pdiparams).
    """
    path = Path(path)
    if path.is_dir():
        return _folder(path)
    if not path.is_file():
        raise ModelFileError(f"{path}: no such file or folder")
    suffix = path.suffix.lower()
    if suffix == ".xml":
        return _with_files(IR, path, {"xml": path, "bin": path.with_suffix(".bin")})
    if suffix == ".onnx":
        return _with_files(ONNX, path, {"onnx": path})
    if suffix == ".tflite":
        return _with_files(TFLITE, path, {"tflite": path})
    if suffix == ".pdmodel":
        return _with_files(PADDLE, path, {"pdmodel": path, "pdiparams": _params(path)})
    if suffix == ".json" and path.with_suffix(".pdiparams").exists():
        return _with_files(PADDLE, path, {"json": path, "pdiparams": _params(path)})
    if suffix == ".pdiparams":
        for model in (path.with_suffix(".pdmodel"), path.with_suffix(".json")):
            if model.is_file():
                return detect(model)
        raise ModelFileError(f"{path}: a Paddle weights file; give its .pdmodel or .json")
    if suffix == ".pb":
        if path.name == "saved_model.pb":
            return _folder(path.parent)
        return _with_files(FROZEN_PB, path, {"pb": path})
    if suffix in (".pt2", ".pt", ".pth", ".jit"):
        kind = torch_archive_kind(path)  # by its zip layout: a pickle is refused here
        return _with_files(kind, path, {kind: path})
    if path.name == "config.json":
        return _folder(path.parent)
    raise ModelFileError(f"{path}: not a model farm knows; give {SUPPORTED}")


def identity(
    source: Source,
    digest: Callable[[Path, Callable[[int], None] | None], str],
    progress: Callable[[int], None] | None = None,
) -> dict[str, str]:
    """The ``model`` part of a source's keys: sha256 of each file by role (or relative path).

    `digest` is `hashing.sha256_file` or a cache of it."""
    return {role: digest(file, progress) for role, file in sorted(source.files.items())}


def format_of(roles: Mapping[str, object]) -> str:
    """A source's format from its identity's roles alone (what the catalog holds)."""
    keys = set(roles)
    singles = {
        frozenset({"xml", "bin"}): IR,
        frozenset({"onnx"}): ONNX,
        frozenset({"tflite"}): TFLITE,
        frozenset({"pdmodel", "pdiparams"}): PADDLE,
        frozenset({"json", "pdiparams"}): PADDLE,
        frozenset({"pb"}): FROZEN_PB,
        frozenset({"pt2"}): PT2,
        frozenset({"torchscript"}): TORCHSCRIPT,
    }
    if frozenset(keys) in singles:
        return singles[frozenset(keys)]
    if "saved_model.pb" in keys:
        return SAVEDMODEL
    if "config.json" in keys:
        return HUGGINGFACE
    raise ModelFileError(f"files {sorted(keys)} are no source format farm knows")


def layout(roles: Mapping[str, object]) -> dict[str, str]:
    """Where each role's file goes in a folder the converter reads (relative POSIX paths):
    single files under a fixed stem with their format's suffix, folder files where they were."""
    names = {
        "xml": "model.xml",
        "bin": "model.bin",
        "onnx": "model.onnx",
        "tflite": "model.tflite",
        "pdmodel": "model.pdmodel",
        "json": "model.json",
        "pdiparams": "model.pdiparams",
        "pb": "model.pb",
        "pt2": "model.pt2",
        "torchscript": "model.pt",
    }
    placed = {}
    for role in roles:
        if role in names:
            placed[role] = names[role]
        else:
            placed[role] = safe_relative(role)
    return placed


def safe_relative(name: str) -> str:
    """`name` as a relative path that stays inside its folder, or ModelFileError."""
    parts = name.split("/")
    if any(p in ("..", ".", "") for p in parts) or "\\" in name or "\x00" in name:
        raise ModelFileError(f"{name!r}: not a file path inside a model folder")
    return str(PurePosixPath(name))


# --- PyTorch files: what they are, without unpickling them ------------------------------------


def torch_archive_kind(path: Path) -> str:
    """``"pt2"`` (torch.export), ``"torchscript"`` or raises ModelFileError: a plain pickle
    (`torch.save(model)`) is code, and a zip of another kind is no model farm converts.

    Reads only the zip's directory: nothing in the file is unpickled or run."""
    with open(path, "rb") as stream:
        head = stream.read(4)
    if head[:2] in _PICKLE_MAGIC or (head and head != _ZIP_MAGIC and head[:1] == b"\x80"):
        raise ModelFileError(_PICKLE_REFUSED.format(path=path))
    if head != _ZIP_MAGIC:
        raise ModelFileError(f"{path}: not a PyTorch archive (no zip header): {_TORCH_HOWTO}")
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except (zipfile.BadZipFile, OSError) as error:
        raise ModelFileError(f"{path}: a truncated or corrupt PyTorch archive: {error}") from None
    parts = [PurePosixPath(name).parts for name in names]
    if any(len(p) >= 2 and p[1] == "models" and p[-1].endswith(".json") for p in parts) or any(
        len(p) >= 2 and p[1] == "archive_format" for p in parts
    ):
        return PT2
    if any(len(p) >= 2 and p[1] == "code" for p in parts) and any(
        len(p) >= 2 and p[1] == "constants.pkl" for p in parts
    ):
        return TORCHSCRIPT
    if any(p[-1] == "data.pkl" for p in parts):
        raise ModelFileError(_PICKLE_REFUSED.format(path=path))
    raise ModelFileError(f"{path}: a zip file that is no PyTorch model archive: {_TORCH_HOWTO}")


_TORCH_HOWTO = (
    "export the model with torch.export (torch.export.save(torch.export.export(model, "
    "example_inputs), 'model.pt2')) or TorchScript (torch.jit.save(torch.jit.trace(model, "
    "example_inputs), 'model.pt'))"
)
_PICKLE_REFUSED = (
    "{path}: a pickled PyTorch object (torch.save(model)); loading it runs arbitrary code, so "
    "farm refuses it: " + _TORCH_HOWTO
)


# --- Hugging Face folders -----------------------------------------------------------------------


def hf_config(source: Source) -> dict:
    """The folder's config.json (a dict), or ModelFileError naming the file and why."""
    config = source.files.get("config.json")
    if config is None:
        raise ModelFileError(f"{source.path}: a Hugging Face folder needs its config.json")
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ModelFileError(f"{config}: not a readable config.json: {error}") from None
    if not isinstance(data, dict):
        raise ModelFileError(f"{config}: config.json holds no object")
    return data


def hf_custom_code(source: Source) -> list[str]:
    """What in a Hugging Face folder is custom code: .py files, and an ``auto_map``."""
    found = sorted(role for role in source.files if role.endswith(".py"))
    if "auto_map" in hf_config(source):
        found.append("config.json: auto_map")
    return found


# --- helpers ----------------------------------------------------------------------------------


def _params(model: Path) -> Path:
    return model.with_suffix(".pdiparams")


def _with_files(fmt: str, path: Path, files: dict[str, Path]) -> Source:
    for role, file in files.items():
        if not file.is_file():
            what = {"bin": "its weights file", "pdiparams": "its weights file"}.get(
                role, "model file"
            )
            raise ModelFileError(f"{file}: {what} does not exist")
    return Source(fmt, files, path)


def _folder(folder: Path) -> Source:
    files = dict(_walk(folder))
    if "saved_model.pb" in files:
        return Source(SAVEDMODEL, files, folder)
    if "config.json" in files:
        if not any(name.endswith(HF_WEIGHTS) for name in files):
            raise ModelFileError(
                f"{folder}: a Hugging Face folder without weights (*.safetensors or *.bin)"
            )
        return Source(HUGGINGFACE, files, folder)
    raise ModelFileError(
        f"{folder}: a folder with neither saved_model.pb (TensorFlow SavedModel) nor "
        f"config.json (Hugging Face); give {SUPPORTED}"
    )


def _walk(folder: Path) -> Iterator[tuple[str, Path]]:
    count = 0
    for root, dirs, names in os.walk(folder, followlinks=False):
        dirs[:] = sorted(d for d in dirs if d not in HF_SKIPPED)
        for name in sorted(names):
            file = Path(root) / name
            if file.is_symlink() and not file.resolve().is_relative_to(folder.resolve()):
                raise ModelFileError(f"{file}: a link out of the model folder")
            if not file.is_file():
                continue
            count += 1
            if count > MAX_FOLDER_FILES:
                raise ModelFileError(f"{folder}: more than {MAX_FOLDER_FILES} files")
            yield file.relative_to(folder).as_posix(), file


HF_TASKS = (
    ("ForCausalLM", "text-generation-with-past"),
    ("LMHeadModel", "text-generation-with-past"),
    ("ForSeq2SeqLM", "text2text-generation-with-past"),
    ("ForConditionalGeneration", "text2text-generation-with-past"),
    ("ForSequenceClassification", "text-classification"),
    ("ForTokenClassification", "token-classification"),
    ("ForQuestionAnswering", "question-answering"),
    ("ForMaskedLM", "fill-mask"),
    ("ForImageClassification", "image-classification"),
    ("Model", "feature-extraction"),
)
"""The optimum task of a Hugging Face folder from the end of its config's architecture name,
first match wins (the task names of optimum's exporter)."""


def hf_task(source: Source) -> str | None:
    """The task config.json's ``architectures`` names, or None when it names none we know."""
    architectures = hf_config(source).get("architectures") or []
    for architecture in architectures if isinstance(architectures, list) else []:
        for ending, task in HF_TASKS:
            if str(architecture).endswith(ending):
                return task
    return None
