"""S3-compatible object storage (AWS S3, SeaweedFS, MinIO) through boto3.

- Objects are written once: `If-None-Match: *` on the PUT (or on completing a multipart upload).
  A 412 means another writer got there first; that is fine when its sha256 equals ours.
- The sha256 of the whole object is computed in the one pass that sends it, and stored with it
  (ETags and multipart checksums are not content hashes): as metadata (`x-amz-meta-sha256`)
  when known before the first byte (an expected digest, or a one-part object), else as the
  object's `sha256` tag after the upload. Bytes that do not match an expected digest are
  refused before the object exists (the multipart upload is aborted).
- Big files go up in parts, a bounded number at once, so memory stays at
  ``PART_BYTES * PARALLEL_PARTS`` whatever the file size.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, BinaryIO

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from farm.core import hashing
from farm.core.errors import AlreadyStored
from farm.server.storage import (
    AbortsStaleUploads,
    BlobStore,
    ListsObjects,
    ObjectWriter,
    Presigning,
    StorageError,
    StoredObject,
    check_key,
)

PART_BYTES = 16 * 2**20
"""Multipart part size: S3 allows 10,000 parts, so this covers objects up to 160 GiB."""
PARALLEL_PARTS = 4
"""Parts in flight at once (uploads and ranged downloads)."""
SHA256_METADATA = "sha256"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class S3Settings:
    bucket: str
    prefix: str = ""
    endpoint_url: str | None = None
    region: str | None = None
    access_key_id: str | None = None
    """None: boto3's standard credential chain (environment, profile, instance role)."""
    secret_access_key: str | None = None
    checksums: str = "when_supported"
    """boto3's request checksums: 'when_supported' (its default) or 'when_required' for stores
    that reject the newer CRC checksum headers."""

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> S3Settings:
        """``s3://bucket/some/prefix`` → bucket ``bucket``, prefix ``some/prefix/``."""
        rest = url.removeprefix("s3://")
        bucket, _, prefix = rest.partition("/")
        if not bucket:
            raise StorageError(f"storage URL {url!r} names no bucket (s3://BUCKET/PREFIX)")
        prefix = prefix.strip("/")
        return cls(bucket=bucket, prefix=f"{prefix}/" if prefix else "", **kwargs)


