"""S3Store against a real SeaweedFS: write-once, digests, multipart, ranges, presigned URLs."""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import urllib.request
from datetime import timedelta

import pytest

from farm.server.storage import ChecksumMismatch, InvalidKey, StorageError
from farm.server.storage.s3 import PART_BYTES, S3Settings


def write(path, data: bytes):
    path.write_bytes(data)
    return path


def test_small_object_round_trip_with_sha256_metadata(s3_store, tmp_path):
    data = b"model weights" * 1000
    digest = hashlib.sha256(data).hexdigest()
    stored = s3_store.put_file(f"models/{digest}", write(tmp_path / "a", data))
    assert (stored.size, stored.sha256) == (len(data), digest)
    assert s3_store.stat(f"models/{digest}") == stored  # digest read back from the metadata
    s3_store.get_file(f"models/{digest}", tmp_path / "back")
    assert (tmp_path / "back").read_bytes() == data
    assert s3_store.read_range(f"models/{digest}", 6, 12).read() == data[6:13]


def test_multipart_upload_of_a_big_file(s3_store, tmp_path):
    data = os.urandom(2 * PART_BYTES + 12345)
    digest = hashlib.sha256(data).hexdigest()
    stored = s3_store.put_file("blobs/big.blob", write(tmp_path / "big", data))
    assert stored.sha256 == digest and stored.size == len(data)
    assert s3_store.stat("blobs/big.blob").sha256 == digest
    s3_store.get_file("blobs/big.blob", tmp_path / "back")
    assert hashlib.sha256((tmp_path / "back").read_bytes()).hexdigest() == digest


def test_write_once_same_bytes_is_fine_other_bytes_conflict(s3_store, tmp_path):
    first = s3_store.put_file("blobs/k.blob", write(tmp_path / "a", b"one"))
    assert s3_store.put_file("blobs/k.blob", tmp_path / "a") == first  # 412, same sha256
    with pytest.raises(ChecksumMismatch, match="write-once"):
        s3_store.put_file("blobs/k.blob", write(tmp_path / "b", b"two"))
    s3_store.get_file("blobs/k.blob", tmp_path / "back")
    assert (tmp_path / "back").read_bytes() == b"one"


def test_write_once_holds_for_multipart_too(s3_store, tmp_path):
    s3_store.put_file("blobs/m.blob", write(tmp_path / "a", os.urandom(PART_BYTES + 1)))
    with pytest.raises(ChecksumMismatch):
        s3_store.put_file("blobs/m.blob", write(tmp_path / "b", os.urandom(PART_BYTES + 1)))
    assert s3_store.abort_stale_uploads(timedelta(0)) == []  # the refused upload was aborted


@pytest.mark.parametrize("size", [10, PART_BYTES + 10], ids=["single", "multipart"])
def test_a_wrong_expected_digest_stores_nothing(s3_store, tmp_path, size):
    path = write(tmp_path / "a", os.urandom(size))
    with pytest.raises(ChecksumMismatch):
        s3_store.put_file("models/x", path, expected_sha256="0" * 64)
    assert not s3_store.exists("models/x")
    assert s3_store.abort_stale_uploads(timedelta(0)) == []


def test_presigned_url_serves_the_object_and_ranges(s3_store, tmp_path):
    s3_store.put_file("blobs/p.blob", write(tmp_path / "a", b"0123456789"))
    url = s3_store.presigned_url("blobs/p.blob", expires_seconds=60)
    assert urllib.request.urlopen(url).read() == b"0123456789"
    ranged = urllib.request.Request(url, headers={"Range": "bytes=3-5"})
    assert urllib.request.urlopen(ranged).read() == b"345"


def test_stale_multipart_uploads_are_aborted(s3_store):
    client, key = s3_store.client, s3_store._key("blobs/stale.blob")
    upload = client.create_multipart_upload(Bucket=s3_store.bucket, Key=key)
    assert s3_store.abort_stale_uploads(timedelta(hours=1)) == []  # too young
    assert s3_store.abort_stale_uploads(timedelta(0)) == [key]
    uploads = client.list_multipart_uploads(Bucket=s3_store.bucket, Prefix=key).get("Uploads", [])
    assert upload["UploadId"] not in [u["UploadId"] for u in uploads]


def test_missing_objects_and_bad_keys(s3_store):
    assert s3_store.stat("blobs/none") is None and not s3_store.exists("blobs/none")
    with pytest.raises(InvalidKey):
        s3_store.stat("../escape")


def test_broken_configuration_names_the_setting(s3_store):
    from farm.server.storage import StorageError
    from farm.server.storage.s3 import S3Store

    endpoint = s3_store.settings.endpoint_url
    cases = {
        "does not exist": S3Settings(
            "no-such-bucket",
            endpoint_url=endpoint,
            access_key_id="farm",
            secret_access_key="farm-secret",
        ),
        "refused the credentials": S3Settings(
            "farm", endpoint_url=endpoint, access_key_id="farm", secret_access_key="wrong"
        ),
        "FARM_S3_ENDPOINT_URL": S3Settings(
            "farm", endpoint_url="http://127.0.0.1:9", access_key_id="x", secret_access_key="y"
        ),
    }
    for message, settings in cases.items():
        with pytest.raises(StorageError, match=message):
            S3Store(settings).check()


def test_storage_url_parsing():
    assert S3Settings.from_url("s3://bucket/a/b/").prefix == "a/b/"
    assert S3Settings.from_url("s3://bucket").prefix == ""


