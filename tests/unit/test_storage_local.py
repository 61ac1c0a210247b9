"""The local folder store: all-or-nothing writes, verified digests, keys that cannot escape."""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import stat
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest

from farm.core.identity import file_version
from farm.server.storage import ChecksumMismatch, InvalidKey, StorageError, local, open_store
from farm.server.storage.local import LocalStore, discard_prestaged
from tests.child import run_python
from tests.pagecache import cached_pages, direct_io_here


@pytest.fixture
def store(tmp_path) -> LocalStore:
    return LocalStore(tmp_path / "store")


@pytest.fixture(autouse=True)
def no_copies_left_running():
    yield
    discard_prestaged()


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "source.bin"
    path.write_bytes(b"weights" * 300_000)  # ~2 MB: more than one copy chunk
    return path


def leftovers(store: LocalStore) -> list[str]:
    return [p.name for p in store.root.rglob("*") if p.is_file()]


def test_round_trip_records_size_and_sha256(store, source, tmp_path):
    digest = hashlib.sha256(source.read_bytes()).hexdigest()
    stored = store.put_file(f"models/{digest}", source, expected_sha256=digest)
    assert (stored.size, stored.sha256) == (source.stat().st_size, digest)
    assert store.exists(f"models/{digest}")
    assert store.stat(f"models/{digest}") == stored
    store.get_file(f"models/{digest}", tmp_path / "back.bin")
    assert (tmp_path / "back.bin").read_bytes() == source.read_bytes()
    assert store.local_path(f"models/{digest}").read_bytes() == source.read_bytes()
    store.delete(f"models/{digest}")
    assert not store.exists(f"models/{digest}") and store.stat(f"models/{digest}") is None


def test_sha256_mismatch_stores_nothing(store, source):
    with pytest.raises(ChecksumMismatch):
        store.put_file("models/x", source, expected_sha256="0" * 64)
    assert leftovers(store) == []


def test_a_failed_write_leaves_no_partial_file(store, tmp_path):
    with pytest.raises(FileNotFoundError):
        store.put_file("blobs/a.blob", tmp_path / "missing")
    assert leftovers(store) == []


@pytest.mark.parametrize(
    "key",
    ["../x", "models/../../x", "/etc/passwd", "models//x", "a\\b", "a\x00b", "", "models/.", "é"],
)
def test_keys_that_could_escape_are_rejected(store, source, key):
    with pytest.raises(InvalidKey):
        store.put_file(key, source)
    with pytest.raises(InvalidKey):
        store.exists(key)


def test_open_store_picks_the_class_by_scheme(tmp_path):
    assert isinstance(open_store(str(tmp_path)), LocalStore)
    assert isinstance(open_store(f"file://{tmp_path}"), LocalStore)
    with pytest.raises(StorageError, match="known: file"):
        open_store("ftp://host/x")


# --- the embedded submit's fast paths: a model copied by the kernel, a blob moved in -----------


