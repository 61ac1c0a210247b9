"""Channels: the pure rules an edge applies (its stage bucket, the signed document, replay
refusal) pinned by golden vectors, and the farm's rules on SQLite (moves, gates, force, the
audit, rollback, gc keeping what a kept revision names)."""

from __future__ import annotations

import hashlib

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import select

from farm.core import apikey, channels
from farm.core.apikey import ApiSigner, certify_api_key
from farm.core.channels import Document, Entry, Revision, check_successor
from farm.core.errors import (
    ChannelReplay,
    Conflict,
    IntegrityMismatch,
    KeyFileError,
    NotFound,
    PromotionBlocked,
    SignatureError,
    SpecError,
)
from farm.core.signing import Signer, TrustedKeys
from farm.server.blobs import gc, verifications
from farm.server.channels import service, status
from farm.server.db.models import Blob, ChannelMove
from tests.unit.conftest import CPU, TOOLCHAIN, add_blob, add_model, key, sha256

SEED = bytes(range(32))
MODEL = {"bin": "2" * 64, "xml": "1" * 64}


def signer() -> Signer:
    return Signer(Ed25519PrivateKey.from_private_bytes(SEED))


def document(sequence: int = 3, percent: int = 10, channel: str = "cameras") -> Document:
    stable = Revision(1, (Entry("unet.xml", MODEL, CPU),))
    candidate = Revision(2, (Entry("unet.xml", {**MODEL, "bin": "3" * 64}, CPU),))
    return Document(channel, sequence, stable, candidate, percent, "promote")


# --- the edge's rules ------------------------------------------------------------------------


def test_buckets_are_pinned_stable_and_spread():
    """The stage an edge falls in must not change between farm versions: the same edges go
    first every time (a changed bucket moves edges between revisions on an upgrade)."""
    assert [channels.bucket("cameras", f"edge-{n}") for n in range(3)] == [9736, 3476, 2025]
    assert channels.bucket("other", "edge-0") != channels.bucket("cameras", "edge-0")
    agents = [f"edge-{n}" for n in range(2000)]
    chosen = {p: {a for a in agents if channels.in_stage("cameras", a, p)} for p in (10, 50, 100)}
    assert 150 < len(chosen[10]) < 250 and 900 < len(chosen[50]) < 1100
    assert chosen[10] < chosen[50] < chosen[100] == set(agents)  # a stage only grows


def test_the_document_decides_per_edge():
    doc = document(percent=10)
    picked = {a: doc.revision_for(a) for a in (f"edge-{n}" for n in range(100))}
    assert {r.number for r in picked.values() if r} == {1, 2}
    for agent, revision in picked.items():
        assert revision.number == (2 if channels.in_stage("cameras", agent, 10) else 1)
    stable_only = Document("cameras", 4, doc.stable, None, 0, "rollback")
    assert stable_only.revision_for("edge-1").number == 1
    assert Document("cameras", 1, None, None, 0, "create").revision_for("edge-1") is None


def test_the_channel_signature_is_pinned_and_its_own_message_type():
    doc = document()
    message = doc.message()
    assert message.startswith(b"farm-channel-v1\n")
    # Golden: edges of every version check these bytes; a change is a new CHANNEL_VERSION.
    assert hashlib.sha256(message).hexdigest() == (
        "a112a93cf7b96e4f8498bd09fc2cd52eb721e34a57f8af6f60ef65c661da173d"
    )
    signature = channels.sign_document(signer(), doc)
    assert signature == (
        "fD/pnThzhzJUG6k5+iNJuehwssZBCdHrDsnIqz2MaID73vazU1uBdXfJWFRWVAaxxR0IjtEw+q1a02ah7ifACA=="
    )
    trust = TrustedKeys({}).with_key(signer().public_key)
    channels.verify_document(trust, doc, signer().key_id, signature)
    # The same bytes signed as a blob manifest never pass as a channel document.
    manifest_signature = signer().sign("0" * 64, "0" * 64)
    with pytest.raises(SignatureError):
        channels.verify_document(trust, doc, signer().key_id, manifest_signature)


def test_a_changed_document_or_an_untrusted_key_is_refused():
    doc, trust = document(), TrustedKeys({}).with_key(signer().public_key)
    signature = channels.sign_document(signer(), doc)
    for changed in (
        document(percent=100),
        document(sequence=4),
        Document("cameras", 3, doc.stable, None, 0, "promote"),
    ):
        with pytest.raises(SignatureError, match="invalid signature"):
            channels.verify_document(trust, changed, signer().key_id, signature)
    with pytest.raises(SignatureError, match="not signed"):
        channels.verify_document(trust, doc, None, None)
    stranger = Signer(Ed25519PrivateKey.generate())
    with pytest.raises(SignatureError, match="does not trust"):
        channels.verify_document(trust, doc, stranger.key_id, channels.sign_document(stranger, doc))


