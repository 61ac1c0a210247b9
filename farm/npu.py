"""Installing an NPU compiler a user supplies, where this OpenVINO loads it, and proving it.

The Linux `openvino` wheel ships the NPU plugin but no compiler (docs/openvino.md, "NPU
compile"). The plugin loads `libopenvino_intel_npu_compiler_loader.so` from its own folder,
and the loader loads `libopenvino_intel_npu_compiler.so` (the VCL compiler API) beside it. Both
come with the OpenVINO Linux archive (`runtime/lib/intel64/`) and with Intel's
`intel-driver-compiler-npu` package (`/usr/lib/x86_64-linux-gnu/`); `toolchain.COMPILER_SOURCES`
says so wherever a compile is refused for want of them.

`install` proves where the files came from before it runs a byte of them, and installs the very
bytes it checked:
1. the folder it installs into must be a folder no one else may write (else anyone could
   swap the compiler afterwards), that this user may write;
2. each file is read once, hashed while it is copied to a fresh temporary name in that folder;
   the digest of those bytes must be one the user gave (``--sha256``) or one listed for a known
   release (`KNOWN_COMPILERS`), unless the user says to trust an unlisted file
   (``--trust-unlisted``): a file refused here is never loaded, anywhere;
3. the copies (not the source paths, which may have changed since) must be ELF shared objects,
   and the compiler must export the VCL entry points and answer `vclGetVersion`, asked in a
   throwaway child process (loading a library runs its code; never in this process);
4. the copies are renamed into place, then a one-op model is compiled for every NPU platform in
   a fresh process, with `NPU_PLATFORM` set (which makes the plugin compile without a device).
If no platform compiles, every file is put back as it was: nothing is left half-installed. Two
installs into one folder take turns (an exclusive lock on the folder), so neither probes or puts
back the other's files.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
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
KNOWN_COMPILERS = Path(__file__).with_name("npu_compilers.json")
"""sha256 of the NPU compiler libraries of known releases (shipped with farm; see its
``about``). Empty today: no vendor-published digest was at hand."""
_COPY_CHUNK = 1 << 20


class NotACompiler(FarmError):
    """A file given as the NPU compiler that is not one (not a library, no VCL entry points)."""

    kind, code = Kind.BAD_INPUT, "not_an_npu_compiler"


class UntrustedCompiler(FarmError):
    """An NPU compiler file whose digest neither the user gave nor a known release lists."""

    kind, code = Kind.UNTRUSTED, "untrusted_npu_compiler"


@dataclass
class InstallReport:
    libs_dir: Path
    installed: list[str]
    vcl_api: str
    """The compiler's VCL API version, as `vclGetVersion` answers."""
    sha256: dict[str, str] = field(default_factory=dict)
    """File name → the sha256 of the bytes installed."""
    provenance: str = ""
    """Why those bytes were trusted: the digests given, a known release, or trusted unlisted."""
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


_VCL_PROBE = """
import ctypes, json, sys
class Version(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint16), ("minor", ctypes.c_uint16)]
try:
    library = ctypes.CDLL(sys.argv[1])
except OSError as error:
    print(json.dumps({"error": f"cannot be loaded as a library: {error}"})); sys.exit()
absent = [name for name in sys.argv[2:] if not hasattr(library, name)]
if absent:
    print(json.dumps({"absent": absent})); sys.exit()
version, profiling = Version(), Version()
result = library.vclGetVersion(ctypes.byref(version), ctypes.byref(profiling))
print(json.dumps({"result": result, "version": f"{version.major}.{version.minor}"}))
"""
"""Asks a library for its VCL API version, in a process of its own (loading it runs its code)."""


