"""The API's own key (farm/core/apikey.py): a blob signing key certifies it for the purposes it
names (blob statuses, channel documents), never for manifests or references; an edge accepts
its signature only for a purpose a key it trusts certified."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from farm.core.apikey import (
    BLOB_STATUS,
    CHANNEL_DOCUMENT,
    ApiSigner,
    certificate_path,
    certify_api_key,
    status_key_message,
)
from farm.core.channels import Document, verify_document
from farm.core.errors import KeyFileError, SignatureError
from farm.core.signing import Manifest, Signer, TrustedKeys, create_key_pair, key_id
from farm.core.status import BlobStatus, StatusSigner, verify_status

KEY, SHA = "a" * 64, "1" * 64
NOW = 1_790_000_000.0


def _signer(seed: int) -> Signer:
    return Signer(Ed25519PrivateKey.from_private_bytes(bytes([seed]) * 32))


FARM, API, STRANGER = _signer(1), _signer(2), _signer(3)
TRUST = TrustedKeys({FARM.key_id: FARM.public_key})
MANIFEST = Manifest(KEY, SHA, 10, 0, "CPU", {"openvino": "2026.4.1"}, False, {"xml": "2" * 64})
DOCUMENT = Document("cameras", 1, None, None, 0, "create")


def first_certificate(signer: Signer, public) -> dict:
    """A certificate as `farm keys create-status` first wrote it: no purposes."""
    return {
        "key_id": key_id(public),
        "public_key": certify_api_key(signer, public)["public_key"],
        "signer_id": signer.key_id,
        "signature": signer.sign_message(status_key_message(public)),
    }


def sign_status(api: ApiSigner) -> None:
    """Raise unless an edge that trusts FARM accepts a status `api`'s key signed (whatever its
    certificate says: an API that ignores it, or a thief of the key)."""
    status = BlobStatus(KEY, SHA, "ok", int(NOW), int(NOW) + 3600)
    signed = {
        "document": status.document(),
        "signing_key_id": api.key_id,
        "signature": api.signer.sign_message(status.message()),
        "certificate": api.certificate,
    }
    verify_status(TRUST, {"status": signed}, MANIFEST, NOW)


def sign_document(api: ApiSigner) -> None:
    """Raise unless an edge that trusts FARM accepts a channel document `api`'s key signed."""
    signed = api.signer.sign_message(DOCUMENT.message())
    verify_document(TRUST, DOCUMENT, api.key_id, signed, api.certificate)


def test_a_certified_api_key_signs_statuses_and_channel_documents_never_blobs():
    api = ApiSigner(API, certify_api_key(FARM, API.public_key))
    assert api.certificate["purposes"] == [BLOB_STATUS, CHANNEL_DOCUMENT]
    sign_status(api)
    sign_document(api)
    status = StatusSigner(api, 3600).signed(KEY, SHA, True, NOW)  # as the API signs it
    assert verify_status(TRUST, {"status": status}, MANIFEST, NOW).state == "quarantined"
    # TrustedKeys never reads a certificate: the API's key signs no manifest, no reference.
    with pytest.raises(SignatureError, match="does not trust"):
        TRUST.verify_manifest(MANIFEST, API.key_id, API.sign_manifest(MANIFEST))
    reference = {
        "cache_key": KEY,
        "sha256": SHA,
        "reference_sha256": "4" * 64,
        "reference_size_bytes": 12,
        "signing_key_id": API.key_id,
        "reference_signature": API.sign_reference(KEY, SHA, "4" * 64, 12),
    }
    with pytest.raises(SignatureError, match="does not trust"):
        TRUST.verify_reference(reference)


@pytest.mark.parametrize(
    ("certificate", "signs", "refuses"),
    [
        (certify_api_key(FARM, API.public_key, [BLOB_STATUS]), sign_status, sign_document),
        (certify_api_key(FARM, API.public_key, [CHANNEL_DOCUMENT]), sign_document, sign_status),
        (first_certificate(FARM, API.public_key), sign_status, sign_document),
    ],
    ids=["status only", "channel documents only", "first (status) certificate"],
)
def test_a_key_certified_for_one_purpose_signs_that_one_only(certificate, signs, refuses):
    api = ApiSigner(API, certificate)
    signs(api)
    refused = CHANNEL_DOCUMENT if refuses is sign_document else BLOB_STATUS
    with pytest.raises(SignatureError, match=f"certified for .*, not for {refused}"):
        refuses(api)
    with pytest.raises(KeyFileError, match="create-status PATH --if-missing"):
        api.sign(refused, b"anything")  # the API says so before any edge refuses it