def test_a_round_trip_keeps_every_field_and_malformed_documents_are_refused():
    doc = document()
    assert Document.from_dict(doc.as_dict()) == doc
    for broken in (
        {**doc.as_dict(), "v": 2},
        {**doc.as_dict(), "sequence": -1},
        {**doc.as_dict(), "percent": 101},
        {**doc.as_dict(), "move": "delete"},
        {**doc.as_dict(), "channel": "Bad Name"},
        {**doc.as_dict(), "stable": {"revision": 1, "entries": [{"model": {"xml": "x"}}]}},
        None,
    ):
        with pytest.raises((IntegrityMismatch, SpecError)):
            Document.from_dict(broken)


def test_replays_and_swaps_are_refused():
    check_successor(None, document(3))
    check_successor(document(3), document(3))  # the same document again: nothing to do
    check_successor(document(3), document(4))
    with pytest.raises(ChannelReplay, match="older than"):
        check_successor(document(3), document(2))
    with pytest.raises(ChannelReplay, match="different document"):
        check_successor(document(3), document(3, percent=50))
    with pytest.raises(IntegrityMismatch, match="swapped"):
        check_successor(document(3), document(4, channel="other"))


def test_names_and_percents_are_checked():
    for name in ("", "Upper", "a b", "-x", "x" * 64):
        with pytest.raises(SpecError):
            channels.check_name(name)
    for percent in (0, 101, True, 1.5):
        with pytest.raises(SpecError):
            channels.check_percent(percent)


def test_an_entrys_key_is_the_blobs_key_for_the_edges_toolchain():
    from farm.core.identity import key_for

    entry = Entry("unet.xml", MODEL, CPU)
    assert entry.cache_key(TOOLCHAIN) == key_for(MODEL, CPU, TOOLCHAIN)
    assert Entry.from_dict(entry.as_dict()) == entry


# --- the farm's rules --------------------------------------------------------------------------


def model_entry(farm, name: str) -> Entry:
    add_model(farm, name)
    return Entry(name, {"xml": sha256(name.encode() + b"x"), "bin": sha256(name.encode())}, CPU)


def promote(farm, number: int, percent: int, force: bool = False, min_verifications: int = 1):
    with farm.session() as session:
        return service.promote(
            session,
            farm.api_signer,
            "cameras",
            number,
            percent,
            "alice",
            min_verifications=min_verifications,
            force=force,
        )


def verification(farm, cache_key: str, passed: bool) -> None:
    with farm.session() as session:
        row = session.scalar(select(Blob).where(Blob.cache_key == cache_key))
        report = {
            "agent_id": "edge-1",
            "device_name": "CPU",
            "openvino_version": "2026.4.1",
            "passed": passed,
            "tolerance": {"atol": 0.01, "rtol": 0.02, "min_cosine": 0.999},
            "outputs": [],
            "runs": 1,
        }
        verifications.record_verification(session, cache_key, row.sha256, report, False)