def digest_of(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_model_stored_by_version_is_a_copy_that_a_later_edit_leaves_alone(store, source):
    digest, version = digest_of(source), file_version(source)
    original = source.read_bytes()
    stored = store.put_version(f"models/{digest}", source, digest, version)
    assert (stored.size, stored.sha256) == (len(original), digest)
    kept = store.local_path(f"models/{digest}")
    assert kept.stat().st_ino != source.stat().st_ino  # not a hard link to the user's file
    with open(source, "r+b") as edit:  # saved again in place, as ov.save_model does
        edit.write(b"EDITED")
    source.unlink()
    assert kept.read_bytes() == original
    assert leftovers(store) == [digest]


def test_a_model_written_after_it_was_hashed_is_hashed_again_and_refused(store, source):
    digest, version = digest_of(source), file_version(source)
    with open(source, "r+b") as edit:
        edit.write(b"changed after hashing")
    with pytest.raises(ChecksumMismatch):
        store.put_version(f"models/{digest}", source, digest, version)
    assert leftovers(store) == []


def test_a_model_touched_but_unchanged_after_hashing_is_stored(store, source):
    digest, version = digest_of(source), file_version(source)
    os.utime(source, ns=(1, 1))  # a new version, the same bytes: verified by hashing them
    assert store.put_version(f"models/{digest}", source, digest, version).sha256 == digest
    assert store.local_path(f"models/{digest}").read_bytes() == source.read_bytes()


def test_a_prestaged_model_copy_is_taken_by_put_version(store, source):
    """`farm submit` starts the copy before it opens the database; storing takes it."""
    digest, version = digest_of(source), file_version(source)
    store.prestage(f"models/{digest}", source, version)
    stored = store.put_version(f"models/{digest}", source, digest, version)
    assert (stored.size, stored.sha256) == (source.stat().st_size, digest)
    kept = store.local_path(f"models/{digest}")
    assert kept.read_bytes() == source.read_bytes()
    assert kept.stat().st_ino != source.stat().st_ino
    assert leftovers(store) == [digest]


def test_a_copy_started_while_the_model_was_hashed_is_named_and_taken(store, source):
    """`farm submit` starts copying a new file before its digest is known."""
    version = file_version(source)
    store.prestage_unnamed("models", source, version)
    digest = digest_of(source)
    store.prestage(f"models/{digest}", source, version)
    copy = local._PRESTAGED[str(source)]
    copy.thread.join()
    made = copy.temporary.stat().st_ino
    stored = store.put_version(f"models/{digest}", source, digest, version)
    assert (stored.size, stored.sha256) == (source.stat().st_size, digest)
    kept = store.local_path(f"models/{digest}")
    assert kept.read_bytes() == source.read_bytes()
    assert kept.stat().st_ino == made  # that copy, renamed: not copied again
    assert leftovers(store) == [digest]


def test_a_copy_of_a_model_written_after_the_copy_is_not_taken(store, source):
    """The copy ended at the version the model was hashed from; a write after it makes the
    digest (hashed again) another file's: the copy is not stored under it."""
    version = file_version(source)
    store.prestage_unnamed("models", source, version)
    local._PRESTAGED[str(source)].thread.join()
    source.write_bytes(b"saved again after the copy")
    digest = digest_of(source)
    store.prestage(f"models/{digest}", source, version)
    stored = store.put_version(f"models/{digest}", source, digest, version)
    assert stored.sha256 == digest  # the file as it is now, hashed as it was stored
    assert store.local_path(f"models/{digest}").read_bytes() == b"saved again after the copy"
    assert leftovers(store) == [digest]


def test_a_copy_started_while_hashing_a_model_stored_already_is_dropped(store, source):
    digest, version = digest_of(source), file_version(source)
    store.put_version(f"models/{digest}", source, digest, version)
    store.prestage_unnamed("models", source, version)
    store.prestage(f"models/{digest}", source, version)
    assert leftovers(store) == [digest]
    discard_prestaged()


def test_a_copy_started_while_hashing_that_no_key_named_is_deleted(store, source):
    store.prestage_unnamed("models", source, file_version(source))
    discard_prestaged()
    assert leftovers(store) == []


def test_a_copy_started_in_another_folder_than_its_key_is_made_again(store, source):
    digest, version = digest_of(source), file_version(source)
    store.prestage_unnamed("elsewhere", source, version)
    store.prestage(f"models/{digest}", source, version)
    assert store.put_version(f"models/{digest}", source, digest, version).sha256 == digest
    assert store.local_path(f"models/{digest}").read_bytes() == source.read_bytes()
    assert leftovers(store) == [digest]


def test_a_prestaged_copy_of_a_model_changed_since_is_not_taken(store, source):
    digest, version = digest_of(source), file_version(source)
    store.prestage(f"models/{digest}", source, version)
    with open(source, "r+b") as edit:  # written while (or after) it was being copied
        edit.write(b"changed after hashing")
    with pytest.raises(ChecksumMismatch):
        store.put_version(f"models/{digest}", source, digest, version)
    assert leftovers(store) == []


def test_a_prestaged_copy_nobody_took_is_deleted(store, source):
    digest, version = digest_of(source), file_version(source)
    store.prestage(f"models/{digest}", source, version)
    discard_prestaged()
    assert leftovers(store) == []
    assert not store.exists(f"models/{digest}")


def test_a_blob_of_its_own_is_moved_in_and_hashed_once(store, source):
    digest, inode = digest_of(source), source.stat().st_ino
    stored = store.adopt_file("blobs/k.blob", source)
    assert (stored.size, stored.sha256) == (store.local_path("blobs/k.blob").stat().st_size, digest)
    assert not source.exists()
    assert store.local_path("blobs/k.blob").stat().st_ino == inode  # moved, not copied
    assert leftovers(store) == ["k.blob"]


def test_a_blob_with_a_second_name_is_copied_so_that_name_cannot_change_it(store, source):
    other_name = source.with_name("other-name.bin")
    os.link(source, other_name)
    original = source.read_bytes()
    stored = store.adopt_file("blobs/k.blob", source)
    assert stored.sha256 == hashlib.sha256(original).hexdigest()
    with open(other_name, "r+b") as edit:
        edit.write(b"tampered")
    assert store.local_path("blobs/k.blob").read_bytes() == original


@pytest.mark.skipif(os.geteuid() != 0, reason="gives the file to another user")
def test_a_blob_of_another_user_is_copied_hashed_and_emptied_as_it_goes(store, source, monkeypatch):
    monkeypatch.setattr(local, "HASHED_COPY_CHUNK", 64 * 1024)  # ~2 MB: 33 chunks, the last short
    original = source.read_bytes()
    os.chown(source, 65534, 65534)  # the compile user's: it could still write it
    stored = store.adopt_file("blobs/k.blob", source)
    kept = store.local_path("blobs/k.blob")
    assert (stored.size, stored.sha256) == (len(original), hashlib.sha256(original).hexdigest())
    assert kept.read_bytes() == original and kept.stat().st_uid == 0
    assert kept.stat().st_ino != source.stat().st_ino and oct(kept.stat().st_mode)[-3:] == "600"
    # Given up: its pages were freed as they were copied, never written.
    assert source.stat().st_size == len(original)
    assert source.stat().st_blocks * 512 <= 4096  # at most the last, partial block
    assert source.read_bytes() == bytes(len(original))
    assert leftovers(store) == ["k.blob"]


def moved_out_of_the_box(source: Path, tmp_path: Path) -> Path:
    """What the job does with the blob its compile child wrote: move it to its own folder."""
    moved = tmp_path / "job" / "k.blob"
    moved.parent.mkdir()
    source.rename(moved)
    return moved


def test_a_blob_copied_ahead_and_claimed_is_what_its_adopt_stores(store, source, tmp_path):
    original = source.read_bytes()
    copy = store.adopt_ahead("blobs", source)
    assert copy is not None
    made = copy.temporary.stat().st_ino  # the copy, flushed, under no key yet
    assert leftovers(store) == [copy.temporary.name]
    assert copy.matches(source)
    moved = moved_out_of_the_box(source, tmp_path)
    assert copy.claim(moved)

    stored = store.adopt_file("blobs/k.blob", moved, expected_sha256=digest_of(moved))

    kept = store.local_path("blobs/k.blob")
    assert (stored.size, stored.sha256) == (len(original), hashlib.sha256(original).hexdigest())
    assert kept.stat().st_ino == made  # named, not copied again
    assert kept.read_bytes() == original and oct(kept.stat().st_mode)[-3:] == "600"
    assert moved.read_bytes() == original  # nothing of it punched out: it was not needed
    assert leftovers(store) == ["k.blob"] and local._COPIED_AHEAD == []


def test_a_copy_made_ahead_is_used_only_for_the_file_it_was_claimed_for(store, source, tmp_path):
    copy = store.adopt_ahead("blobs", source)
    assert copy is not None
    other = tmp_path / "other.blob"  # never claimed: say, a blob written in a reused inode
    other.write_bytes(b"another blob")

    stored = store.adopt_file("blobs/k.blob", other)

    assert store.local_path("blobs/k.blob").read_bytes() == b"another blob"
    assert stored.sha256 == hashlib.sha256(b"another blob").hexdigest()
    assert len(leftovers(store)) == 2  # the copy, not claimed, waits for its discard
    copy.discard()
    assert leftovers(store) == ["k.blob"] and local._COPIED_AHEAD == []


def test_a_claimed_copy_of_a_file_written_since_is_dropped_for_the_file_as_it_is(
    store, source, tmp_path
):
    copy = store.adopt_ahead("blobs", source)
    assert copy is not None
    moved = moved_out_of_the_box(source, tmp_path)
    assert copy.claim(moved)
    with open(moved, "r+b") as late:  # a process of the compile user's, writing on
        late.write(b"tampered")
    os.utime(moved, ns=(0, 10**18))
    now = moved.read_bytes()

    store.adopt_file("blobs/k.blob", moved)

    assert store.local_path("blobs/k.blob").read_bytes() == now
    assert leftovers(store) == ["k.blob"] and local._COPIED_AHEAD == []


def test_a_copy_is_not_claimed_for_another_file_or_one_changed_since(store, source, tmp_path):
    copy = store.adopt_ahead("blobs", source)
    assert copy is not None
    other = tmp_path / "other.blob"
    other.write_bytes(source.read_bytes())
    assert not copy.matches(other)  # the same bytes, another file
    assert leftovers(store) == [] and local._COPIED_AHEAD == []  # discarded
    assert not copy.matches(source) and not copy.claim(source)  # once discarded, never

    again = store.adopt_ahead("blobs", source)
    assert again is not None
    with open(source, "r+b") as late:
        late.write(b"tampered")
    os.utime(source, ns=(0, 10**18))
    assert not again.matches(source)  # the file copied, written since
    assert leftovers(store) == [] and local._COPIED_AHEAD == []

    third = store.adopt_ahead("blobs", source)
    assert third is not None and third.matches(source)
    shorter = tmp_path / "shorter.blob"  # what the box's file became, copied out of the box
    shorter.write_bytes(source.read_bytes()[:-1])
    assert not third.claim(shorter)  # not the size the copy has: not that file
    assert leftovers(store) == [] and local._COPIED_AHEAD == []


def test_a_copy_not_claimed_is_not_used_even_for_the_file_it_was_made_of(store, source, tmp_path):
    """Only the job claims a copy, for the blob it took: a file that happens to be the one
    copied (the same inode, as a reused one would be) is stored as any file is."""
    copy = store.adopt_ahead("blobs", source)
    assert copy is not None
    made = copy.temporary.stat().st_ino
    moved = moved_out_of_the_box(source, tmp_path)

    store.adopt_file("blobs/k.blob", moved)

    assert store.local_path("blobs/k.blob").stat().st_ino != made
    assert copy.temporary.exists()  # still the caller's to claim or discard
    copy.discard()
    assert leftovers(store) == ["k.blob"]


def test_a_claimed_copy_is_used_only_in_its_own_folder(store, source, tmp_path):
    copy = store.adopt_ahead("blobs", source)
    assert copy is not None and copy.claim(source)
    stored = store.adopt_file(f"models/{digest_of(source)}", source)  # another folder
    assert store.local_path(stored.key).is_file()
    assert leftovers(store) == [digest_of(store.local_path(stored.key))]
    assert local._COPIED_AHEAD == []  # the copy, not usable there, deleted


def test_a_file_written_while_it_was_copied_ahead_is_not_copied(store, source, monkeypatch):
    copy_hashed = local._copy_hashed

    def copy_then_write(source_fd, *args, **kwargs):
        digest = copy_hashed(source_fd, *args, **kwargs)
        os.utime(source_fd, ns=(0, 10**18))  # a late write (its mtime and ctime change)
        return digest

    monkeypatch.setattr(local, "_copy_hashed", copy_then_write)
    assert store.adopt_ahead("blobs", source) is None
    assert leftovers(store) == [] and local._COPIED_AHEAD == []


def test_a_claimed_copy_still_answers_for_its_digest(store, source):
    copy = store.adopt_ahead("blobs", source)
    assert copy is not None and copy.claim(source)
    with pytest.raises(ChecksumMismatch):
        store.adopt_file("blobs/k.blob", source, expected_sha256="0" * 64)
    assert leftovers(store) == [] and local._COPIED_AHEAD == []


@pytest.mark.parametrize("what", ["missing", "fifo", "link", "second name"])
def test_nothing_is_copied_ahead_of_what_is_not_a_regular_file_of_one_name(
    store, source, tmp_path, what
):
    path = tmp_path / "box.blob"
    if what == "fifo":
        os.mkfifo(path)
    elif what == "link":
        path.symlink_to(source)
    elif what == "second name":
        os.link(source, path)
    assert store.adopt_ahead("blobs", path) is None
    assert leftovers(store) == [] and local._COPIED_AHEAD == []


def test_a_copy_ahead_stops_when_told(store, source, monkeypatch):
    monkeypatch.setattr(local, "HASHED_COPY_CHUNK", 64 * 1024)
    stop = threading.Event()
    stop.set()  # the submit ended it: a hit, an interrupt
    assert store.adopt_ahead("blobs", source, stop) is None
    assert leftovers(store) == [] and local._COPIED_AHEAD == []


def test_a_hashed_copy_is_the_copy_hashed_chunk_by_chunk(tmp_path, monkeypatch):
    monkeypatch.setattr(local, "HASHED_COPY_CHUNK", mmap.PAGESIZE)  # chunks start on pages
    data = os.urandom(10 * mmap.PAGESIZE + 123)
    (tmp_path / "a").write_bytes(data)
    with open(tmp_path / "a", "rb") as source, open(tmp_path / "b", "x+b") as sink:
        digest = local._copy_hashed(source.fileno(), sink.fileno(), len(data), False)
    assert digest == hashlib.sha256(data).hexdigest()
    assert (tmp_path / "b").read_bytes() == data and (tmp_path / "a").read_bytes() == data


def test_a_file_that_ends_early_is_not_copied_into_the_store(tmp_path):
    (tmp_path / "a").write_bytes(b"x" * 1000)
    with (
        open(tmp_path / "a", "rb") as source,
        open(tmp_path / "b", "x+b") as sink,
        pytest.raises(StorageError, match="ended while"),
    ):
        local._copy_hashed(source.fileno(), sink.fileno(), 5000, False)


def test_an_empty_blob_is_copied(store, tmp_path):
    empty = tmp_path / "empty.blob"
    empty.write_bytes(b"")
    os.link(empty, tmp_path / "second-name")
    assert store.adopt_file("blobs/e.blob", empty).sha256 == hashlib.sha256(b"").hexdigest()
    assert store.local_path("blobs/e.blob").read_bytes() == b""


def test_a_link_is_not_adopted(store, source, tmp_path):
    link = tmp_path / "link.blob"
    link.symlink_to(source)
    with pytest.raises(OSError):
        store.adopt_file("blobs/k.blob", link)
    assert leftovers(store) == [] and source.exists()


def test_a_copy_goes_in_pieces_each_written_to_disk_as_the_next_is_copied(tmp_path, monkeypatch):
    monkeypatch.setattr(local, "COPY_PIECE_BYTES", 4096)
    started: list[tuple[int, int]] = []
    monkeypatch.setattr(
        local, "_start_writeback", lambda fd, offset, count: started.append((offset, count))
    )
    source = tmp_path / "model.bin"
    source.write_bytes(os.urandom(10_000))
    sink = tmp_path / "copy.bin"
    with open(source, "rb") as reader, open(sink, "wb") as writer:
        assert local._copy(reader.fileno(), writer.fileno()) == 10_000
    assert sink.read_bytes() == source.read_bytes()
    assert started == [(0, 4096), (4096, 4096), (8192, 1808)]


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 3 * 4096 + 17, (1 << 20) + 5])
def test_an_uncached_copy_is_the_file_and_leaves_no_page_in_memory(tmp_path, size, monkeypatch):
    """The store's copy of a model the compile reads where it is goes around the page cache:
    whole blocks with direct I/O, the last partial one through the cache."""
    if not direct_io_here(tmp_path):
        pytest.skip("no direct I/O on this file system")
    monkeypatch.setattr(local, "UNCACHED_PIECE_BYTES", 1 << 18)  # several pieces
    source, sink = tmp_path / "model.bin", tmp_path / "copy.bin"
    source.write_bytes(os.urandom(size))
    with open(source, "rb") as reader, open(sink, "xb") as writer:
        assert local._copy_uncached(reader.fileno(), writer.fileno(), sink) == size
    assert sink.read_bytes() == source.read_bytes()
    sink.write_bytes(b"")  # the read above cached it; copy again, and look before reading
    with open(source, "rb") as reader, open(sink, "r+b") as writer:
        local._copy_uncached(reader.fileno(), writer.fileno(), sink)
    assert cached_pages(sink) <= (1 if size % 4096 else 0)  # at most the partial last block
    assert sink.read_bytes() == source.read_bytes()