def _widened(certificate: dict) -> dict:
    return {**certificate, "purposes": [BLOB_STATUS, CHANNEL_DOCUMENT]}


@pytest.mark.parametrize(
    ("certificate", "said"),
    [
        (None, "no certificate vouches for"),
        (certify_api_key(STRANGER, API.public_key), "certified by key .* does not trust"),
        (certify_api_key(FARM, STRANGER.public_key), "of another key"),
        (_widened(certify_api_key(FARM, API.public_key, [BLOB_STATUS])), "invalid signature"),
        (_widened(first_certificate(FARM, API.public_key)), "invalid signature"),
        ({**certify_api_key(FARM, API.public_key), "purposes": "all"}, "malformed purposes"),
        ({**certify_api_key(FARM, API.public_key), "public_key": "?"}, "malformed"),
    ],
    ids=["none", "untrusted certifier", "another key's", "widened", "first widened", "bad", "?"],
)
def test_a_certificate_no_trusted_key_gave_is_refused(certificate, said):
    with pytest.raises(SignatureError, match=said):
        sign_document(ApiSigner(API, certificate))
    with pytest.raises(SignatureError):
        sign_status(ApiSigner(API, certificate))


@pytest.mark.parametrize("purposes", [[], ["manifest"], [BLOB_STATUS, "reference"]])
def test_a_certificate_names_only_what_the_api_may_sign(purposes):
    with pytest.raises(ValueError, match="certified for some of"):
        certify_api_key(FARM, API.public_key, purposes)


def test_the_api_key_is_read_with_its_certificate(tmp_path):
    path = tmp_path / "api.pem"
    create_key_pair(path)
    with pytest.raises(KeyFileError, match="no readable certificate"):
        ApiSigner.from_file(path)
    certificate_path(path).write_text(json.dumps(certify_api_key(FARM, STRANGER.public_key)))
    with pytest.raises(KeyFileError, match="not the certificate of"):
        ApiSigner.from_file(path)
    api_key = Signer.from_file(path)
    certificate_path(path).write_text(json.dumps(certify_api_key(FARM, api_key.public_key)))
    loaded = ApiSigner.from_file(path)
    assert loaded.key_id == api_key.key_id and loaded.may_sign(CHANNEL_DOCUMENT)


def test_create_status_certifies_every_purpose_and_upgrades_a_first_certificate(
    tmp_path, monkeypatch
):
    from farm.cli import main

    signing = tmp_path / "signing.pem"
    create_key_pair(signing)
    farm = Signer.from_file(signing)
    monkeypatch.setenv("FARM_SIGNING_KEY", str(signing))
    monkeypatch.setenv("FARM_HOME", str(tmp_path / "home"))
    path = tmp_path / "api" / "api.pem"
    create_key_pair(path)
    api_key = Signer.from_file(path)
    certificate_path(path).write_text(json.dumps(first_certificate(farm, api_key.public_key)))
    assert not ApiSigner.from_file(path).may_sign(CHANNEL_DOCUMENT)

    def create(*extra: str) -> dict:
        done = CliRunner().invoke(main, ["keys", "create-status", str(path), *extra, "--json"])
        assert done.exit_code == 0, done.output
        return json.loads(done.output)

    made = create("--if-missing")
    assert made["purposes"] == [BLOB_STATUS, CHANNEL_DOCUMENT]
    assert (made["key_id"], made["certified_by"]) == (api_key.key_id, farm.key_id)
    api = ApiSigner.from_file(path)
    assert api.may_sign(CHANNEL_DOCUMENT)
    trust = TrustedKeys({farm.key_id: farm.public_key})
    signed = api.sign(CHANNEL_DOCUMENT, DOCUMENT.message())
    verify_document(
        trust, DOCUMENT, signed["signing_key_id"], signed["signature"], signed["certificate"]
    )
    assert create("--if-missing") == made  # kept as it is
    refused = CliRunner().invoke(main, ["keys", "create-status", str(path), "--json"])
    assert refused.exit_code != 0 and "never overwritten" in refused.output
