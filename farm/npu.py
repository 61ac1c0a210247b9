"""Installing an NPU compiler a user supplies, where this OpenVINO loads it, and proving it.

The Linux `openvino` wheel ships the NPU plugin but no compiler (docs/openvino.md, "NPU
compile"). The plugin loads `libopenvino_intel_npu_compiler_loader.so` from its own folder,
and the loader loads `libopenvino_intel_npu_compiler.so` (the VCL compiler API) beside it. Both
come with the OpenVINO Linux archive (`runtime/lib/intel64/`) and with Intel's
`intel-driver-compiler-npu` package (`/usr/lib/x86_64-linux-gnu/`); `toolchain.COMPILER_SOURCES`
says so wherever a compile is refused for want of them.

`install` checks each file before anything is copied (an ELF shared object; the compiler must
export the VCL entry points and answer `vclGetVersion`), copies them in under temporary names,
renames them into place, then compiles a one-op model for every NPU platform in a fresh
process, with `NPU_PLATFORM` set (which makes the plugin compile without a device). If no
platform compiles, every file is put back as it was: nothing is left half-installed.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from farm.core.errors import CompilerUnavailable, FarmError, Kind
from farm.toolchain import NPU_COMPILER_LIBRARY, openvino_libs

COMPILER = "libopenvino_intel_npu_compiler.so"
"""The VCL compiler the loader loads (older Intel packages: `libnpu_driver_compiler.so`)."""
COMPILER_NAMES = (COMPILER, "libnpu_driver_compiler.so")
VCL_SYMBOLS = ("vclGetVersion", "vclCompilerCreate", "vclCompilerDestroy")
"""Entry points every VCL compiler exports (the plugin resolves them by name)."""
ELF_MAGIC = b"\x7fELF"


class NotACompiler(FarmError):
    """A file given as the NPU compiler that is not one (not a library, no VCL entry points)."""

    kind, code = Kind.BAD_INPUT, "not_an_npu_compiler"


class _VclVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint16), ("minor", ctypes.c_uint16)]


@dataclass
class InstallReport:
    libs_dir: Path
    installed: list[str]
    vcl_api: str
    """The compiler's VCL API version, as `vclGetVersion` answers."""
    platforms: dict[str, str] = field(default_factory=dict)
    """Target → the NPU compiler version a compile reported, or why it failed."""
    compiled: list[str] = field(default_factory=list)


def find_libraries(source: Path) -> dict[str, Path]:
    """The loader and the compiler in `source` (a folder, or either file beside the other)."""
    folder = source if source.is_dir() else source.parent
    if not folder.exists():
        raise NotACompiler(f"{source} does not exist")
    loader = folder / NPU_COMPILER_LIBRARY
    compiler = next((folder / name for name in COMPILER_NAMES if (folder / name).exists()), None)
    missing = [
        name
        for name, path in ((NPU_COMPILER_LIBRARY, loader), (COMPILER, compiler))
        if path is None or not path.exists()
    ]
    if missing:
        raise NotACompiler(
            f"{folder} lacks {' and '.join(missing)}; give the folder that holds both "
            f"(the OpenVINO Linux archive's runtime/lib/intel64, or /usr/lib/x86_64-linux-gnu "
            f"after installing intel-driver-compiler-npu)"
        )
    assert compiler is not None
    return {NPU_COMPILER_LIBRARY: loader, compiler.name: compiler}


def vcl_version(compiler: Path) -> str:
    """`major.minor` of the VCL API `compiler` implements; NotACompiler when it is none."""
    _check_elf(compiler)
    try:
        library = ctypes.CDLL(str(compiler))
    except OSError as error:
        raise NotACompiler(f"{compiler} cannot be loaded as a library: {error}") from None
    absent = [name for name in VCL_SYMBOLS if not hasattr(library, name)]
    if absent:
        raise NotACompiler(
            f"{compiler} is a library but not an NPU compiler: it does not export "
            f"{', '.join(absent)}"
        )
    version, profiling = _VclVersion(), _VclVersion()
    result = library.vclGetVersion(ctypes.byref(version), ctypes.byref(profiling))
    if result != 0:
        raise NotACompiler(f"{compiler}: vclGetVersion failed with 0x{result & 0xFFFFFFFF:x}")
    return f"{version.major}.{version.minor}"


def install(source: Path, libs_dir: Path | None = None) -> InstallReport:
    """Put the compiler at `source` where this OpenVINO loads it (`libs_dir`, by default the
    `openvino` package's own), then compile a one-op model for each NPU platform. Raises
    NotACompiler before copying anything that is not a compiler, and CompilerUnavailable,
    with every file restored, when no platform compiles with it."""
    libs_dir = libs_dir or openvino_libs()
    libraries = find_libraries(Path(source))
    for path in libraries.values():
        _check_elf(path)
    compiler = next(path for name, path in libraries.items() if name != NPU_COMPILER_LIBRARY)
    report = InstallReport(libs_dir, sorted(libraries), vcl_version(compiler))
    placement = _Placement(libraries, libs_dir)
    try:
        report.platforms = probe_npu_platforms()
    except Exception:
        placement.undo()
        raise
    report.compiled = [t for t, result in report.platforms.items() if result.startswith("ok ")]
    if not report.compiled:
        placement.undo()
        reasons = "; ".join(f"{target}: {why}" for target, why in report.platforms.items())
        raise CompilerUnavailable(
            f"the NPU compiler from {source} compiled for no NPU platform, so it was not "
            f"installed (nothing in {libs_dir} changed): {reasons}"
        )
    placement.keep()
    return report


def probe_npu_platforms() -> dict[str, str]:
    """Compile a one-op model for each NPU platform in a fresh process (OpenVINO keeps a loaded
    plugin for the life of a process): target → "ok <compiler version>" or the reason."""
    script = (
        "import json\n"
        "from farm import toolchain\n"
        "print(json.dumps(toolchain.npu_compiler_versions()))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=600, check=False
    )
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise CompilerUnavailable(f"the NPU probe process failed ({done.returncode}): {last}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _check_elf(path: Path) -> None:
    try:
        with open(path, "rb") as stream:
            magic = stream.read(4)
    except OSError as error:
        raise NotACompiler(f"{path}: {error.strerror}") from None
    if magic != ELF_MAGIC:
        raise NotACompiler(f"{path} is not a shared library (no ELF header)")


class _Placement:
    """Libraries copied into `libs_dir`, each under a temporary name first and then renamed
    (OpenVINO never sees half a file), keeping the files they replace until `keep`."""

    def __init__(self, libraries: dict[str, Path], libs_dir: Path) -> None:
        self.placed: list[tuple[Path, Path | None]] = []
        try:
            for name, path in libraries.items():
                target = libs_dir / name
                backup = None
                if target.exists():
                    backup = target.with_name(f".{name}.farm-backup")
                    os.replace(target, backup)
                self.placed.append((target, backup))
                partial = target.with_name(f".{name}.farm-partial")
                shutil.copyfile(path, partial)
                os.chmod(partial, 0o755)
                os.replace(partial, target)
        except OSError as error:
            self.undo()
            raise CompilerUnavailable(f"cannot write into {libs_dir}: {error}") from None

    def undo(self) -> None:
        """Every file as it was before."""
        for target, backup in reversed(self.placed):
            target.unlink(missing_ok=True)
            target.with_name(f".{target.name}.farm-partial").unlink(missing_ok=True)
            if backup is not None:
                os.replace(backup, target)

    def keep(self) -> None:
        for _, backup in self.placed:
            if backup is not None:
                backup.unlink(missing_ok=True)
