"""fetch_parts' checks before any request: the parts' spans and the digests' count."""

from __future__ import annotations

import pytest

from farm.client import _spans, fetch_parts

NEVER = "http://192.0.2.1/never-asked"  # TEST-NET-1: a request there would hang, not pass


@pytest.mark.parametrize(
    ("size", "part_bytes", "spans"),
    [
        (0, 4, []),
        (1, 4, [(0, 0)]),
        (4, 4, [(0, 3)]),
        (5, 4, [(0, 3), (4, 4)]),
        (10, 3, [(0, 2), (3, 5), (6, 8), (9, 9)]),
    ],
)
def test_spans_cover_the_object_in_parts_the_last_one_shorter(size, part_bytes, spans):
    assert _spans(size, part_bytes) == spans


@pytest.mark.parametrize(("size", "part_bytes"), [(-1, 4), (4, 0)])
def test_spans_refuse_a_negative_size_or_an_empty_part(size, part_bytes):
    with pytest.raises(ValueError):
        _spans(size, part_bytes)


@pytest.mark.parametrize("count", [1, 3])
def test_a_wrong_number_of_digests_is_refused_before_any_request(tmp_path, count):
    dest = tmp_path / "blob"
    with pytest.raises(ValueError, match=f"{count} part digests for 2 parts"):
        fetch_parts(NEVER, dest, 5, 4, ["0" * 64] * count)
    assert not dest.exists()


def test_no_connection_is_refused(tmp_path):
    with pytest.raises(ValueError, match="connections=0"):
        fetch_parts(NEVER, tmp_path / "blob", 5, 4, ["0" * 64] * 2, connections=0)
    assert not (tmp_path / "blob").exists()


def test_an_empty_object_is_an_empty_file_without_a_request(tmp_path):
    dest = tmp_path / "blob"
    dest.write_bytes(b"old")
    fetch_parts(NEVER, dest, 0, 4, [])
    assert dest.read_bytes() == b""
