"""The signed blob status: what an edge acts on to refuse a quarantined blob, and to refuse an
old answer replayed (docs/architecture.md §14). A stripped, stale, misbound or uncertified
status is refused; a status key certified by a blob signing key signs statuses, never
manifests."""

from __future__ import annotations

from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from farm.core.apikey import ApiSigner, certify_api_key
from farm.core.errors import BlobQuarantined, SignatureError
from farm.core.filecache import BlobCache
from farm.core.signing import Manifest, Signer, TrustedKeys
from farm.core.spec import Toolchain
from farm.core.status import (
    STATUS_CLOCK_SKEW_SECONDS,
    StatusSigner,
    verify_status,
)
from farm.edge.agent import EdgeAgent

KEY, SHA = "a" * 64, "1" * 64
NOW = 1_790_000_000.0
TOOLCHAIN = Toolchain("2026.4.1", runtime_requirements="rr")


def _signer(seed: int) -> Signer:
    return Signer(Ed25519PrivateKey.from_private_bytes(bytes([seed]) * 32))


FARM, STATUS_KEY, STRANGER = _signer(1), _signer(2), _signer(3)
TRUST = TrustedKeys({FARM.key_id: FARM.public_key})


def record(quarantined: bool = False, status_signer: StatusSigner | None = None, at=NOW):
    fields = {
        "cache_key": KEY,
        "sha256": SHA,
        "size_bytes": 10,
        "payload_offset": 0,
        "target": "CPU",
        "toolchain": TOOLCHAIN.as_dict(),
        "weightless": False,
        "model": {"xml": "2" * 64},
    }
    manifest = Manifest.from_record(fields)
    signer = status_signer or StatusSigner(ApiSigner(FARM), 3600)
    return {
        **fields,
        "signing_key_id": FARM.key_id,
        "manifest_signature": FARM.sign_manifest(manifest),
        "quarantined_at": "2026-11-24T20:00:00" if quarantined else None,
        "quarantine_reason": "bad numbers" if quarantined else None,
        "status": signer.signed(KEY, SHA, quarantined, at),
    }


def manifest_of(blob) -> Manifest:
    return Manifest.from_record(blob)


def test_a_current_status_signed_by_the_farm_is_read():
    blob = record(quarantined=True)
    status = verify_status(TRUST, blob, manifest_of(blob), NOW + 60)
    assert (status.state, status.signed_at, status.expires_at) == (
        "quarantined",
        int(NOW),
        int(NOW) + 3600,
    )


def test_a_stripped_status_is_refused_not_read_as_ok():
    blob = record(quarantined=True)
    stripped = {k: v for k, v in blob.items() if k not in ("status", "quarantined_at")}
    with pytest.raises(SignatureError, match="carries no signed status"):
        verify_status(TRUST, stripped, manifest_of(blob), NOW)


def test_a_status_rewritten_to_ok_fails_its_signature():
    blob = record(quarantined=True)
    blob["status"]["document"] = {**blob["status"]["document"], "state": "ok"}
    with pytest.raises(SignatureError, match="invalid signature"):
        verify_status(TRUST, blob, manifest_of(blob), NOW)


def test_an_expired_or_future_status_is_refused():
    blob = record()
    with pytest.raises(SignatureError, match="expired"):
        verify_status(TRUST, blob, manifest_of(blob), NOW + 3600)
    with pytest.raises(SignatureError, match="in the future"):
        verify_status(TRUST, blob, manifest_of(blob), NOW - STATUS_CLOCK_SKEW_SECONDS - 1)
    verify_status(TRUST, blob, manifest_of(blob), NOW - STATUS_CLOCK_SKEW_SECONDS)


def test_a_status_of_other_bytes_is_refused():
    other = StatusSigner(ApiSigner(FARM), 3600).signed(KEY, "9" * 64, False, NOW)
    blob = {**record(), "status": other}
    with pytest.raises(SignatureError, match="about another blob"):
        verify_status(TRUST, blob, manifest_of(blob), NOW)


def test_a_certified_status_key_signs_statuses_and_nothing_else():
    certificate = certify_api_key(FARM, STATUS_KEY.public_key)
    certified = StatusSigner(ApiSigner(STATUS_KEY, certificate), 3600)
    blob = record(status_signer=certified)
    assert verify_status(TRUST, blob, manifest_of(blob), NOW).state == "ok"
    # The certificate does not make the status key a manifest key.
    with pytest.raises(SignatureError, match="does not trust"):
        TRUST.verify_manifest(
            manifest_of(blob), STATUS_KEY.key_id, STATUS_KEY.sign_manifest(manifest_of(blob))
        )