class S3Store(BlobStore, Presigning, AbortsStaleUploads, ListsObjects):
    def __init__(self, settings: S3Settings) -> None:
        self.settings = settings
        self.bucket = settings.bucket
        self.client = self._new_client(unsigned_bodies=False)

    def _new_client(self, *, unsigned_bodies: bool) -> Any:
        s3_options = {"payload_signing_enabled": False} if unsigned_bodies else {}
        return boto3.client(
            "s3",
            endpoint_url=self.settings.endpoint_url,
            region_name=self.settings.region or "us-east-1",
            aws_access_key_id=self.settings.access_key_id,
            aws_secret_access_key=self.settings.secret_access_key,
            config=Config(
                request_checksum_calculation=self.settings.checksums,
                response_checksum_validation=self.settings.checksums,
                retries={"max_attempts": 5, "mode": "standard"},
                max_pool_connections=PARALLEL_PARTS * 2,
                connect_timeout=5,
                read_timeout=60,
                s3=s3_options,
            ),
        )

    @functools.cached_property
    def body_client(self) -> Any:
        """The client that sends an object's bytes (PutObject, UploadPart): see
        `_bodies_go_unsigned`. Every other request goes through `client`, signed as boto3
        signs it."""
        if _bodies_go_unsigned(self.settings):
            return self._new_client(unsigned_bodies=True)
        return self.client

    def __repr__(self) -> str:
        return f"S3Store(s3://{self.bucket}/{self.settings.prefix})"

    def _key(self, key: str) -> str:
        return self.settings.prefix + check_key(key)

    # --- checks -----------------------------------------------------------------------------

    def check(self) -> None:
        """Fail with one line naming the setting to fix when the bucket cannot be reached."""
        where = self.settings.endpoint_url or "AWS S3"
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except ClientError as error:
            code = error.response.get("Error", {}).get("Code", "")
            if code in ("404", "NoSuchBucket"):
                raise StorageError(
                    f"bucket {self.bucket!r} does not exist at {where} (FARM_STORAGE_URL)"
                ) from error
            if code in ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
                raise StorageError(
                    f"S3 at {where} refused the credentials for bucket {self.bucket!r} "
                    "(FARM_S3_ACCESS_KEY_ID / FARM_S3_SECRET_ACCESS_KEY or AWS_* variables)"
                ) from error
            raise StorageError(f"S3 at {where}: {error}") from error
        except BotoCoreError as error:
            raise StorageError(
                f"cannot reach S3 at {where} (FARM_S3_ENDPOINT_URL): {error}"
            ) from error

    # --- writes -----------------------------------------------------------------------------

    def writer(self, key: str, expected_sha256: str | None = None) -> ObjectWriter:
        return _S3Writer(self, key, expected_sha256)

    def _abort(self, object_key: str, upload_id: str) -> None:
        # On failure the reconciler aborts the stale upload later.
        with contextlib.suppress(ClientError, BotoCoreError):
            self.client.abort_multipart_upload(
                Bucket=self.bucket, Key=object_key, UploadId=upload_id
            )

    def _already_written(self, key: str, size: int, sha256: str) -> StoredObject:
        existing = self.stat(key)
        if existing is not None and not existing.sha256:
            # Its writer stopped between completing the upload and tagging it.
            with self.open_read(key) as body:
                existing = StoredObject(key, existing.size, hashing.sha256_stream(body))
        if existing is None or existing.sha256 != sha256:
            found = existing.sha256 if existing else "nothing"
            raise AlreadyStored(
                f"{key} is already written with sha256 {found}, not {sha256}; objects are "
                "write-once, so this is a conflict to investigate"
            )
        return StoredObject(key, size, sha256)

    def abort_stale_uploads(self, older_than: timedelta) -> list[str]:
        """Abort multipart uploads under our prefix idle for `older_than`: no part received
        since (an upload with no part yet: begun before). How long ago an upload began says
        nothing: an 80 MiB model at 1 MiB/s takes 80 s, a big one over a slow link hours, and
        aborting it makes its last request fail (NoSuchUpload)."""
        cutoff = datetime.now(UTC) - older_than
        aborted = []
        paginator = self.client.get_paginator("list_multipart_uploads")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=self.settings.prefix):
            for upload in page.get("Uploads", []):
                key, upload_id, began = upload["Key"], upload["UploadId"], upload["Initiated"]
                if began >= cutoff:
                    continue  # no part can be older than the upload
                last = self._last_activity(key, upload_id, began)
                if last is not None and last < cutoff:
                    self._abort(key, upload_id)
                    aborted.append(key)
        return aborted

    def _last_activity(self, object_key: str, upload_id: str, began: datetime) -> datetime | None:
        """When the upload last received a part (with none yet: when it began); None: it is
        gone (completed or aborted since it was listed)."""
        newest = began
        paginator = self.client.get_paginator("list_parts")
        try:
            for page in paginator.paginate(Bucket=self.bucket, Key=object_key, UploadId=upload_id):
                for part in page.get("Parts", []):
                    newest = max(newest, part["LastModified"])
        except ClientError as error:
            if error.response.get("Error", {}).get("Code") == "NoSuchUpload":
                return None
            raise
        return newest

    # --- reads ------------------------------------------------------------------------------

    def get_file(self, key: str, dest: str | Path) -> None:
        try:
            self.client.download_file(
                self.bucket,
                self._key(key),
                str(dest),
                Config=TransferConfig(
                    multipart_threshold=PART_BYTES,
                    multipart_chunksize=PART_BYTES,
                    max_concurrency=PARALLEL_PARTS,
                ),
            )
        except (ClientError, BotoCoreError) as error:
            raise StorageError(f"S3 read of {key} failed: {error}") from error

    def open_read(self, key: str) -> BinaryIO:
        return self.read_range(key)

    def read_range(self, key: str, start: int = 0, end: int | None = None) -> BinaryIO:
        """A streaming body of bytes `start`..`end` (inclusive), or to the end."""
        kwargs = {}
        if start or end is not None:
            kwargs["Range"] = f"bytes={start}-{'' if end is None else end}"
        try:
            return self.client.get_object(Bucket=self.bucket, Key=self._key(key), **kwargs)["Body"]
        except (ClientError, BotoCoreError) as error:
            raise StorageError(f"S3 read of {key} failed: {error}") from error

    def presigned_url(self, key: str, expires_seconds: int = 900) -> str:
        return self.client.generate_presigned_url(
            "get_object",
            Params={"Bucket": self.bucket, "Key": self._key(key)},
            ExpiresIn=expires_seconds,
        )

    def stat(self, key: str) -> StoredObject | None:
        try:
            head = self.client.head_object(Bucket=self.bucket, Key=self._key(key))
        except ClientError as error:
            if _status(error) == 404:
                return None
            raise StorageError(f"S3 stat of {key} failed: {error}") from error
        except BotoCoreError as error:
            raise StorageError(f"S3 stat of {key} failed: {error}") from error
        sha256 = head["Metadata"].get(SHA256_METADATA) or (
            self._tagged_sha256(key) if head.get("TagCount") else ""
        )
        return StoredObject(key, head["ContentLength"], sha256)

    def _tagged_sha256(self, key: str) -> str:
        with _errors(f"S3 stat of {key}"):
            tags = self.client.get_object_tagging(Bucket=self.bucket, Key=self._key(key))
        return next((t["Value"] for t in tags["TagSet"] if t["Key"] == SHA256_METADATA), "")

    def exists(self, key: str) -> bool:
        return self.stat(key) is not None

    def list_objects(self, prefix: str) -> Iterator[tuple[str, int, datetime]]:
        paginator = self.client.get_paginator("list_objects_v2")
        with _errors(f"S3 listing of {prefix}"):
            for page in paginator.paginate(
                Bucket=self.bucket, Prefix=self._key(prefix.rstrip("/")) + "/"
            ):
                for item in page.get("Contents", []):
                    key = item["Key"].removeprefix(self.settings.prefix)
                    yield key, item["Size"], item["LastModified"]

    def delete(self, key: str) -> None:
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self._key(key))
        except (ClientError, BotoCoreError) as error:
            raise StorageError(f"S3 delete of {key} failed: {error}") from error