def test_moves_gates_force_audit_and_rollback(embedded_farm):
    farm = embedded_farm
    one, two = model_entry(farm, "one"), model_entry(farm, "two")
    with farm.session() as session:
        service.create(session, farm.api_signer, "cameras", "alice")
        with pytest.raises(Conflict):
            service.create(session, farm.api_signer, "cameras", "alice")
        with pytest.raises(NotFound, match="submit it first"):
            service.set_revision(
                session, farm.api_signer, "cameras", [Entry("x", {"onnx": "9" * 64}, CPU)], "alice"
            )
        service.set_revision(session, farm.api_signer, "cameras", [one], "alice")
        service.set_revision(session, farm.api_signer, "cameras", [one, two], "bob")
        channel = service.get(session, "cameras")
        # The first revision runs at once; the second waits for a promotion.
        assert (channel.stable_revision, channel.candidate_revision, channel.sequence) == (
            1,
            None,
            2,
        )
    first = promote(farm, 2, 10)  # the first stage is not gated
    assert (first.candidate_revision, first.percent, first.sequence) == (2, 10, 3)
    with pytest.raises(PromotionBlocked, match="0 passed verification"):
        promote(farm, 2, 50)  # no blob of `two` yet, nothing verified

    blob_one = add_blob(farm, 1, key(1))
    blob_two = add_blob(farm, 2, key(2))
    verification(farm, blob_one.cache_key, True)
    verification(farm, blob_two.cache_key, True)
    verification(farm, blob_two.cache_key, False)
    with pytest.raises(PromotionBlocked, match="1 failed verification") as refused:
        promote(farm, 2, 50)
    assert refused.value.details["problems"]
    with farm.session() as session:
        verifications.quarantine(session, blob_two.cache_key, "wrong outputs")
        gates = status.status(session, "cameras", 1)["gates"]
        assert any("quarantined" in problem for problem in gates)  # the rollout is halted
    forced = promote(farm, 2, 50, force=True)
    assert (forced.candidate_revision, forced.percent) == (2, 50)
    with pytest.raises(Conflict, match="rollback"):
        promote(farm, 2, 20)
    done = promote(farm, 2, 100, force=True)
    assert (done.stable_revision, done.candidate_revision, done.previous_revisions) == (
        2,
        None,
        [1],
    )

    with farm.session() as session:
        moves = list(session.scalars(select(ChannelMove).order_by(ChannelMove.id)))
        assert [(m.action, m.revision, m.percent, m.forced) for m in moves] == [
            ("create", None, None, False),
            ("set", 1, None, False),
            ("set", 2, None, False),
            ("promote", 2, 10, False),
            ("promote", 2, 50, True),
            ("promote", 2, 100, True),
        ]
        assert "quarantined" in moves[4].gate_report and moves[4].actor == "alice"
        back = service.rollback(session, farm.api_signer, "cameras", "carol")
        assert (back.stable_revision, back.previous_revisions, back.sequence) == (1, [], 6)
        with pytest.raises(Conflict, match="no earlier revision"):
            service.rollback(session, farm.api_signer, "cameras", "carol")
        signed = service.document_of(session, "cameras")
    doc = Document.from_dict(signed["document"])
    assert (doc.sequence, doc.stable.number, doc.candidate, doc.move) == (6, 1, None, "rollback")
    trust = TrustedKeys({}).with_key(farm.signer.public_key)
    channels.verify_document(trust, doc, signed["signing_key_id"], signed["signature"])


def test_gc_keeps_the_blobs_a_kept_revision_names(embedded_farm):
    farm = embedded_farm
    one = model_entry(farm, "one")
    add_model(farm, "loose")
    kept = add_blob(farm, 1, key(1), created_at=_days_ago(90))
    loose = add_blob(farm, 2, key(2), created_at=_days_ago(90))
    with farm.session() as session:
        service.create(session, farm.api_signer, "cameras", "alice")
        service.set_revision(session, farm.api_signer, "cameras", [one], "alice")
        report = gc.collect(session, farm.store, 30)
    assert [b.cache_key for b in report.blobs] == [loose.cache_key]
    assert kept.cache_key not in {b.cache_key for b in report.blobs}


def test_the_api_signs_channel_documents_with_its_certified_key(embedded_farm):
    """A farm whose API holds its own key (FARM_STATUS_KEY) and not the blob signing key: each
    move is signed by that key, and edges that trust only the blob signing key accept the
    document through the certificate it is served with."""
    farm = embedded_farm
    blob_key = farm.signer
    api_key = Signer(Ed25519PrivateKey.from_private_bytes(bytes(range(32, 64))))
    api = ApiSigner(api_key, certify_api_key(blob_key, api_key.public_key))
    trust = TrustedKeys({}).with_key(blob_key.public_key)
    one = model_entry(farm, "one")
    with farm.session() as session:
        service.create(session, api, "cameras", "alice")
        service.set_revision(session, api, "cameras", [one], "alice")
        assert service.get(session, "cameras").signing_key_id == api.key_id
        served = service.document_of(session, "cameras", api)
    doc = Document.from_dict(served["document"])
    assert served["signing_key_id"] == api.key_id and served["certificate"] == api.certificate
    channels.verify_document(
        trust, doc, served["signing_key_id"], served["signature"], served["certificate"]
    )
    with pytest.raises(SignatureError, match="no certificate vouches"):
        channels.verify_document(trust, doc, served["signing_key_id"], served["signature"])


def test_a_document_an_earlier_key_signed_is_served_signed_by_the_current_one(embedded_farm):
    """After the API's key is replaced (or an operator's CLI moved the channel with the blob
    key), the same document is served signed by the API's current key: no edge sees a move."""
    farm = embedded_farm
    old = ApiSigner(farm.signer)
    api_key = Signer(Ed25519PrivateKey.from_private_bytes(bytes(range(32, 64))))
    api = ApiSigner(api_key, certify_api_key(farm.signer, api_key.public_key))
    with farm.session() as session:
        service.create(session, old, "cameras", "alice")
        stored = service.document_of(session, "cameras")
        served = service.document_of(session, "cameras", api)
    assert stored["signing_key_id"] == farm.signer.key_id and stored["certificate"] is None
    assert served["document"] == stored["document"] and served["signing_key_id"] == api.key_id
    doc = Document.from_dict(served["document"])
    trust = TrustedKeys({}).with_key(farm.signer.public_key)
    channels.verify_document(
        trust, doc, served["signing_key_id"], served["signature"], served["certificate"]
    )
    check_successor(Document.from_dict(stored["document"]), doc)  # the very same document


