"""farm/core/emptied.py: a file opened to write from nothing, never with O_TRUNC, only a
regular file; every byte written or the kernel's reason why not."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from farm.core import emptied
from tests.child import run_python


@pytest.mark.parametrize("there", [None, b"", b"old bytes"], ids=["new", "empty", "with bytes"])
def test_the_file_is_opened_empty_and_truncated_only_when_it_holds_bytes(
    tmp_path, file_opens, there
):
    path = tmp_path / "file"
    if there is not None:
        path.write_bytes(there)
    inode = path.stat().st_ino if there is not None else None
    fd = emptied.open_emptied(path)
    try:
        os.write(fd, b"new")
    finally:
        os.close(fd)
    assert path.read_bytes() == b"new"
    assert not any(flags & os.O_TRUNC for flags in file_opens["flags"])
    assert file_opens["truncated"] == ([0] if there else [])
    if inode is not None:
        assert path.stat().st_ino == inode  # the same file, as a lock held on it expects


def test_a_symbolic_link_is_never_followed(tmp_path):
    target = tmp_path / "target"
    target.write_bytes(b"keep")
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(OSError):
        emptied.open_emptied(tmp_path / "link")
    assert target.read_bytes() == b"keep"


def test_a_fifo_is_refused_at_once_instead_of_waiting_for_a_reader(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    opened = run_python(OPEN_IN_CHILD, str(fifo))  # an open that waits would hang the suite
    assert opened.returncode == 0, opened.stderr
    assert opened.stdout.startswith("OSError")


def test_a_device_is_refused():
    with pytest.raises(OSError, match="not a regular file"):
        emptied.open_emptied(Path(os.devnull))


def test_a_short_write_goes_on_until_the_kernel_says_why_not(tmp_path):
    """A real short write: past RLIMIT_FSIZE, `pwrite` writes what fits and returns its
    count; the next one fails with EFBIG (as a full disk's does with ENOSPC)."""
    path = tmp_path / "file"
    wrote = run_python(WRITE_PAST_LIMIT, str(path))
    assert wrote.returncode == 0, wrote.stderr
    assert wrote.stdout.split() == ["short", "4096", "EFBIG"]
    assert path.read_bytes() == b"\0" * 8192 + b"x" * 4096  # what fit, no more


OPEN_IN_CHILD = """
import sys
from pathlib import Path
from farm.core.emptied import open_emptied
try:
    open_emptied(Path(sys.argv[1]))
except OSError as error:
    print("OSError", error)
"""
WRITE_PAST_LIMIT = """
import errno, os, resource, signal, sys
from farm.core.emptied import pwrite_all
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (12288, 12288))
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT, 0o600)
print("short", os.pwrite(fd, b"x" * 8192, 8192))  # what a single pwrite does
os.ftruncate(fd, 8192)
try:
    pwrite_all(fd, b"x" * 8192, 8192)
except OSError as error:
    print(errno.errorcode[error.errno])
"""