def vcl_version(compiler: Path) -> str:
    """`major.minor` of the VCL API `compiler` implements, asked in a throwaway child process
    (never loaded into this one); NotACompiler when it is none."""
    _check_elf(compiler)
    done = subprocess.run(
        [sys.executable, "-I", "-c", _VCL_PROBE, str(compiler), *VCL_SYMBOLS],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        last = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        raise NotACompiler(f"{compiler}: the process that loaded it failed: {last}")
    answer = json.loads(lines[-1])
    if "error" in answer:
        raise NotACompiler(f"{compiler} {answer['error']}")
    if "absent" in answer:
        raise NotACompiler(
            f"{compiler} is a library but not an NPU compiler: it does not export "
            f"{', '.join(answer['absent'])}"
        )
    if answer["result"] != 0:
        raise NotACompiler(
            f"{compiler}: vclGetVersion failed with 0x{answer['result'] & 0xFFFFFFFF:x}"
        )
    return str(answer["version"])


def known_digests() -> dict[str, str]:
    """sha256 → "<release> <file name>" of the libraries of known releases (KNOWN_COMPILERS)."""
    listed: dict[str, str] = {}
    for release in json.loads(KNOWN_COMPILERS.read_text())["releases"]:
        for name, digest in release["files"].items():
            listed[digest.lower()] = f"{release['name']} {name}"
    return listed


def install(
    source: Path,
    libs_dir: Path | None = None,
    *,
    sha256: Iterable[str] = (),
    trust_unlisted: bool = False,
) -> InstallReport:
    """Put the compiler at `source` where this OpenVINO loads it (`libs_dir`, by default the
    `openvino` package's own), then compile a one-op model for each NPU platform (the module's
    steps). Each file's bytes must have a digest in `sha256` or in `known_digests`, unless
    `trust_unlisted`: UntrustedCompiler otherwise, before any of it is loaded. Raises
    NotACompiler for a file that is not a compiler, and CompilerUnavailable, with every file
    restored, when no platform compiles with it."""
    libs_dir = _checked_destination(libs_dir or openvino_libs())
    libraries = find_libraries(Path(source))
    with _alone_in(libs_dir):
        return _install(source, libs_dir, libraries, sha256, trust_unlisted)


@contextmanager
def _alone_in(folder: Path) -> Iterator[None]:
    """Held while this process installs into `folder`: a second install there waits."""
    handle = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield
    finally:
        os.close(handle)


def _install(
    source: Path,
    libs_dir: Path,
    libraries: dict[str, Path],
    sha256: Iterable[str],
    trust_unlisted: bool,
) -> InstallReport:
    given = {digest.strip().lower() for digest in sha256}
    staged: dict[str, Path] = {}
    try:
        digests = {
            name: _copy_hashed(path, libs_dir, name, staged) for name, path in libraries.items()
        }
        provenance = _provenance(digests, given, trust_unlisted)
        for path in staged.values():
            _check_elf(path)
        compiler = next(path for name, path in staged.items() if name != NPU_COMPILER_LIBRARY)
        vcl_api = vcl_version(compiler)
        placement = _Placement(staged, libs_dir)
    finally:
        for path in staged.values():
            path.unlink(missing_ok=True)  # renamed into place, or refused
    report = InstallReport(libs_dir, sorted(libraries), vcl_api, digests, provenance)
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


def _checked_destination(libs_dir: Path) -> Path:
    """`libs_dir`, resolved, once it is a folder this user may write and no one else may."""
    real = libs_dir.resolve()
    try:
        info = os.stat(real)
    except OSError as error:
        raise CompilerUnavailable(f"cannot install into {libs_dir}: {error.strerror}") from None
    if not stat.S_ISDIR(info.st_mode):
        raise CompilerUnavailable(f"cannot install into {libs_dir}: not a folder")
    if info.st_mode & 0o022 or info.st_uid not in (0, os.geteuid()):
        raise CompilerUnavailable(
            f"refusing to install into {real}: other users may write it "
            f"(mode {stat.filemode(info.st_mode)}, owner uid {info.st_uid}), so they could "
            "replace the compiler afterwards; install into a folder only you (or root) may write"
        )
    if not os.access(real, os.W_OK):
        raise CompilerUnavailable(f"cannot write into {real}: permission denied")
    return real


def _copy_hashed(source: Path, libs_dir: Path, name: str, staged: dict[str, Path]) -> str:
    """Copy `source` (read once) to a fresh temporary name in `libs_dir`, recorded in `staged`
    under `name`; returns the sha256 of the bytes copied."""
    digest = hashlib.sha256()
    try:
        reader = open(source, "rb")  # noqa: SIM115 (closed below)
    except OSError as error:
        raise NotACompiler(f"{source}: {error.strerror}") from None
    with reader:
        if not stat.S_ISREG(os.fstat(reader.fileno()).st_mode):
            raise NotACompiler(f"{source} is not a regular file")
        handle, temporary = tempfile.mkstemp(dir=libs_dir, prefix=f".{name}.farm-partial.")
        staged[name] = Path(temporary)
        with os.fdopen(handle, "wb") as writer:
            while chunk := reader.read(_COPY_CHUNK):
                digest.update(chunk)
                writer.write(chunk)
    return digest.hexdigest()


def _provenance(digests: dict[str, str], given: set[str], trust_unlisted: bool) -> str:
    """Why the files whose bytes have `digests` may be installed; UntrustedCompiler if not."""
    known = known_digests()
    unknown = {name: d for name, d in digests.items() if d not in given and d not in known}
    if unknown and not trust_unlisted:
        listed = ", ".join(f"{name} {digest}" for name, digest in sorted(unknown.items()))
        raise UntrustedCompiler(
            f"refusing to install or load an NPU compiler whose origin is not proven: {listed} "
            "match no --sha256 given and no known release (farm/npu_compilers.json). Pass "
            "--sha256 with the digests your vendor publishes for these files, or "
            "--trust-unlisted if you trust these files as they are"
        )
    unused = given - set(digests.values())
    if unused:
        raise UntrustedCompiler(
            f"--sha256 {', '.join(sorted(unused))} matches none of the files given "
            f"({', '.join(f'{n} {d}' for n, d in sorted(digests.items()))})"
        )
    if unknown:
        return "trusted unlisted (--trust-unlisted)"
    if all(d in given for d in digests.values()):
        return "digests given (--sha256)"
    return "known release: " + "; ".join(sorted({known[d] for d in digests.values() if d in known}))


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
    """Checked copies (`staged`, temporary names in `libs_dir`) renamed into place, so OpenVINO
    never sees half a file, keeping the files they replace until `keep`."""

    def __init__(self, staged: dict[str, Path], libs_dir: Path) -> None:
        self.placed: list[tuple[Path, Path | None]] = []
        try:
            for name, copy in staged.items():
                target = libs_dir / name
                backup = None
                if os.path.lexists(target):
                    backup = target.with_name(f".{name}.farm-backup")
                    os.replace(target, backup)
                self.placed.append((target, backup))
                os.chmod(copy, 0o755)
                os.replace(copy, target)
        except OSError as error:
            self.undo()
            raise CompilerUnavailable(f"cannot write into {libs_dir}: {error}") from None

    def undo(self) -> None:
        """Every file as it was before."""
        for target, backup in reversed(self.placed):
            target.unlink(missing_ok=True)
            if backup is not None:
                os.replace(backup, target)

    def keep(self) -> None:
        for _, backup in self.placed:
            if backup is not None:
                backup.unlink(missing_ok=True)
