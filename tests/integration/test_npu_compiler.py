"""Installing an NPU compiler, tested here up to the compiler: no NPU compiler exists on these
machines, so the libraries below are real shared objects built by the test (one that is not a
compiler, one that speaks the VCL API but cannot compile), installed where this OpenVINO loads
them, refused, and taken back out: nothing is left half-installed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from farm import toolchain
from farm.core.errors import CompilerUnavailable
from farm.npu import COMPILER, NotACompiler, install, vcl_version
from farm.toolchain import NPU_COMPILER_LIBRARY

NOT_A_COMPILER = "int farm_test_answer(void) { return 42; }\n"
VCL_THAT_CANNOT_COMPILE = """
#include <stdint.h>
typedef struct { uint16_t major; uint16_t minor; } vcl_version_info_t;
int vclGetVersion(vcl_version_info_t *compiler, vcl_version_info_t *profiling) {
    compiler->major = 7; compiler->minor = 4; profiling->major = 1; profiling->minor = 0;
    return 0;
}
int vclCompilerCreate(void *desc, void *properties, void **compiler, void *log) {
    return 0x78000001;  /* VCL_RESULT_ERROR_UNKNOWN */
}
int vclCompilerDestroy(void *compiler) { return 0; }
"""


def _library(folder: Path, source: str) -> Path:
    """Both files a compiler needs (the loader and the compiler), built from `source`."""
    folder.mkdir(parents=True)
    if shutil.which("gcc") is None:
        pytest.skip("gcc builds the test libraries")
    c = folder / "lib.c"
    c.write_text(source)
    built = folder / COMPILER
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(built), str(c)], check=True)
    shutil.copyfile(built, folder / NPU_COMPILER_LIBRARY)
    return folder


def _listing(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in folder.iterdir()}


def _farm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "farm", *args], capture_output=True, text=True, timeout=600
    )


def test_a_file_that_is_not_a_library_is_refused_before_anything_is_copied(tmp_path):
    folder = tmp_path / "junk"
    folder.mkdir()
    (folder / NPU_COMPILER_LIBRARY).write_text("not a library")
    (folder / COMPILER).write_text("not a library")
    libs = toolchain.openvino_libs()
    before = _listing(libs)
    done = _farm("toolchain", "install-npu-compiler", str(folder))
    assert done.returncode == 2, done.stderr
    assert "is not a shared library (no ELF header)" in done.stderr
    assert _listing(libs) == before


def test_a_library_without_the_vcl_api_is_not_a_compiler(tmp_path):
    folder = _library(tmp_path / "plain", NOT_A_COMPILER)
    with pytest.raises(NotACompiler, match="not an NPU compiler: it does not export vclGetVersion"):
        vcl_version(folder / COMPILER)
    libs = toolchain.openvino_libs()
    before = _listing(libs)
    done = _farm("toolchain", "install-npu-compiler", str(folder), "--json")
    assert done.returncode == 2 and "does not export" in done.stderr
    assert _listing(libs) == before


def test_a_folder_missing_the_loader_names_what_to_bring(tmp_path):
    folder = _library(tmp_path / "half", VCL_THAT_CANNOT_COMPILE)
    (folder / NPU_COMPILER_LIBRARY).unlink()
    with pytest.raises(NotACompiler, match=f"lacks {NPU_COMPILER_LIBRARY}.*runtime/lib/intel64"):
        install(folder)


def test_a_compiler_that_compiles_for_no_platform_is_taken_back_out(tmp_path):
    """Installed where this OpenVINO loads it, probed for real (a compile per NPU platform in a
    fresh process), refused, and every file put back as it was."""
    folder = _library(tmp_path / "vcl", VCL_THAT_CANNOT_COMPILE)
    assert vcl_version(folder / COMPILER) == "7.4"
    libs = toolchain.openvino_libs()
    before = _listing(libs)
    try:
        with pytest.raises(CompilerUnavailable) as refused:
            install(folder)
        message = str(refused.value)
        assert "compiled for no NPU platform, so it was not installed" in message
        for platform in ("NPU.3720", "NPU.4000", "NPU.5010", "NPU.5020"):
            assert f"{platform}: " in message
        # OpenVINO loaded it and said why it cannot drive it (a missing VCL entry point).
        assert "does not work with this OpenVINO" in message
    finally:
        # Belt and braces: whatever happened, this machine's OpenVINO keeps no test library.
        for name in (NPU_COMPILER_LIBRARY, COMPILER):
            if name not in before:
                (libs / name).unlink(missing_ok=True)
    assert _listing(libs) == before
    # And the host still says where a compiler comes from.
    doctor = json.loads(_farm("doctor", "--json").stdout)
    (loader,) = [c for c in doctor if c["check"] == NPU_COMPILER_LIBRARY]
    assert not loader["ok"] and "intel-driver-compiler-npu" in loader["detail"]
    assert "install-npu-compiler" in loader["detail"]


def test_into_another_folder_checks_that_openvino_loads_it_from_there(tmp_path):
    """`--into` a folder OpenVINO does not load from: the probe cannot find the compiler there,
    so nothing stays in that folder either, and an older file in it is restored."""
    folder = _library(tmp_path / "vcl", VCL_THAT_CANNOT_COMPILE)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / COMPILER).write_bytes(b"the older one")
    done = _farm("toolchain", "install-npu-compiler", str(folder), "--into", str(elsewhere))
    assert done.returncode == 4, done.stderr  # cannot compile here: the README's exit code 4
    assert _listing(elsewhere) == {COMPILER: len(b"the older one")}
    assert (elsewhere / COMPILER).read_bytes() == b"the older one"
    assert not any(name.startswith(".") for name in os.listdir(elsewhere))
