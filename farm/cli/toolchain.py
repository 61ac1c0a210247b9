"""`farm toolchain`: this host's toolchain for a target (what an edge hands to whoever submits
for it), and `farm toolchain install-npu-compiler PATH` (farm.npu)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from farm.cli import main
from farm.cli.common import emit, handle_errors, json_option, out
from farm.core.spec import Target
from farm.core.text import converters_text


@main.group(invoke_without_command=True)
@click.option(
    "--device",
    "-d",
    "devices",
    multiple=True,
    help="Target to describe (CPU, 4000, NPU.5010, ...); repeatable. Default: CPU.",
)
@json_option
@click.pass_context
@handle_errors
def toolchain(ctx: click.Context, devices: tuple[str, ...], as_json: bool) -> None:
    """This host's toolchain for a target: OpenVINO release and build, the CPU runtime
    requirements, the NPU compiler version when one is installed, and the converters it
    runs stages with (torch, optimum: `farm[convert]`)."""
    if ctx.invoked_subcommand is not None:
        return
    from farm import toolchain as host  # OpenVINO: only when a toolchain is asked for
    from farm.converters import probe as converters

    targets = [Target.parse(device) for device in devices or ("CPU",)]
    npu = host.npu_compiler_versions() if any(t.is_npu for t in targets) else {}
    rows: list[dict[str, Any]] = []
    for target in targets:
        described: dict[str, Any] = {"target": target.name, **host.host_toolchain(target).as_dict()}
        if target.is_npu:
            result = npu.get(target.name, "")
            described["npu_compiler"] = result[3:] if result.startswith("ok ") else None
            if not result.startswith("ok "):
                described["npu_compiler_missing"] = result
        described["converters"] = converters()
        rows.append(described)

    def human() -> None:
        for row in rows:
            out.print(f"{row['target']:9} OpenVINO {row['openvino_build']}", markup=False)
            if row.get("runtime_requirements"):
                out.print(f"          runtime requirements {row['runtime_requirements']}")
            if row["target"].startswith("NPU"):
                compiler = row["npu_compiler"] or f"none ({row['npu_compiler_missing']})"
                out.print(f"          NPU compiler {compiler}", markup=False)
            out.print(f"          converters {converters_text(row['converters'])}", markup=False)

    emit(rows[0] if len(rows) == 1 else rows, as_json, human)


@toolchain.command("install-npu-compiler")
@click.argument("path", type=click.Path(path_type=Path))
@click.option(
    "--into",
    type=click.Path(file_okay=False, path_type=Path),
    help="Where OpenVINO loads its plugins from (default: this OpenVINO's own libs folder).",
)
@json_option
@handle_errors
def install_npu_compiler(path: Path, into: Path | None, as_json: bool) -> None:
    """Install the NPU compiler at PATH (a folder holding libopenvino_intel_npu_compiler*.so)
    where this OpenVINO loads it, then compile a tiny model for each NPU platform."""
    from farm import npu  # OpenVINO: only for this command

    report = npu.install(path, into)

    def human() -> None:
        out.print(f"installed {', '.join(report.installed)} into {report.libs_dir}", markup=False)
        out.print(f"VCL API {report.vcl_api}")
        for target, result in report.platforms.items():
            out.print(f"{target:9} {result}", markup=False)

    emit(
        {
            "libs_dir": str(report.libs_dir),
            "installed": report.installed,
            "vcl_api": report.vcl_api,
            "platforms": report.platforms,
            "compiled": report.compiled,
        },
        as_json,
        human,
    )
