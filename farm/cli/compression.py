"""The compression flags of `farm submit` and `farm pull`, and the stages they add to a recipe:
`--compress CHOICE [--group-size N|channel] [--ratio R] [--all-layers]`,
`--quantize int8 --calibration DIR`, `--max-drift BOUND` (docs/architecture.md §15)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from farm.core import compression
from farm.core.errors import CompressionArgsError


@dataclass(frozen=True)
class CompressionRequest:
    """What the flags ask for: at most one compression stage, its calibration folder (for
    `--quantize`) and the drift bound the job must meet."""

    kind: str | None
    args: dict[str, Any]
    calibration: Path | None
    calibration_identity: dict[str, str]
    max_drift: compression.DriftBound | None

    @property
    def stage(self) -> dict[str, Any] | None:
        """The recipe entry (`{"stage", "args"}`), or None when nothing is compressed."""
        return {"stage": self.kind, "args": self.args} if self.kind else None

    def files_to_upload(self) -> dict[str, Path]:
        """The calibration files by sha256: uploaded like model files, where the worker
        fetches them (`models/<sha256>`)."""
        if self.calibration is None:
            return {}
        files = compression.calibration_files(self.calibration)
        return {self.calibration_identity[relative]: path for relative, path in files.items()}

    def check_calibration(self, model_files: Mapping[str, Path]) -> None:
        """Read the calibration samples against the model's inputs (IR or ONNX, here, before
        anything is uploaded): too few or of the wrong shape is an error now, not on a worker."""
        if self.calibration is None:
            return
        import openvino as ov  # the submitter has it (it fits the model to the spec)

        from farm.core.calibration import load_samples
        from farm.core.reference import InputSpec

        model = ov.Core().read_model(model_files.get("xml") or model_files["onnx"])
        specs = [
            InputSpec(
                port.get_any_name(),
                tuple(d.get_length() if d.is_static else -1 for d in port.get_partial_shape()),
                port.get_element_type().to_dtype().name,
            )
            for port in model.inputs
        ]
        load_samples(compression.calibration_files(self.calibration), specs)

    def check_targets(self, targets: list[str]) -> None:
        """Refuse before anything is hashed or uploaded what a target cannot run."""
        if self.kind:
            for target in targets:
                compression.check_target(self.kind, self.args, target)


def compression_options(command: Callable) -> Callable:
    options = [
        click.option(
            "--compress",
            "compress",
            metavar="|".join(compression.CHOICES),
            help="Compress the weights with NNCF on the farm before compiling: a mode, or a "
            "preset (npu-llm: INT4 symmetric, ratio 1, group 128 up to 4B weights else "
            "channel-wise; npu-cnn: INT8).",
        ),
        click.option("--group-size", help="4-bit modes: weights per scale (128) or 'channel'."),
        click.option("--ratio", help="4-bit modes: share of layers in 4 bits, (0, 1]."),
        click.option(
            "--all-layers",
            is_flag=True,
            help="4-bit modes: embeddings and the last layer in 4 bits too.",
        ),
        click.option(
            "--quantize",
            help="int8: quantize weights and activations with NNCF on the farm "
            "(needs --calibration).",
        ),
        click.option(
            "--calibration",
            type=click.Path(exists=True, file_okay=False, path_type=Path),
            help="Folder of .npy/.npz input samples for --quantize (part of the key).",
        ),
        click.option(
            "--max-drift",
            help="Fail the job if the compressed model drifts further from the uncompressed "
            "one: 0.05 (largest absolute difference), or cosine=0.999,top1=0.98.",
        ),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def compression_request(options: dict[str, Any]) -> CompressionRequest:
    """The request the flags make; pops them from `options` (the rest are the spec's)."""
    choice = options.pop("compress", None)
    group_size = options.pop("group_size", None)
    ratio = options.pop("ratio", None)
    all_layers = options.pop("all_layers", False)
    quantize = options.pop("quantize", None)
    calibration = options.pop("calibration", None)
    bound = options.pop("max_drift", None)
    max_drift = compression.DriftBound.parse(bound) if bound else None
    if choice and quantize:
        raise CompressionArgsError(
            "--compress and --quantize are two ways to compress: give one (--quantize int8 "
            "already makes the weights INT8)"
        )
    if not choice and (group_size is not None or ratio is not None or all_layers):
        raise CompressionArgsError("--group-size, --ratio and --all-layers go with --compress")
    if calibration is not None and not quantize:
        raise CompressionArgsError("--calibration goes with --quantize int8")
    if max_drift is not None and not (choice or quantize):
        raise CompressionArgsError("--max-drift bounds a compressed model: add --compress")
    if choice:
        args = compression.compress_args(
            choice, group_size=group_size, ratio=ratio, all_layers=all_layers
        )
        return CompressionRequest(compression.COMPRESS, args, None, {}, max_drift)
    if quantize:
        if calibration is None:
            raise CompressionArgsError(
                "--quantize needs --calibration DIR: a folder of .npy/.npz input samples"
            )
        identity = compression.calibration_identity(compression.calibration_files(calibration))
        args = compression.quantize_args(quantize, identity)
        return CompressionRequest(compression.QUANTIZE, args, calibration, identity, max_drift)
    return CompressionRequest(None, {}, None, {}, None)
