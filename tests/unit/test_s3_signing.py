"""Which S3 requests leave their body out of the SigV4 signature (`farm.server.storage.s3`):
only those that send an object's bytes, and only beside a request checksum. The requests
themselves are checked against SeaweedFS in tests/integration/test_storage_s3.py."""

from __future__ import annotations

import pytest

from farm.server.storage.s3 import S3Settings, S3Store


def store(checksums: str) -> S3Store:
    return S3Store(
        S3Settings(
            bucket="farm",
            endpoint_url="http://127.0.0.1:9",  # never reached: no request is made
            access_key_id="a",
            secret_access_key="s",
            checksums=checksums,
        )
    )


@pytest.mark.parametrize("checksums", ["when_supported", "WHEN_SUPPORTED", "When_Supported"])
def test_object_bytes_go_unsigned_beside_request_checksums(checksums):
    s3 = store(checksums)
    assert s3.body_client is not s3.client
    assert s3.body_client.meta.config.s3 == {"payload_signing_enabled": False}
    assert not s3.client.meta.config.s3  # every other request: signed as boto3 signs it


def test_without_request_checksums_object_bytes_stay_signed():
    s3 = store("when_required")
    assert s3.body_client is s3.client
    assert not s3.client.meta.config.s3