def _bodies_go_unsigned(settings: S3Settings) -> bool:
    """Whether an object's bytes are left out of the SigV4 signature of the request that
    sends them. Over HTTPS boto3 leaves them out already (their CRC32 in a trailer, under
    TLS); over plain HTTP it hashes every part once more, after the farm's own sha256 of the
    same bytes: 0.3 CPU-seconds per 512 MB, taken from the cores a local S3 server needs
    (bench/README.md). Left out only when each body goes with its CRC32 (``when_supported``;
    over plain HTTP in a signed header), which the store checks, so a body damaged on the way
    is refused; without request checksums (``when_required``) bodies stay signed. Whoever
    could change a body on purpose over plain HTTP could as well change what a read returns,
    which no signature covers (SECURITY.md, "Writes to S3")."""
    return settings.checksums.lower() == "when_supported"


def _status(error: ClientError) -> int:
    return int(error.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))


@contextlib.contextmanager
def _errors(what: str):
    try:
        yield
    except (ClientError, BotoCoreError) as error:
        raise StorageError(f"{what} failed: {error}") from error


class _S3Writer(ObjectWriter):
    """Parts of PART_BYTES go up as they fill, PARALLEL_PARTS at once; an object that fits in
    one part is one PUT at commit. Completing the upload (or the PUT) is what makes the object
    visible, with `If-None-Match: *`: a 412 means someone else wrote it first.

    The sha256 goes with the object: as metadata when known before the first byte (an
    expected digest, or a one-part object), else as the object's `sha256` tag once the
    upload is complete: hashing the file first would read it twice.
    """

    chunk_bytes = PART_BYTES

    def __init__(self, store: S3Store, key: str, expected_sha256: str | None) -> None:
        super().__init__(key, expected_sha256)
        self.store, self.client, self.bucket = store, store.client, store.bucket
        self.object_key = store._key(key)
        self._buffer = bytearray()
        self._upload_id: str | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._in_flight: deque[tuple[int, Future]] = deque()
        self._parts: list[dict] = []

    def _write(self, data: bytes) -> None:
        if not self._buffer and len(data) == PART_BYTES:
            self._send(data)  # a whole part: no copy
            return
        self._buffer += data
        while len(self._buffer) >= PART_BYTES:
            self._send(bytes(memoryview(self._buffer)[:PART_BYTES]))  # one copy, not two
            del self._buffer[:PART_BYTES]

    def _send(self, part: bytes) -> None:
        if self._upload_id is None:
            metadata = {SHA256_METADATA: self.expected_sha256} if self.expected_sha256 else {}
            with _errors(f"S3 write of {self.key}"):
                self._upload_id = self.client.create_multipart_upload(
                    Bucket=self.bucket, Key=self.object_key, Metadata=metadata
                )["UploadId"]
            self._pool = ThreadPoolExecutor(PARALLEL_PARTS, thread_name_prefix="s3-part")
        if len(self._in_flight) >= PARALLEL_PARTS:
            self._collect_oldest()
        number = len(self._parts) + len(self._in_flight) + 1
        assert self._pool is not None  # made with the upload, above
        future = self._pool.submit(
            self.store.body_client.upload_part,
            Bucket=self.bucket,
            Key=self.object_key,
            UploadId=self._upload_id,
            PartNumber=number,
            Body=part,
        )
        self._in_flight.append((number, future))

    def _collect_oldest(self) -> None:
        number, future = self._in_flight.popleft()
        with _errors(f"S3 write of {self.key}"):
            self._parts.append({"PartNumber": number, "ETag": future.result()["ETag"]})

    def _commit(self, sha256: str) -> StoredObject:
        try:
            if self._upload_id is None:
                self.store.body_client.put_object(
                    Bucket=self.bucket,
                    Key=self.object_key,
                    Body=bytes(self._buffer),
                    IfNoneMatch="*",
                    Metadata={SHA256_METADATA: sha256},
                )
            else:
                self._complete(sha256)
        except ClientError as error:
            if _status(error) == 412:
                self._discard()
                return self.store._already_written(self.key, self.size, sha256)
            raise StorageError(f"S3 write of {self.key} failed: {error}") from error
        except BotoCoreError as error:
            raise StorageError(f"S3 write of {self.key} failed: {error}") from error
        return StoredObject(self.key, self.size, sha256)

    def _complete(self, sha256: str) -> None:
        if self._buffer:
            self._send(bytes(self._buffer))
            self._buffer.clear()
        while self._in_flight:
            self._collect_oldest()
        self.client.complete_multipart_upload(
            Bucket=self.bucket,
            Key=self.object_key,
            UploadId=self._upload_id,
            MultipartUpload={"Parts": self._parts},
            IfNoneMatch="*",
        )
        self._upload_id = None  # complete: nothing left to abort
        if self._pool is not None:
            self._pool.shutdown()
        if self.expected_sha256 is None:
            self._tag(sha256)

    def _tag(self, sha256: str) -> None:
        try:
            self.client.put_object_tagging(
                Bucket=self.bucket,
                Key=self.object_key,
                Tagging={"TagSet": [{"Key": SHA256_METADATA, "Value": sha256}]},
            )
        except (ClientError, BotoCoreError) as error:
            # The object is whole and the caller records its digest; a later writer of the
            # same key hashes the object instead of reading the tag (S3Store._already_written).
            log.warning("could not tag %s with its sha256: %s", self.key, error)

    def _discard(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        if self._upload_id is not None:
            # Parts still in flight may land after the abort; the reconciler aborts it again.
            self.store._abort(self.object_key, self._upload_id)
            self._upload_id = None
