"""OpenVINO facts about this host: its release, the toolchain it records for a target, the
properties a compile spec means, which targets it can compile, and why a compile failed.

Imports OpenVINO and farm's core only: workers, submitters and edges (a fallback compile) all
use it. The facts behind it are measured in docs/openvino.md.
"""

from __future__ import annotations

import os
import re
import tempfile
from functools import cache
from pathlib import Path

import numpy as np
import openvino as ov
from openvino import opset13 as ops

from farm.core.blobformat import read_header
from farm.core.checks import Check
from farm.core.errors import CompileError, CompilerUnavailable
from farm.core.spec import KNOWN_TARGETS, CompileSpec, Target, Toolchain, compile_properties

NPU_COMPILER_LIBRARY = "libopenvino_intel_npu_compiler_loader.so"
"""What the NPU plugin loads from its own folder; it loads the compiler beside it."""
COMPILER_SOURCES = (
    "the NPU compiler (libopenvino_intel_npu_compiler_loader.so and "
    "libopenvino_intel_npu_compiler.so) is not in the Linux openvino wheel: take both from the "
    "OpenVINO Linux archive (runtime/lib/intel64/) or from Intel's intel-driver-compiler-npu "
    "package (/usr/lib/x86_64-linux-gnu/), then `farm toolchain install-npu-compiler PATH` "
    "puts them where this OpenVINO loads them ({libs})"
)
"""Where an NPU compiler comes from, for every message that says one is missing."""


def openvino_libs() -> Path:
    """The folder this OpenVINO loads its plugins (and the NPU compiler loader) from."""
    return Path(ov.__file__).parent / "libs"


def openvino_release() -> str:
    """``2026.4.1`` from the full build string ``2026.4.1-22982-e213a147257-releases/2026/4``."""
    return ov.get_version().split("-", 1)[0]


def toolchain_of(
    compiled: ov.CompiledModel, target: Target, cache_entry: Path | None = None
) -> Toolchain:
    """The toolchain facts of a compiled model, read back from OpenVINO.

    A CPU blob imports only where its runtime requirements match. OpenVINO 2026 reports them
    (`RUNTIME_REQUIREMENTS`: version and ISA); older releases do not have the property, and
    their CPU plugin checks only the OpenVINO build a cache entry was written by: then the
    requirements are the `runtime_info` of the cache entry's header (`cache_entry`), which is
    what that OpenVINO itself compares (docs/openvino.md, "Releases")."""
    npu_compiler = None
    runtime_requirements = None
    if target.is_npu:
        npu_compiler = str(property_or_none(compiled, "NPU_COMPILER_VERSION"))
    else:
        reported = property_or_none(compiled, "RUNTIME_REQUIREMENTS")
        if reported is None and cache_entry is not None:
            reported = read_header(cache_entry).attributes.get("runtime_info")
        if reported is None:
            raise CompileError(
                f"OpenVINO {ov.get_version()} reports no RUNTIME_REQUIREMENTS for CPU and no "
                f"cache entry was written to read them from"
            )
        runtime_requirements = str(reported)
    return Toolchain(
        openvino=openvino_release(),
        openvino_build=ov.get_version(),
        npu_compiler=npu_compiler,
        runtime_requirements=runtime_requirements,
    )


@cache
def host_toolchain(target: Target) -> Toolchain:
    """The toolchain this host would record for `target`, without compiling the user's model.

    For CPU this compiles a one-op model to learn the RUNTIME_REQUIREMENTS string (the
    COMPATIBILITY_CHECK property raises TypeError in the 2026.4 Python binding).
    """
    if target.is_npu:
        return Toolchain(openvino=openvino_release(), openvino_build=ov.get_version())
    compiled = ov.Core().compile_model(tiny_model(), "CPU")
    if property_or_none(compiled, "RUNTIME_REQUIREMENTS") is not None:
        return toolchain_of(compiled, target)
    # An older release: its requirements are in the header of the cache entry it writes.
    with tempfile.TemporaryDirectory(prefix="farm-toolchain-") as folder:
        entry = Path(folder) / "probe.blob"
        compiled = ov.Core().compile_model(
            tiny_model(), "CPU", cache_properties(Path(folder), "probe")
        )
        return toolchain_of(compiled, target, written_blob(Path(folder), entry))


@cache
def names_cache_entries() -> bool:
    """Whether this OpenVINO takes `CACHE_BLOB_ID` (2026 does; 2025.4 refuses the property and
    names a cache entry after its own hash of the model)."""
    with tempfile.TemporaryDirectory(prefix="farm-probe-") as folder:
        try:
            ov.Core().compile_model(
                tiny_model(), "CPU", {"CACHE_DIR": folder, "CACHE_BLOB_ID": "probe"}
            )
        except Exception as error:
            if "CACHE_BLOB_ID" in str(error):
                return False
            raise
    return True


def cache_properties(folder: Path, blob_id: str) -> dict[str, str]:
    """Properties that make OpenVINO write the compiled blob into `folder`, as `<blob_id>.blob`
    where this release can name it (see `written_blob`)."""
    properties = {"CACHE_DIR": str(folder)}
    if names_cache_entries():
        properties["CACHE_BLOB_ID"] = blob_id
    return properties


