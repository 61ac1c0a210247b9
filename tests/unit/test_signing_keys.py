"""A worker's signing key: an embedded farm makes its own on first use, a served worker must
be given one (a missing key file is an error, never a new key nobody trusts)."""

from __future__ import annotations

import pytest

from farm.core import signing
from farm.core.errors import KeyFileError
from farm.core.signing import load_signer, public_key_path


def test_no_key_file_configured_means_no_signer():
    assert load_signer(None) is None
    assert load_signer(None, create=True) is None


def test_an_embedded_farm_makes_its_key_once_and_then_keeps_it(tmp_path):
    private = tmp_path / "keys" / "signing.pem"
    private.parent.mkdir()
    made = load_signer(private, create=True)
    assert made is not None and private.exists() and public_key_path(private).exists()
    again = load_signer(private, create=True)
    assert again is not None and again.key_id == made.key_id
    loaded = load_signer(private)
    assert loaded is not None and loaded.key_id == made.key_id


def test_a_missing_key_file_is_not_made_unless_asked(tmp_path):
    private = tmp_path / "signing.pem"
    with pytest.raises(KeyFileError, match=r"signing\.pem: not a readable Ed25519 private key"):
        load_signer(private)
    assert not private.exists()


def test_two_processes_making_the_key_at_once_both_use_the_one_made(tmp_path, monkeypatch):
    """The other process's key lands between our check and our create (simulated): ours is
    refused (FileExistsError) and its key is loaded."""
    private = tmp_path / "signing.pem"
    real_create = signing.create_key_pair

    def the_other_process_first(path):
        real_create(path)
        raise FileExistsError(path)

    monkeypatch.setattr(signing, "create_key_pair", the_other_process_first)
    signer = load_signer(private, create=True)
    assert signer is not None and signer.key_id == signing.Signer.from_file(private).key_id