def test_a_file_is_read_once_and_its_digest_tagged(s3_store, tmp_path):
    """A named pipe can be read only once: put_file hashes in the pass that uploads."""
    data = os.urandom(PART_BYTES * 2 + 7)
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    feeder = threading.Thread(target=pipe.write_bytes, args=(data,))
    feeder.start()
    # A second pass would wait for a writer forever: this one lets it read nothing, and fail.
    watchdog = threading.Timer(60, _open_for_writing_if_read, args=(pipe,))
    watchdog.start()
    stored = s3_store.put_file("blobs/piped.blob", pipe)
    watchdog.cancel()
    feeder.join()
    assert stored.sha256 == hashlib.sha256(data).hexdigest() and stored.size == len(data)
    assert s3_store.stat("blobs/piped.blob") == stored  # the digest, from the object's tag


def test_streamed_writes_in_odd_pieces_and_a_discarded_writer(s3_store):
    data = os.urandom(PART_BYTES + PART_BYTES // 2)
    digest = hashlib.sha256(data).hexdigest()
    with s3_store.writer(f"models/{digest}", expected_sha256=digest) as writer:
        for start in range(0, len(data), 5_000_001):
            writer.write(data[start : start + 5_000_001])
        assert writer.commit().sha256 == digest
    assert s3_store.stat(f"models/{digest}").sha256 == digest  # metadata, known up front
    with s3_store.writer("blobs/dropped.blob") as writer:
        writer.write(data)  # one part sent, then the block is left without a commit
    assert not s3_store.exists("blobs/dropped.blob")
    assert s3_store.abort_stale_uploads(timedelta(0)) == []


def test_an_object_whose_writer_died_before_tagging_is_hashed_on_conflict(s3_store, tmp_path):
    data = os.urandom(PART_BYTES + 1)
    s3_store.client.put_object(Bucket=s3_store.bucket, Key=s3_store._key("blobs/u.blob"), Body=data)
    assert s3_store.stat("blobs/u.blob").sha256 == ""  # neither metadata nor tag
    same = s3_store.put_file("blobs/u.blob", write(tmp_path / "a", data))
    assert same.sha256 == hashlib.sha256(data).hexdigest()
    with pytest.raises(ChecksumMismatch, match="write-once"):
        s3_store.put_file("blobs/u.blob", write(tmp_path / "b", os.urandom(PART_BYTES + 1)))


def _open_for_writing_if_read(pipe) -> None:
    with contextlib.suppress(OSError):  # ENXIO: nobody is reading it
        os.close(os.open(pipe, os.O_WRONLY | os.O_NONBLOCK))


def _sent_requests(*clients) -> list:
    """The requests these clients send from now on, as signed."""
    sent: list = []
    for client in clients:
        client.meta.events.register("before-send.s3", lambda request, **_: sent.append(request))
    return sent


def _header(request, name: str) -> str:
    value = request.headers.get(name, "")
    return value.decode() if isinstance(value, bytes) else value


def _signed_headers(request) -> set[str]:
    authorization = _header(request, "Authorization")
    return set(authorization.split("SignedHeaders=")[1].split(",")[0].split(";"))


def test_object_bytes_go_unsigned_beside_a_signed_crc32_the_store_checks(s3_store, tmp_path):
    """The farm hashes every byte it stores: SigV4's payload hash would hash them all again.
    Every other request with a body (completing a multipart upload, tagging) stays signed."""
    data = os.urandom(PART_BYTES + 10)
    sent = _sent_requests(s3_store.client, s3_store.body_client)
    stored = s3_store.put_file("blobs/unsigned.blob", write(tmp_path / "a", data))
    s3_store.put_file("models/small", write(tmp_path / "small", b"weights"))
    assert stored.sha256 == hashlib.sha256(data).hexdigest()

    bodies = [r for r in sent if r.method in ("PUT", "POST")]
    unsigned = [r for r in bodies if _header(r, "X-Amz-Content-SHA256") == "UNSIGNED-PAYLOAD"]
    assert len(unsigned) == 3  # the two parts and the small object's PutObject
    assert all("partNumber=" in r.url or r.url.endswith("/models/small") for r in unsigned)
    for request in unsigned:
        assert "x-amz-checksum-crc32" in _signed_headers(request)
    for request in bodies:
        if request not in unsigned:  # create, complete, tagging: their bodies signed
            payload = request.body or b""
            assert _header(request, "X-Amz-Content-SHA256") == hashlib.sha256(payload).hexdigest()
    assert any("uploadId=" in r.url and r.method == "POST" for r in bodies if r not in unsigned)

    # A body changed on its way is refused by the store's check of that CRC32.
    s3_store.body_client.meta.events.register(
        "before-send.s3.PutObject", lambda request, **_: setattr(request, "body", b"jello")
    )
    with pytest.raises(StorageError, match="BadDigest"):
        s3_store.put_file("blobs/changed.blob", write(tmp_path / "b", b"hello"))
    assert not s3_store.exists("blobs/changed.blob")


def test_without_request_checksums_object_bytes_stay_signed(s3_url, tmp_path):
    from farm.server.storage.s3 import S3Store
    from tests.conftest import S3_CREDENTIALS, S3_ENDPOINT_URL

    settings = S3Settings.from_url(
        s3_url, endpoint_url=S3_ENDPOINT_URL, checksums="when_required", **S3_CREDENTIALS
    )
    store = S3Store(settings)
    assert store.body_client is store.client
    sent = _sent_requests(store.client)
    data = b"weights" * 100
    store.put_file("models/signed", write(tmp_path / "a", data))
    (put,) = [r for r in sent if r.method == "PUT"]
    assert _header(put, "X-Amz-Content-SHA256") == hashlib.sha256(data).hexdigest()