def written_blob(folder: Path, wanted: Path) -> Path:
    """The cache entry OpenVINO wrote into `folder` (an empty folder before the compile),
    renamed to `wanted` when this release chose its own name."""
    if wanted.is_file():
        return wanted
    written = sorted(folder.glob("*.blob"))
    if len(written) != 1:
        raise CompileError(f"OpenVINO compiled but wrote {len(written)} blobs into {folder}")
    written[0].replace(wanted)
    return wanted


@cache
def unavailable_reason(target: Target) -> str | None:
    """None if this host compiles for `target`, else why not (a tiny model, the real compiler)."""
    props = compile_properties(CompileSpec.create(target))
    try:
        ov.Core().compile_model(tiny_model(), device_name(target), props)
    except Exception as error:
        return str(classify_failure(target, error))
    return None


def probe_targets() -> dict[str, str | None]:
    """Which targets this host can compile: target name → None if it can, else the reason."""
    return {name: unavailable_reason(Target.parse(name)) for name in KNOWN_TARGETS}


def device_name(target: Target) -> str:
    # NPU_PLATFORM selects the platform; the device name stays "NPU" so no device is required.
    return target.device


def classify_failure(target: Target, error: Exception) -> CompileError | CompilerUnavailable:
    """Classify an OpenVINO compile exception: the host's fault or the model's."""
    text = str(error)
    if target.is_npu:
        if "compiler loading failed" in text.lower() and "Cannot load library" not in text:
            # The library is there, but it is not a compiler this plugin can drive (missing
            # VCL entry points, another API version): say what it said.
            return CompilerUnavailable(
                f"cannot compile for {target}: the NPU compiler in {openvino_libs()} does not "
                f"work with this OpenVINO ({ov.get_version()}): {last_line(error)}"
            )
        if NPU_COMPILER_LIBRARY in text or "compiler loading failed" in text.lower():
            library = re.search(r'Cannot load library "([^"]+)"', text)
            where = os.path.normpath(library.group(1)) if library else NPU_COMPILER_LIBRARY
            return CompilerUnavailable(
                f"cannot compile for {target}: the NPU compiler library {NPU_COMPILER_LIBRARY} "
                f"is missing (looked for {where}); "
                + COMPILER_SOURCES.format(libs=openvino_libs())
                + ", or run this job on a host that has it"
            )
        if "Could not find an NPU device" in text:
            return CompilerUnavailable(
                f"cannot compile for {target}: no NPU device, which the driver compiler "
                f"(NPU_COMPILER_TYPE=DRIVER) requires. Use the plugin compiler "
                f"(NPU_COMPILER_TYPE=PLUGIN, library {NPU_COMPILER_LIBRARY}) on this host."
            )
    return CompileError(f"OpenVINO failed to compile for {target}: {last_line(error)}")


def tiny_model() -> ov.Model:
    data = ops.parameter([1, 8], ov.Type.f32, name="x")
    weights = ops.constant(np.ones((8, 8), dtype=np.float32))
    return ov.Model([ops.relu(ops.matmul(data, weights, False, False))], [data], "farm_probe")


def property_or_none(compiled: ov.CompiledModel, name: str) -> object | None:
    """A compiled model's property, or None where its plugin has no such property."""
    try:
        return compiled.get_property(name)
    except Exception:
        return None


def last_line(error: Exception) -> str:
    """OpenVINO errors carry a C++ stack of 'Exception from ...' lines; keep the message."""
    lines = [
        line.strip()
        for line in str(error).splitlines()
        if line.strip() and not line.startswith("Exception from")
    ]
    message = " ".join(lines) or type(error).__name__
    return re.sub(r"Check '.*?' failed at \S+:\d+:\s*", "", message)


def openvino_checks() -> list[Check]:
    """`farm doctor`'s view of this host: OpenVINO, devices, NPU libraries, compilable targets."""
    libs = openvino_libs()
    checks = [
        Check("openvino", True, ov.get_version()),
        Check("devices", True, ", ".join(ov.Core().available_devices) or "none"),
    ]
    sources = COMPILER_SOURCES.format(libs=libs)
    said = False  # where an NPU compiler comes from: said once, not once per platform
    for library in ("libopenvino_intel_npu_plugin.so", NPU_COMPILER_LIBRARY):
        found = (libs / library).exists()
        missing = "missing"
        if library == NPU_COMPILER_LIBRARY and not found:
            missing, said = f"missing: {sources}", True
        checks.append(Check(library, found, str(libs / library) if found else missing))
    for target, reason in probe_targets().items():
        if reason and sources in reason:
            if said:
                reason = reason.replace(f"; {sources}", "; where to get it is said above")
            said = True
        checks.append(Check(f"compile {target}", reason is None, reason or "compiles here"))
    return checks


def npu_compiler_versions() -> dict[str, str]:
    """For each NPU platform: "ok <NPU_COMPILER_VERSION>" when a one-op model compiles with
    `NPU_PLATFORM` set (no device needed), else the reason it does not."""
    results = {}
    for name in KNOWN_TARGETS:
        target = Target.parse(name)
        if not target.is_npu:
            continue
        props = compile_properties(CompileSpec.create(target))
        try:
            compiled = ov.Core().compile_model(tiny_model(), device_name(target), props)
        except Exception as error:
            results[name] = str(classify_failure(target, error))
            continue
        results[name] = f"ok {property_or_none(compiled, 'NPU_COMPILER_VERSION')}"
    return results
