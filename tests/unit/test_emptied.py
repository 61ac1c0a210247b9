"""farm/core/emptied.py: a file opened to write from nothing, never with O_TRUNC."""

from __future__ import annotations

import os

import pytest

from farm.core import emptied


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
