"""S3-compatible object storage (AWS S3, SeaweedFS, MinIO) through boto3.

- Objects are written once: `If-None-Match: *` on the PUT (or on completing a multipart upload).
  A 412 means another writer got there first; that is fine when its sha256 equals ours.
- The sha256 of the whole file is stored as object metadata (`x-amz-meta-sha256`): ETags and
  multipart checksums are not content hashes. It is computed again while the bytes go out, and
  a file that changed under the upload is refused (the multipart upload is aborted).
- Big files go up in parts, a bounded number at once, so memory stays at
  ``PART_BYTES * PARALLEL_PARTS`` whatever the file size.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, BinaryIO

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from farm import hashing
from farm.storage import BlobStore, ChecksumMismatch, StorageError, StoredObject, check_key

PART_BYTES = 16 * 2**20
"""Multipart part size: S3 allows 10,000 parts, so this covers objects up to 160 GiB."""
PARALLEL_PARTS = 4
"""Parts in flight at once (uploads and ranged downloads)."""
SHA256_METADATA = "sha256"


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


class S3Store(BlobStore):
    def __init__(self, settings: S3Settings) -> None:
        self.settings = settings
        self.bucket = settings.bucket
        self.client = boto3.client(
            "s3",
            endpoint_url=settings.endpoint_url,
            region_name=settings.region or "us-east-1",
            aws_access_key_id=settings.access_key_id,
            aws_secret_access_key=settings.secret_access_key,
            config=Config(
                request_checksum_calculation=settings.checksums,
                response_checksum_validation=settings.checksums,
                retries={"max_attempts": 5, "mode": "standard"},
                max_pool_connections=PARALLEL_PARTS * 2,
                connect_timeout=5,
                read_timeout=60,
            ),
        )

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

    def put_file(
        self, key: str, path: str | Path, expected_sha256: str | None = None
    ) -> StoredObject:
        path = Path(path)
        size = path.stat().st_size
        # The metadata goes with the first request, before any byte: so the digest is known
        # first (content-addressed models bring theirs), and verified again on the way out.
        sha256 = expected_sha256 or hashing.sha256_file(path)
        try:
            if size <= PART_BYTES:
                self._put_small(key, path, sha256)
            else:
                self._put_multipart(key, path, sha256)
        except ClientError as error:
            if _status(error) == 412:
                return self._already_written(key, size, sha256)
            raise StorageError(f"S3 write of {key} failed: {error}") from error
        except BotoCoreError as error:
            raise StorageError(f"S3 write of {key} failed: {error}") from error
        return StoredObject(key, size, sha256)

    def _put_small(self, key: str, path: Path, sha256: str) -> None:
        data = path.read_bytes()
        actual = hashlib.sha256(data).hexdigest()
        if actual != sha256:
            raise ChecksumMismatch(f"{path}: sha256 is {actual}, expected {sha256}; not stored")
        self.client.put_object(
            Bucket=self.bucket,
            Key=self._key(key),
            Body=data,
            IfNoneMatch="*",
            Metadata={SHA256_METADATA: sha256},
        )

    def _put_multipart(self, key: str, path: Path, sha256: str) -> None:
        object_key = self._key(key)
        upload_id = self.client.create_multipart_upload(
            Bucket=self.bucket, Key=object_key, Metadata={SHA256_METADATA: sha256}
        )["UploadId"]
        try:
            parts = self._upload_parts(object_key, upload_id, path, sha256)
            self.client.complete_multipart_upload(
                Bucket=self.bucket,
                Key=object_key,
                UploadId=upload_id,
                MultipartUpload={"Parts": parts},
                IfNoneMatch="*",
            )
        except BaseException:
            self._abort(object_key, upload_id)
            raise

    def _upload_parts(self, object_key: str, upload_id: str, path: Path, sha256: str) -> list:
        digest = hashlib.sha256()
        in_flight: deque[tuple[int, Future]] = deque()
        parts = []
        with ThreadPoolExecutor(PARALLEL_PARTS) as pool, open(path, "rb") as source:
            number = 0
            while chunk := source.read(PART_BYTES):
                number += 1
                digest.update(chunk)
                if len(in_flight) >= PARALLEL_PARTS:
                    parts.append(_part(*_wait(in_flight.popleft())))
                future = pool.submit(
                    self.client.upload_part,
                    Bucket=self.bucket,
                    Key=object_key,
                    UploadId=upload_id,
                    PartNumber=number,
                    Body=chunk,
                )
                in_flight.append((number, future))
            while in_flight:
                parts.append(_part(*_wait(in_flight.popleft())))
        if digest.hexdigest() != sha256:
            raise ChecksumMismatch(
                f"{path}: sha256 while uploading was {digest.hexdigest()}, expected {sha256}; "
                "the file changed or is not the one hashed. Not stored."
            )
        return parts

    def _abort(self, object_key: str, upload_id: str) -> None:
        # On failure the reconciler aborts the stale upload later.
        with contextlib.suppress(ClientError, BotoCoreError):
            self.client.abort_multipart_upload(
                Bucket=self.bucket, Key=object_key, UploadId=upload_id
            )

    def _already_written(self, key: str, size: int, sha256: str) -> StoredObject:
        existing = self.stat(key)
        if existing is None or existing.sha256 != sha256:
            found = existing.sha256 if existing else "nothing"
            raise ChecksumMismatch(
                f"{key} is already written with sha256 {found}, not {sha256}; objects are "
                "write-once, so this is a conflict to investigate"
            )
        return StoredObject(key, size, sha256)

    def abort_stale_uploads(self, older_than: timedelta) -> list[str]:
        """Abort multipart uploads under our prefix started before now - `older_than`."""
        cutoff = datetime.now(UTC) - older_than
        aborted = []
        paginator = self.client.get_paginator("list_multipart_uploads")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=self.settings.prefix):
            for upload in page.get("Uploads", []):
                if upload["Initiated"] < cutoff:
                    self._abort(upload["Key"], upload["UploadId"])
                    aborted.append(upload["Key"])
        return aborted

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

    def presigned_url(self, key: str, expires_seconds: int = 3600) -> str:
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
        return StoredObject(key, head["ContentLength"], head["Metadata"].get(SHA256_METADATA, ""))

    def exists(self, key: str) -> bool:
        return self.stat(key) is not None

    def delete(self, key: str) -> None:
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self._key(key))
        except (ClientError, BotoCoreError) as error:
            raise StorageError(f"S3 delete of {key} failed: {error}") from error


def _status(error: ClientError) -> int:
    return int(error.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))


def _wait(item: tuple[int, Future]) -> tuple[int, dict]:
    number, future = item
    return number, future.result()


def _part(number: int, response: dict) -> dict:
    return {"PartNumber": number, "ETag": response["ETag"]}