def test_a_key_certified_for_statuses_only_moves_no_channel(embedded_farm):
    farm = embedded_farm
    api_key = Signer(Ed25519PrivateKey.from_private_bytes(bytes(range(32, 64))))
    certificate = certify_api_key(farm.signer, api_key.public_key, [apikey.BLOB_STATUS])
    with farm.session() as session, pytest.raises(KeyFileError, match="create-status"):
        service.create(session, ApiSigner(api_key, certificate), "cameras", "alice")
    with farm.session() as session, pytest.raises(NotFound):
        service.get(session, "cameras")


def test_edge_reports_are_one_row_per_edge_and_status_groups_them(embedded_farm):
    farm = embedded_farm
    one = model_entry(farm, "one")
    with farm.session() as session:
        service.create(session, farm.api_signer, "cameras", "alice")
        service.set_revision(session, farm.api_signer, "cameras", [one], "alice")
        base = {"openvino": "2026.4.1", "targets": ["CPU"], "sequence": 2, "wanted_revision": 1}
        service.record_edge(session, "cameras", "a", {**base, "revision": None, "ok": True})
        service.record_edge(session, "cameras", "a", {**base, "revision": 1, "ok": True})
        service.record_edge(
            session, "cameras", "b", {**base, "revision": None, "ok": False, "error": "disk"}
        )
        found = status.status(session, "cameras", 1, TOOLCHAIN)
    assert found["edges"] == 2
    assert [(g["revision"], g["edges"], g["failing"]) for g in found["by_revision"]] == [
        (None, 1, 1),
        (1, 1, 0),
    ]
    assert found["failures"][0]["agent_id"] == "b" and found["failures"][0]["error"] == "disk"
    assert [m["state"] for m in found["missing"]] == ["missing"]


def _days_ago(days: int):
    from datetime import timedelta

    from farm.core.clock import now

    return now() - timedelta(days=days)


def test_a_release_token_moves_channels_and_only_an_admin_forces(embedded_farm):
    from farm.server.tokens import ROLES, Caller, authenticate, create_token

    with embedded_farm.session() as session:
        secret = create_token(session, "release-bot", "release")  # the schema admits the role
        caller = authenticate(session, secret)
    assert caller == Caller("release-bot", "release")
    assert caller.may("submit") and caller.may("release") and not caller.may("admin")
    assert ROLES.index("submit") < ROLES.index("release") < ROLES.index("admin")


def test_prebuild_submits_what_edges_pulled_lately_for_the_next_toolchain(served_farm, stub):
    from farm.core.spec import Toolchain
    from farm.server.blobs.service import record_pull
    from farm.server.channels import prebuild
    from farm.server.jobs.service import register_model
    from tests.unit.conftest import make_ref, store_model

    farm = served_farm
    pulled, idle = make_ref(farm.settings.home / "a", "a"), make_ref(farm.settings.home / "b", "b")
    ids = []
    for ref in (pulled, idle):
        store_model(farm, ref)
        with farm.session() as session:
            ids.append(register_model(session, ref.info).id)
            session.commit()
    add_blob(farm, ids[0], key("a"))
    add_blob(farm, ids[1], key("b"), created_at=_days_ago(60))
    with farm.session() as session:
        record_pull(session, key("a"), "edge-1", True)
        entries = prebuild.pulled_entries(session, 7)
        assert [e.model for e in entries] == [pulled.identity]
        upgrade = Toolchain("2026.9.0", runtime_requirements="ov=2026.9.0;isa=avx2")
        results = prebuild.prebuild(
            session, farm.store, farm.settings, stub, entries, upgrade, "ci"
        )
        assert [(r["outcome"], r["cache_key"]) for r in results] == [
            ("queued", entries[0].cache_key(upgrade))
        ]
        again = prebuild.prebuild(session, farm.store, farm.settings, stub, entries, upgrade, "ci")
        assert [r["outcome"] for r in again] == ["existing"]  # one job per key
        with pytest.raises(SpecError, match="nothing to prebuild"):
            prebuild.prebuild(session, farm.store, farm.settings, stub, [], upgrade, "ci")
    assert len(stub.sent) == 1