def test_without_direct_io_the_uncached_copy_says_so_having_written_nothing(tmp_path, monkeypatch):
    real_open = os.open

    def no_direct_io(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(local.os, "open", no_direct_io)
    source, sink = tmp_path / "model.bin", tmp_path / "copy.bin"
    source.write_bytes(os.urandom(10_000))
    with open(source, "rb") as reader, open(sink, "xb") as writer:
        assert local._copy_uncached(reader.fileno(), writer.fileno(), sink) is None
    assert sink.read_bytes() == b""
    store = LocalStore(tmp_path / "store")  # a prestaged copy then goes through the cache
    digest, version = digest_of(source), file_version(source)
    store.prestage(f"models/{digest}", source, version, uncached=True)
    assert store.put_version(f"models/{digest}", source, digest, version).sha256 == digest
    assert store.local_path(f"models/{digest}").read_bytes() == source.read_bytes()


def test_an_uncached_copy_taken_names_the_file_it_was_copied_from(store, source):
    """The runner reads the user's file (in memory: it was just hashed) in place of the copy,
    at the version it was copied at; a copy through the cache names nothing."""
    digest, version = digest_of(source), file_version(source)
    store.prestage_unnamed("models", source, version, uncached=True)
    store.prestage(f"models/{digest}", source, version)
    store.put_version(f"models/{digest}", source, digest, version)
    assert store.local_path(f"models/{digest}").read_bytes() == source.read_bytes()
    assert store.copied_from(f"models/{digest}") == (source, version)
    other = source.with_name("other.bin")
    other.write_bytes(b"other weights")
    other_digest, other_version = digest_of(other), file_version(other)
    store.prestage(f"models/{other_digest}", other, other_version)
    store.put_version(f"models/{other_digest}", other, other_digest, other_version)
    assert store.copied_from(f"models/{other_digest}") is None


def test_direct_writes_refused_after_the_open_fall_back_to_a_cached_copy(tmp_path, monkeypatch):
    """Some file systems open with O_DIRECT and refuse the writes (EINVAL): the prestaged copy
    is then made through the cache, whole."""
    if not direct_io_here(tmp_path):
        pytest.skip("no direct I/O on this file system")
    monkeypatch.setattr(local, "UNCACHED_PIECE_BYTES", 1 << 16)
    direct: set[int] = set()
    real_open, real_pwrite = os.open, os.pwrite

    def opening(path, flags, *args):
        descriptor = real_open(path, flags, *args)
        if flags & os.O_DIRECT:
            direct.add(descriptor)
        return descriptor

    def writing(descriptor, data, offset):
        if descriptor in direct and offset > 0:  # the first piece went; the second is refused
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(descriptor, data, offset)

    monkeypatch.setattr(local.os, "open", opening)
    monkeypatch.setattr(local.os, "pwrite", writing)
    source = tmp_path / "model.bin"
    source.write_bytes(os.urandom(300_000))
    store = LocalStore(tmp_path / "store")
    digest, version = digest_of(source), file_version(source)
    store.prestage(f"models/{digest}", source, version, uncached=True)
    assert store.put_version(f"models/{digest}", source, digest, version).sha256 == digest
    assert store.local_path(f"models/{digest}").read_bytes() == source.read_bytes()
    assert direct, "the copy tried direct I/O first"


def test_an_uncached_copy_of_a_file_that_ends_early_fails_with_its_own_error(tmp_path, monkeypatch):
    """A short read (the file truncated as it is copied) is the error raised, not the buffer's
    release behind it."""
    if not direct_io_here(tmp_path):
        pytest.skip("no direct I/O on this file system")
    source, sink = tmp_path / "model.bin", tmp_path / "copy.bin"
    source.write_bytes(os.urandom(3 * 4096))
    monkeypatch.setattr(local.os, "preadv", lambda descriptor, buffers, offset: 4096)
    with (
        open(source, "rb") as reader,
        open(sink, "xb") as writer,
        pytest.raises(StorageError, match="ended while it was copied"),
    ):
        local._copy_uncached(reader.fileno(), writer.fileno(), sink)


def test_an_object_is_written_once_and_other_bytes_for_its_key_are_refused(store, tmp_path):
    """As S3's `If-None-Match: *`: a second attempt of a job (its lease taken back) that
    compiled other bytes must not replace the blob whose digest the first one recorded."""
    first, second, again = (tmp_path / name for name in ("first", "second", "again"))
    first.write_bytes(b"A" * 100_000)
    second.write_bytes(b"B" * 100_000)
    again.write_bytes(b"A" * 100_000)
    recorded = store.adopt_file("blobs/k.blob", first).sha256
    with pytest.raises(ChecksumMismatch, match="write-once"):
        store.adopt_file("blobs/k.blob", second)
    assert store.adopt_file("blobs/k.blob", again).sha256 == recorded  # the same bytes: fine
    assert hashlib.sha256(store.local_path("blobs/k.blob").read_bytes()).hexdigest() == recorded
    assert leftovers(store) == ["k.blob"]


def test_the_writer_never_replaces_an_object(store):
    with store.writer("refs/r") as writer:
        writer.write(b"first")
        writer.commit()
    with store.writer("refs/r") as writer, pytest.raises(ChecksumMismatch, match="write-once"):
        writer.write(b"other")
        writer.commit()
    with store.writer("refs/r") as writer:
        writer.write(b"first")
        writer.commit()
    assert store.local_path("refs/r").read_bytes() == b"first"
    assert leftovers(store) == ["r"]


@pytest.mark.parametrize("names", [1, 2], ids=["moved", "copied (a second name)"])
def test_adopt_refuses_bytes_that_are_not_the_expected_digest(store, tmp_path, names):
    given = tmp_path / "given"
    given.write_bytes(b"not what the child reported")
    if names == 2:
        os.link(given, tmp_path / "other name")
    with pytest.raises(ChecksumMismatch, match="nothing stored"):
        store.adopt_file("models/m", given, expected_sha256=hashlib.sha256(b"x").hexdigest())
    assert not store.exists("models/m")
    assert leftovers(store) == []


def test_a_short_write_of_the_uncached_copys_tail_stores_nothing(tmp_path):
    """`pwrite` writes what fits and returns its count past RLIMIT_FSIZE, as on a disk that
    fills; the copy must fail, never store a file shorter than its digest says."""
    ran = run_python(SHORT_TAIL, str(tmp_path), timeout=120)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.split() == ["refused", "EFBIG", "stored:", "False", "leftovers:", "0"]


def test_an_object_is_named_on_the_disk_before_the_store_returns(store, tmp_path, monkeypatch):
    """The file is flushed, and then its folder: a crash after the row's commit must not lose
    the name the row records."""
    flushed = []
    real_fsync = os.fsync

    def fsync(descriptor: int) -> None:
        info = os.fstat(descriptor)
        flushed.append("folder" if stat.S_ISDIR(info.st_mode) else "file")
        real_fsync(descriptor)

    monkeypatch.setattr(os, "fsync", fsync)
    given = tmp_path / "given"
    given.write_bytes(b"blob bytes")
    store.adopt_file("blobs/k.blob", given)
    assert flushed == ["file", "folder"]


SHORT_TAIL = """
import errno, hashlib, os, resource, signal, sys
from pathlib import Path
from farm.core.identity import file_version
from farm.server.storage.local import LocalStore, discard_prestaged
root = Path(sys.argv[1])
source = root / "model.bin"
data = os.urandom(3 * 4096 + 1000)  # a partial last block: written through the cached file
source.write_bytes(data)
sha = hashlib.sha256(data).hexdigest()
store = LocalStore(root / "store")
version = file_version(source)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (3 * 4096 + 500, resource.RLIM_INFINITY))
store.prestage(f"models/{sha}", source, version, uncached=True)
try:
    store.put_version(f"models/{sha}", source, sha, version)
    print("stored whole")
except OSError as error:
    print("refused", errno.errorcode[error.errno])
discard_prestaged()
print("stored:", store.exists(f"models/{sha}"))
print("leftovers:", sum(1 for p in (root / "store").rglob("*") if p.is_file()))
"""


def test_a_copy_the_kernel_cannot_make_stops_when_told(tmp_path):
    """Across file systems (`copy_file_range`: EXDEV) the copy is read and written here; a
    discarded copy stops there too, instead of going on for the whole model."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no tmpfs at /dev/shm")
    with tempfile.TemporaryDirectory(dir="/dev/shm") as elsewhere:
        source = Path(elsewhere) / "model.bin"
        source.write_bytes(os.urandom(8 * local.CHUNK_BYTES))
        with open(source, "rb") as reader, open(tmp_path / "copy", "wb") as sink:
            try:
                os.copy_file_range(reader.fileno(), sink.fileno(), 1)
                pytest.skip("the kernel copies across these file systems here")
            except OSError as error:
                assert error.errno == errno.EXDEV
            stop = threading.Event()
            stop.set()
            copied = local._copy(reader.fileno(), sink.fileno(), stop)
    assert copied < local.CHUNK_BYTES * 2


def test_a_file_swapped_before_it_is_moved_is_refused_untouched(store, tmp_path, monkeypatch):
    """The checks are made on the file opened; if its name pointed elsewhere by the time it is
    moved (a link to the signing key, say), that is refused and its target left as it is."""
    given, secret = tmp_path / "given", tmp_path / "signing.pem"
    given.write_bytes(b"blob")
    secret.write_bytes(b"PRIVATE KEY")
    secret.chmod(0o640)
    moved = local._moved

    def swapped_first(path, temporary):
        os.unlink(path)
        os.symlink(secret, path)
        return moved(path, temporary)

    monkeypatch.setattr(local, "_moved", swapped_first)
    with pytest.raises(StorageError, match="changed while it was stored"):
        store.adopt_file("blobs/k.blob", given)
    assert not store.exists("blobs/k.blob") and leftovers(store) == []
    assert secret.read_bytes() == b"PRIVATE KEY" and secret.stat().st_mode & 0o777 == 0o640


@pytest.mark.parametrize("refusal", [errno.EPERM, errno.EOPNOTSUPP])
def test_a_file_system_without_hard_links_still_stores_once(store, tmp_path, monkeypatch, refusal):
    """FAT, exFAT and some shared folders refuse `link`: the object is checked, then renamed."""

    def no_links(source, target):
        raise OSError(refusal, os.strerror(refusal))

    monkeypatch.setattr(os, "link", no_links)
    first, other = tmp_path / "first", tmp_path / "other"
    first.write_bytes(b"A" * 1000)
    other.write_bytes(b"B" * 1000)
    recorded = store.adopt_file("blobs/k.blob", first).sha256
    with pytest.raises(ChecksumMismatch, match="write-once"):
        store.adopt_file("blobs/k.blob", other)
    assert hashlib.sha256(store.local_path("blobs/k.blob").read_bytes()).hexdigest() == recorded
    assert leftovers(store) == ["k.blob"]


def test_a_folder_the_file_system_cannot_flush_still_stores(store, tmp_path, monkeypatch):
    """CIFS and some FUSE mounts refuse to fsync a folder (EINVAL): the object is stored, and
    the call says so, rather than failing after the object took its name."""
    real_fsync = os.fsync

    def fsync(descriptor: int) -> None:
        if stat.S_ISDIR(os.fstat(descriptor).st_mode):
            raise OSError(errno.EINVAL, "Invalid argument")
        real_fsync(descriptor)

    monkeypatch.setattr(os, "fsync", fsync)
    given = tmp_path / "given"
    given.write_bytes(b"blob")
    assert store.adopt_file("blobs/k.blob", given).size == 4
    assert store.local_path("blobs/k.blob").read_bytes() == b"blob"


IDLE = timedelta(seconds=1)
"""The idle time the sweep tests give a partial file: ctime cannot be set back, so a file
"older" than that is one written a little more than a second ago."""


def idle() -> None:
    """Wait until what was just written is idle for longer than IDLE."""
    time.sleep(IDLE.total_seconds() * 1.2)


def test_partial_files_of_dead_writers_are_deleted_once_idle_long_enough(store, source):
    """What a process killed while it wrote into the store leaves: the reconciler deletes it
    once no one has written it for as long as an idle S3 upload is given."""
    digest = digest_of(source)
    store.put_file(f"models/{digest}", source, expected_sha256=digest)
    (store.root / "references" / "k").mkdir(parents=True)
    old = store.root / "references" / "k" / ".r.npz.0123.partial"  # its writer gone
    old.write_bytes(b"half a reference")
    lookalike = store.root / "references" / "x.partial"  # an object's name, not a partial
    lookalike.write_bytes(b"kept")
    outside = store.root.parent / "outside"  # a link never leads the sweep out of the store
    outside.mkdir()
    (outside / ".theirs.partial").write_bytes(b"not the store's")
    (store.root / "linked").symlink_to(outside)
    idle()
    fresh = store.root / "models" / ".0456.partial"  # a copy going on now
    fresh.write_bytes(b"a model being copied")

    assert store.abort_stale_uploads(IDLE) == ["references/k/.r.npz.0123.partial"]

    assert not old.exists() and fresh.exists() and lookalike.exists()
    assert (outside / ".theirs.partial").exists()
    assert store.local_path(f"models/{digest}").read_bytes() == source.read_bytes()


def test_a_partial_file_renamed_just_now_is_not_a_dead_writers(store, source):
    """`adopt_file` moves the file it is given to a partial name, then hashes it: the file may
    have been written hours ago (a stage's IR beside a long compile), but the rename is now."""
    os.utime(source, (0, 0))
    idle()
    given_up = store.root / "models" / ".being-hashed.partial"
    given_up.parent.mkdir(parents=True)
    source.rename(given_up)
    assert store.abort_stale_uploads(IDLE) == [] and given_up.exists()


def test_the_store_is_read_for_partial_files_at_most_once_in_half_the_idle_time(store):
    (store.root / "blobs").mkdir(parents=True)
    dead = store.root / "blobs" / ".k.blob.1.partial"
    dead.write_bytes(b"half a blob")
    idle()
    marker = store.root / local.SWEPT_MARKER
    marker.touch()  # a pass a moment ago (the reconciler runs every few minutes)
    assert store.abort_stale_uploads(IDLE) == [] and dead.exists()
    os.utime(marker, (0, 0))  # long ago
    assert store.abort_stale_uploads(IDLE) == ["blobs/.k.blob.1.partial"]


def test_a_partial_file_it_cannot_delete_is_left_and_the_others_go(store, monkeypatch):
    (store.root / "blobs").mkdir(parents=True)
    stuck, deleted = (store.root / "blobs" / f".{n}.partial" for n in ("a", "b"))
    for path in (stuck, deleted):
        path.write_bytes(b"x")
    idle()
    unlink = Path.unlink

    def refuse(path, *args, **kwargs):
        if path == stuck:
            raise PermissionError(errno.EACCES, "refused", str(path))
        return unlink(path, *args, **kwargs)

    monkeypatch.setattr(Path, "unlink", refuse)
    assert store.abort_stale_uploads(IDLE) == ["blobs/.b.partial"]
    assert stuck.exists() and not deleted.exists()
