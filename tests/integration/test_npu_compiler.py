"""Installing an NPU compiler, tested here up to the compiler: no NPU compiler exists on these
machines, so the libraries below are real shared objects built by the test (one that is not a
compiler, one that speaks the VCL API but cannot compile, one that leaves a mark when loaded),
installed where this OpenVINO loads them, refused, and taken back out: nothing is left
half-installed. None of them is an NPU compiler, and none compiles anything for an NPU."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from farm import npu
from farm.core.errors import CompilerUnavailable
from farm.core.hashing import sha256_file
from farm.npu import COMPILER, NotACompiler, UntrustedCompiler, install, vcl_version
from farm.toolchain import NPU_COMPILER_LIBRARY

# Some of these tests put a library into OpenVINO's own folder (in the checkout's .venv) and
# take it out again, and others list that folder: one process runs them all, with the other
# tests that write under the checkout.
pytestmark = pytest.mark.xdist_group("checkout")

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


def _digests(folder: Path) -> list[str]:
    return [sha256_file(folder / name) for name in (NPU_COMPILER_LIBRARY, COMPILER)]


def _listing(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in folder.iterdir()}


def _farm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "farm", *args], capture_output=True, text=True, timeout=600
    )


def test_a_file_that_is_not_a_library_is_refused_before_anything_is_copied(
    tmp_path, openvino_libs_alone
):
    folder = tmp_path / "junk"
    folder.mkdir()
    (folder / NPU_COMPILER_LIBRARY).write_text("not a library")
    (folder / COMPILER).write_text("not a library")
    libs = openvino_libs_alone
    before = _listing(libs)
    done = _farm("toolchain", "install-npu-compiler", str(folder), "--trust-unlisted")
    assert done.returncode == 2, done.stderr
    assert "is not a shared library (no ELF header)" in done.stderr
    assert _listing(libs) == before


def test_a_library_without_the_vcl_api_is_not_a_compiler(tmp_path, openvino_libs_alone):
    folder = _library(tmp_path / "plain", NOT_A_COMPILER)
    with pytest.raises(NotACompiler, match="not an NPU compiler: it does not export vclGetVersion"):
        vcl_version(folder / COMPILER)
    libs = openvino_libs_alone
    before = _listing(libs)
    done = _farm("toolchain", "install-npu-compiler", str(folder), "--json", "--trust-unlisted")
    assert done.returncode == 2 and "does not export" in done.stderr
    assert _listing(libs) == before


def test_a_folder_missing_the_loader_names_what_to_bring(tmp_path):
    folder = _library(tmp_path / "half", VCL_THAT_CANNOT_COMPILE)
    (folder / NPU_COMPILER_LIBRARY).unlink()
    with pytest.raises(NotACompiler, match=f"lacks {NPU_COMPILER_LIBRARY}.*runtime/lib/intel64"):
        install(folder)


def test_a_compiler_that_compiles_for_no_platform_is_taken_back_out(tmp_path, openvino_libs_alone):
    """Installed where this OpenVINO loads it, probed for real (a compile per NPU platform in a
    fresh process), refused, and every file put back as it was."""
    folder = _library(tmp_path / "vcl", VCL_THAT_CANNOT_COMPILE)
    assert vcl_version(folder / COMPILER) == "7.4"
    libs = openvino_libs_alone
    before = _listing(libs)
    try:
        with pytest.raises(CompilerUnavailable) as refused:
            install(folder, sha256=_digests(folder))
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
    done = _farm(
        "toolchain",
        "install-npu-compiler",
        str(folder),
        "--into",
        str(elsewhere),
        "--trust-unlisted",
    )
    assert done.returncode == 4, done.stderr  # cannot compile here: the README's exit code 4
    assert _listing(elsewhere) == {COMPILER: len(b"the older one")}
    assert (elsewhere / COMPILER).read_bytes() == b"the older one"
    assert not any(name.startswith(".") for name in os.listdir(elsewhere))


# --- provenance: what is installed is what was checked, and nothing unproven is ever loaded ----

MARKS_WHEN_LOADED = """
#include <stdio.h>
#include <unistd.h>
__attribute__((constructor)) static void loaded(void) {
    FILE *mark = fopen(MARK, "a");
    if (mark) { fprintf(mark, "%d\\n", (int)getpid()); fclose(mark); }
}
int farm_test_answer(void) { return 42; }
"""
"""Not an NPU compiler: a library that writes the pid of whatever process loads it to MARK."""


def _marking_library(folder: Path, mark: Path) -> Path:
    return _library(folder, f'#define MARK "{mark}"\n' + MARKS_WHEN_LOADED)


def _private_folder(path: Path) -> Path:
    path.mkdir(mode=0o755)
    return path


def test_an_unproven_library_is_refused_before_any_of_it_runs(tmp_path):
    mark = tmp_path / "loaded"
    folder = _marking_library(tmp_path / "lib", mark)
    libs = _private_folder(tmp_path / "libs")
    done = _farm("toolchain", "install-npu-compiler", str(folder), "--into", str(libs))
    assert done.returncode == 8, done.stderr  # untrusted: the README's exit code 8
    assert "origin is not proven" in done.stderr and "--sha256" in done.stderr
    assert sha256_file(folder / COMPILER) in done.stderr  # the digest to compare with the vendor's
    wrong = _farm(
        "toolchain", "install-npu-compiler", str(folder), "--into", str(libs), "--sha256", "0" * 64
    )
    assert wrong.returncode == 8 and "origin is not proven" in wrong.stderr
    assert not mark.exists()  # never loaded, by any process
    assert os.listdir(libs) == []  # and nothing left in the folder, not even a temporary copy


def test_a_proven_library_is_probed_in_a_throwaway_process_never_in_this_one(tmp_path):
    mark = tmp_path / "loaded"
    folder = _marking_library(tmp_path / "lib", mark)
    libs = _private_folder(tmp_path / "libs")
    with pytest.raises(NotACompiler, match="not an NPU compiler: it does not export"):
        install(folder, libs, sha256=_digests(folder))
    loaders = {int(pid) for pid in mark.read_text().split()}
    assert loaders and os.getpid() not in loaders
    assert os.listdir(libs) == []
    # What was probed is the copy made in the folder it installs into, not the source.
    with pytest.raises(UntrustedCompiler, match="matches none of the files given"):
        install(folder, libs, sha256=[*_digests(folder), "1" * 64])


def test_a_folder_others_may_write_is_refused_before_anything_is_copied(tmp_path):
    folder = _library(tmp_path / "vcl", VCL_THAT_CANNOT_COMPILE)
    shared = _private_folder(tmp_path / "shared")
    shared.chmod(0o777)
    with pytest.raises(CompilerUnavailable, match="other users may write it"):
        install(folder, shared, sha256=_digests(folder))
    assert os.listdir(shared) == []


def test_a_library_of_a_known_release_needs_no_digest_and_the_shipped_list_is_sound(
    tmp_path, monkeypatch
):
    shipped = npu.known_digests()  # farm/npu_compilers.json: no authoritative digest yet
    assert all(len(digest) == 64 and int(digest, 16) >= 0 for digest in shipped)
    folder = _library(tmp_path / "vcl", VCL_THAT_CANNOT_COMPILE)
    listed = tmp_path / "known.json"
    files = dict(zip((NPU_COMPILER_LIBRARY, COMPILER), _digests(folder), strict=True))
    listed.write_text(json.dumps({"releases": [{"name": "test release", "files": files}]}))
    monkeypatch.setattr(npu, "KNOWN_COMPILERS", listed)
    elsewhere = _private_folder(tmp_path / "elsewhere")
    # Past provenance and the VCL probe, installed, then refused by the compile probe (this
    # OpenVINO does not load from `elsewhere`, and the library cannot compile): put back.
    with pytest.raises(CompilerUnavailable, match="compiled for no NPU platform"):
        install(folder, elsewhere)
    assert os.listdir(elsewhere) == []