@pytest.mark.parametrize("forgery", ["uncertified", "self-certified", "other key's"])
def test_a_status_key_without_a_trusted_certificate_is_refused(forgery):
    certificate = {
        "uncertified": None,
        "self-certified": certify_api_key(STRANGER, STRANGER.public_key),
        "other key's": certify_api_key(FARM, STATUS_KEY.public_key),
    }[forgery]
    blob = record(status_signer=StatusSigner(ApiSigner(STRANGER, certificate), 3600))
    with pytest.raises(SignatureError):
        verify_status(TRUST, blob, manifest_of(blob), NOW)


def _agent(tmp_path: Path, trust: TrustedKeys | None) -> EdgeAgent:
    cache = BlobCache(tmp_path / "blobs", 2**30)
    return EdgeAgent(None, cache, trust, "edge-1", toolchain=lambda _: TOOLCHAIN)  # type: ignore[arg-type]


def test_the_edge_acts_on_the_signed_state_never_on_the_unsigned_field(tmp_path, monkeypatch):
    import farm.edge.agent as agent_module

    monkeypatch.setattr(agent_module.time, "time", lambda: NOW + 1)
    agent = _agent(tmp_path, TRUST)
    quarantined = record(quarantined=True)
    proxied = {**quarantined, "quarantined_at": None, "quarantine_reason": None}
    with pytest.raises(BlobQuarantined):
        agent.check(proxied, KEY)
    with pytest.raises(SignatureError, match="no signed status"):
        agent.check({k: v for k, v in proxied.items() if k != "status"}, KEY)
    agent.check(record(), KEY)  # ok, and released blobs pass
    agent.allow_quarantined = True
    agent.check(proxied, KEY)


def test_an_edge_that_checks_no_signatures_reads_the_field(tmp_path):
    agent = _agent(tmp_path, None)
    with pytest.raises(BlobQuarantined, match="bad numbers"):
        agent.check({**record(quarantined=True), "status": None}, KEY)


class _FailingAgent:
    """An agent whose import fails the way OpenVINO fails: a RuntimeError under the farm error
    the importer makes of it."""

    def __init__(self, said: str) -> None:
        self.said = said

    def load(self, *args, **kwargs):
        from farm.core.errors import BlobFormatError

        try:
            raise RuntimeError(f"Exception from src/plugin.cpp:42:\n{self.said}")
        except RuntimeError as error:
            raise BlobFormatError("neither an exported blob nor a cache entry") from error


@pytest.mark.parametrize(
    ("said", "cause"),
    [
        ("std::bad_alloc", "out of memory"),
        ("Cannot load library 'libze_loader.so.1'", "a library of the NPU plugin is missing"),
        ("unexpected token", "OpenVINO refused it"),
    ],
)
def test_an_import_that_fails_here_is_an_error_naming_its_cause(said, cause):
    """Not "neither an exported blob nor a cache entry": the bytes are the signed ones."""
    from farm.edge.verify import HarnessError, _import

    with pytest.raises(HarnessError) as raised:
        _import(_FailingAgent(said), KEY, "NPU", None, {})  # type: ignore[arg-type]
    summary = str(raised.value)
    assert summary.startswith(f"could not import the blob on NPU: {cause}")
    assert "\n" not in summary and "neither an exported blob" not in summary
    assert said in raised.value.detail


def test_only_a_source_that_reads_the_database_goes_without_a_signed_status(tmp_path):
    from farm.core.config import Settings
    from farm.edge import agent_from_settings

    class Database:
        reads_database = True

    class Api:
        pass

    settings = Settings(home=tmp_path / "home", cache_dir=tmp_path / "cache", allow_unsigned=True)
    assert agent_from_settings(settings, Database()).status_required is False
    assert agent_from_settings(settings, Api()).status_required is True
    agent = _agent(tmp_path, TRUST)
    agent.status_required = False
    unsigned = {**record(quarantined=True), "status": None}
    with pytest.raises(BlobQuarantined, match="bad numbers"):
        agent.check(unsigned, KEY)
