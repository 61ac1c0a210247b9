"""Served pipeline bundles' rules (docs/architecture.md §17) on a real database and store (the
embedded SQLite and a local folder), the broker a stub: submit, single flight per part key,
claims and leases, the reconciler, memory routing, publishing by the last part."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import select, update

from farm.core.bundles import verify
from farm.core.clock import now
from farm.core.errors import ModelMissing, PipelineError, SpecError
from farm.core.hashing import sha256_file
from farm.core.signing import Signer, TrustedKeys
from farm.core.spec import Target
from farm.server import routing
from farm.server.bundles import builds, parts, served
from farm.server.bundles.reconcile import reconcile_parts
from farm.server.bundles.storage import file_storage_key, manifest_storage_key, published
from farm.server.db.models import BundleBuild, BundlePart
from farm.server.jobs.runner import RunLimits
from farm.server.storage import model_storage_key
from tests.unit.test_pipelines import _llm

CPU = Target.parse("CPU")
TOOLCHAIN = {
    "openvino": "2026.4.1",
    "openvino_genai": "2026.4.1.0",
    "openvino_tokenizers": "2026.4.1.0",
    "runtime_requirements": "avx2",
}
GIB = 1 << 30
LIMITS = RunLimits(max_run_seconds=60)


def _uploaded(farm, root: Path) -> dict[str, str]:
    """The folder's files stored as model files (what the API's uploads do)."""
    files = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        sha = sha256_file(path)
        farm.store.put_file(model_storage_key(sha), path)
        files[path.relative_to(root).as_posix()] = sha
    return files


@pytest.fixture
def folder(served_farm, tmp_path: Path) -> dict[str, str]:
    files = _uploaded(served_farm, _llm(tmp_path / "llm"))
    del files["README.md"]  # not read by GenAI: not part of the key
    return files


def _request(files: dict[str, str], **changes) -> builds.BundleRequest:
    fields = {"pipeline": "llm", "files": files, "target": "CPU", "toolchain": TOOLCHAIN}
    return builds.BundleRequest(**{**fields, **changes})


def _submit(farm, stub, request: builds.BundleRequest) -> dict:
    with farm.session() as session:
        return builds.submit(session, farm.store, farm.settings, stub, request, "alice")


def test_a_second_submit_of_the_same_folder_queues_nothing_new(served_farm, stub, folder) -> None:
    first = _submit(served_farm, stub, _request(folder))
    second = _submit(served_farm, stub, _request(folder))
    assert first["bundle_key"] == second["bundle_key"]
    [part] = second["parts"]
    assert part["name"] == "pipeline" and part["state"] == "queued"
    assert part["queue"] == routing.bundle_queue(CPU, TOOLCHAIN)
    assert part["queue"].endswith(".with-genai")
    assert len(stub.sent) == 1  # sent once; the second submit found it queued and sent
    with served_farm.session() as session:
        assert len(session.scalars(select(BundlePart)).all()) == 1
        assert session.scalar(select(BundleBuild.submitter)) == "alice"


def test_submit_refuses_naming_the_file_or_option(served_farm, stub, folder) -> None:
    lacking = {p: s for p, s in folder.items() if not p.startswith("openvino_detokenizer")}
    with pytest.raises(PipelineError, match="openvino_detokenizer"):
        _submit(served_farm, stub, _request(lacking))
    with pytest.raises(PipelineError, match="--max-prompt-len applies to NPU targets only"):
        _submit(served_farm, stub, _request(folder, options={"max_prompt_len": 128}))
    with pytest.raises(SpecError, match="unknown pipeline option tiles"):
        _submit(served_farm, stub, _request(folder, options={"tiles": 2}))
    with pytest.raises(SpecError, match="lacks openvino_tokenizers"):
        toolchain = {k: v for k, v in TOOLCHAIN.items() if k != "openvino_tokenizers"}
        _submit(served_farm, stub, _request(folder, toolchain=toolchain))
    with pytest.raises(SpecError, match=r"not read by the pipeline: notes\.txt"):
        _submit(served_farm, stub, _request({**folder, "notes.txt": folder["config.json"]}))
    with pytest.raises(ModelMissing) as missing:
        _submit(served_farm, stub, _request({**folder, "config.json": "0" * 64}))
    assert missing.value.missing == ["0" * 64]
    assert stub.sent == []


def _register(farm, name: str, memory: int, queues: list[str]) -> None:
    with farm.session() as session:
        routing.register_worker(
            session,
            name=name,
            host="h",
            pid=1,
            targets={"CPU": None},
            toolchains={},
            converters={"genai": {}},
            queues=queues,
            openvino_version="2026.4.1",
            memory_bytes=memory,
        )


def test_memory_routes_to_a_large_worker_or_refuses_naming_both_figures(served_farm) -> None:
    settings = served_farm.settings
    plain = routing.bundle_queue(CPU, TOOLCHAIN)
    large = routing.bundle_queue(CPU, TOOLCHAIN, large=True)
    assert routing.worker_bundle_queues({"CPU": TOOLCHAIN}, 8 * GIB, 16 * GIB) == [plain]
    assert routing.worker_bundle_queues({"CPU": TOOLCHAIN}, 32 * GIB, 16 * GIB) == [plain, large]

    def route(needed: int) -> str:
        with served_farm.session() as session:
            return builds.choose_queue(session, settings, CPU, TOOLCHAIN, needed)

    assert route(40 * GIB) == plain  # no live worker yet: it waits, as jobs do
    _register(served_farm, "small", 8 * GIB, [plain])
    assert route(4 * GIB) == plain
    with pytest.raises(PipelineError, match=r"needs about 12\.0 GiB.*\(small\) has 8\.0 GiB"):
        route(12 * GIB)
    _register(served_farm, "big", 32 * GIB, [plain, large])
    assert route(12 * GIB) == large  # not every worker on the plain queue could hold it
    with pytest.raises(PipelineError, match=r"needs about 40\.0 GiB.*\(big\) has 32\.0 GiB"):
        route(40 * GIB)


def _part(farm) -> BundlePart:
    with farm.session() as session:
        return session.scalars(select(BundlePart)).one()


def test_a_part_is_claimed_once_and_a_dead_workers_part_is_taken_back(
    served_farm, stub, folder
) -> None:
    _submit(served_farm, stub, _request(folder))
    part_id = _part(served_farm).id
    with served_farm.session() as session:
        assert served._claim(session, part_id, "w1", 60)
        assert not served._claim(session, part_id, "w2", 60)  # live lease: single flight
        session.execute(update(BundlePart).values(lease_expires_at=now() - timedelta(seconds=1)))
        session.commit()
        report = reconcile_parts(session, served_farm.settings, stub)
    assert report.taken_back == [part_id] and report.resent == [part_id]
    assert stub.sent[-1] == (-part_id, routing.bundle_queue(CPU, TOOLCHAIN))
    assert _part(served_farm).state == "queued"

    # Each claim counts (the first one above too): at FARM_MAX_ATTEMPTS (3) the part fails,
    # and its bundle with it.
    with served_farm.session() as session:
        for _ in range(served_farm.settings.max_attempts - 1):
            assert served._claim(session, part_id, "w1", 60)
            session.execute(
                update(BundlePart).values(lease_expires_at=now() - timedelta(seconds=1))
            )
            session.commit()
        report = reconcile_parts(session, served_farm.settings, stub)
        assert report.failed == [part_id]
        build = session.scalars(select(BundleBuild)).one()
        assert build.state == "failed"
        assert (
            build.error.startswith("part pipeline ") and "gave up after 3 attempts" in build.error
        )
    # A submit of a failed bundle queues it again.
    again = _submit(served_farm, stub, _request(folder))
    assert again["state"] == "queued" and again["parts"][0]["attempts"] == 0


def _compiled(farm, signer: Signer, tmp_path: Path) -> tuple[int, str]:
    """What a worker's `run_part` leaves of the one part: its file stored, its listing signed,
    its row done with its outputs. The part's id and the compiled file's sha256."""
    entry = tmp_path / "entry.blob"
    entry.write_bytes(b"compiled")
    row = _part(farm)
    unit = parts.Part(row.name, row.part_key, {}, row.memory_bytes)
    output = parts.PartOutput({"cache/1.blob": entry}, {"reference": {"tokens": [1, 2]}})
    [compiled], metrics = parts.publish_part(farm.store, unit, output, signer)
    with farm.session() as session:
        session.execute(
            update(BundlePart).values(
                state="done",
                output_files={compiled.path: {"sha256": compiled.sha256, "size": compiled.size}},
                metrics=metrics,
            )
        )
        session.commit()
    return row.id, compiled.sha256


def test_the_last_part_publishes_the_signed_manifest_once(
    served_farm, stub, folder, tmp_path: Path
) -> None:
    built = _submit(served_farm, stub, _request(folder))
    key = built["bundle_key"]
    signer = Signer(Ed25519PrivateKey.generate())
    part_id = _part(served_farm).id
    with served_farm.session() as session:
        assert (
            served.publish_ready(session, served_farm.store, signer, part_id, limits=LIMITS) == []
        )  # queued
    _compiled(served_farm, signer, tmp_path)
    with served_farm.session() as session:
        assert served.publish_ready(session, served_farm.store, signer, part_id, limits=LIMITS) == [
            key
        ]
        assert (
            served.publish_ready(session, served_farm.store, signer, part_id, limits=LIMITS) == []
        )
    signed = published(served_farm.store, key)
    assert signed is not None
    manifest = verify(signed, TrustedKeys({}).with_key(signer.public_key), key)
    assert {f.path for f in manifest.files} == {*folder, "cache/1.blob"}
    assert manifest.reference == {"tokens": [1, 2]}
    # The folder's files were copied beside the compiled one: an edge fetches all from there.
    assert all(served_farm.store.exists(file_storage_key(s)) for s in folder.values())
    with served_farm.session() as session:
        assert session.scalars(select(BundleBuild)).one().state == "done"
    # A submit now answers the bundle as it is and sends nothing.
    sent = len(stub.sent)
    assert _submit(served_farm, stub, _request(folder))["state"] == "done"
    assert len(stub.sent) == sent
    with served_farm.store.open_read(manifest_storage_key(key)) as stream:
        assert json.load(stream) == signed


def _plant(farm, tmp_path: Path) -> str:
    """A file of someone else's in the store's bundle files; its sha256."""
    planted = tmp_path / "planted.blob"
    planted.write_bytes(b"not what the worker compiled")
    sha = sha256_file(planted)
    farm.store.put_file(file_storage_key(sha), planted, expected_sha256=sha)
    return sha


def test_the_manifest_lists_the_signed_listing_not_the_outputs_in_the_database(
    served_farm, stub, folder, tmp_path: Path
) -> None:
    """The API can write the database and holds no signing key: a part's outputs rewritten
    there never reach a manifest the worker signs."""
    key = _submit(served_farm, stub, _request(folder))["bundle_key"]
    signer = Signer(Ed25519PrivateKey.generate())
    part_id, compiled = _compiled(served_farm, signer, tmp_path)
    planted = _plant(served_farm, tmp_path)
    with served_farm.session() as session:
        session.execute(
            update(BundlePart).values(
                output_files={"cache/evil.blob": {"sha256": planted, "size": 28}},
                metrics={"reference": {"tokens": [6, 6, 6]}},
            )
        )
        session.commit()
        assert served.publish_ready(session, served_farm.store, signer, part_id, limits=LIMITS) == [
            key
        ]
    signed = published(served_farm.store, key)
    assert signed is not None
    manifest = verify(signed, TrustedKeys({}).with_key(signer.public_key), key)
    shipped = {f.path: f.sha256 for f in manifest.files}
    assert shipped["cache/1.blob"] == compiled and "cache/evil.blob" not in shipped
    assert planted not in shipped.values() and manifest.reference == {"tokens": [1, 2]}


def test_a_done_part_without_a_trusted_listing_is_compiled_again_and_its_bundle_waits(
    served_farm, stub, folder, tmp_path: Path
) -> None:
    """A part marked done with no listing a trusted key signed (an older farm's unsigned one,
    a row written by hand, an untrusted key's): its bundle is not published from it; the
    part is queued again and the reconciler sends it."""
    _submit(served_farm, stub, _request(folder))
    planted = _plant(served_farm, tmp_path)
    part_id = _part(served_farm).id
    with served_farm.session() as session:
        session.execute(
            update(BundlePart).values(
                state="done", output_files={"cache/1.blob": {"sha256": planted, "size": 28}}
            )
        )
        session.commit()
    signer, untrusted = Signer(Ed25519PrivateKey.generate()), Signer(Ed25519PrivateKey.generate())
    _compiled(served_farm, untrusted, tmp_path)  # a listing, but of a key this farm does not trust
    with served_farm.session() as session:
        assert (
            served.publish_ready(session, served_farm.store, signer, part_id, limits=LIMITS) == []
        )
        build = session.scalars(select(BundleBuild)).one()
        assert build.state == "queued" and build.error is None  # as it was: waiting
        assert published(served_farm.store, build.bundle_key) is None
    part = _part(served_farm)
    assert part.state == "queued" and part.sent_at is None and part.output_files is None
    with served_farm.session() as session:
        report = reconcile_parts(session, served_farm.settings, stub)
    assert report.resent == [part_id] and stub.sent[-1][0] == -part_id  # parts go negative
    # Trusted (FARM_TRUSTED_KEYS), the same listing publishes the bundle.
    _compiled(served_farm, untrusted, tmp_path)
    trusted = TrustedKeys({untrusted.key_id: untrusted.public_key})
    with served_farm.session() as session:
        assert served.publish_ready(
            session, served_farm.store, signer, part_id, trusted, limits=LIMITS
        ) == [build.bundle_key]


def test_the_export_task_is_the_keys_never_the_rows_column(
    served_farm, stub, folder, tmp_path: Path
) -> None:
    """A convert_task written into an OpenVINO folder's row would drop the folder's own files
    from its manifest: the worker reads the task from the key's options."""
    key = _submit(served_farm, stub, _request(folder))["bundle_key"]
    signer = Signer(Ed25519PrivateKey.generate())
    part_id, _ = _compiled(served_farm, signer, tmp_path)
    with served_farm.session() as session:
        session.execute(update(BundleBuild).values(convert_task="text-generation-with-past"))
        session.commit()
        assert served.publish_ready(session, served_farm.store, signer, part_id, limits=LIMITS) == [
            key
        ]
    signed = published(served_farm.store, key)
    assert signed is not None
    manifest = verify(signed, TrustedKeys({}).with_key(signer.public_key), key)
    assert {f.path for f in manifest.files} == {*folder, "cache/1.blob"}


def test_a_worker_compiles_a_part_only_with_the_toolchain_of_its_key(
    served_farm, stub, folder, monkeypatch
) -> None:
    """Queues are written by the API and the database: a part sent to a worker of other
    releases is refused there, not signed as compiled by the releases its key names."""
    import farm.genai

    _submit(served_farm, stub, _request(folder))  # keyed for TOOLCHAIN
    part_id = _part(served_farm).id
    monkeypatch.setattr(served, "stage_folder", _never)
    monkeypatch.setattr(served, "pipeline_in_child", _never)
    signer = Signer(Ed25519PrivateKey.generate())
    limits = RunLimits(max_run_seconds=60)

    def run() -> str | None:
        return served.run_part(
            served_farm.sessions,
            served_farm.store,
            part_id,
            worker="w1",
            limits=limits,
            signer=signer,
        )

    # The key's own releases: the worker goes on to stage the folder (here: refused).
    monkeypatch.setattr(farm.genai, "toolchain", lambda target: dict(TOOLCHAIN))
    with pytest.raises(AssertionError, match="nothing may be staged"):
        run()
    assert _part(served_farm).state == "queued"  # given back
    other = {**TOOLCHAIN, "runtime_requirements": "avx512"}
    monkeypatch.setattr(farm.genai, "toolchain", lambda target: other)
    assert run() == "failed"
    assert "the part was sent to the wrong queue" in (_part(served_farm).error or "")


def test_parts_that_workers_of_two_keys_keep_queueing_again_fail_naming_the_keys(
    served_farm, stub, folder, tmp_path: Path
) -> None:
    """Two workers that do not trust each other's keys would queue each other's parts again
    for ever: past three claims the part fails, with what to set."""
    _submit(served_farm, stub, _request(folder))
    part_id, _ = _compiled(served_farm, Signer(Ed25519PrivateKey.generate()), tmp_path)
    with served_farm.session() as session:
        session.execute(update(BundlePart).values(attempts=served.UNTRUSTED_CLAIMS))
        session.commit()
        signer = Signer(Ed25519PrivateKey.generate())
        assert (
            served.publish_ready(session, served_farm.store, signer, part_id, limits=LIMITS) == []
        )
        build = session.scalars(select(BundleBuild)).one()
        assert build.state == "failed" and served.MIXED_KEYS in (build.error or "")
    part = _part(served_farm)
    assert part.state == "failed" and served.MIXED_KEYS in (part.error or "")


def test_queueing_a_part_again_leaves_a_part_another_worker_claimed_meanwhile(
    served_farm, stub, folder
) -> None:
    _submit(served_farm, stub, _request(folder))
    with served_farm.session() as session:
        session.execute(update(BundlePart).values(state="done", output_files={}))
        session.commit()
    with served_farm.session() as stale:
        part = stale.scalars(select(BundlePart)).one()  # read done
        with served_farm.session() as other:  # then queued again and claimed by w2
            other.execute(update(BundlePart).values(state="running", worker="w2"))
            other.commit()
        served._compile_again(stale, [part])
    part = _part(served_farm)
    assert (part.state, part.worker) == ("running", "w2")


def test_rows_that_are_not_those_of_their_keys_are_never_signed(
    served_farm, stub, folder, tmp_path: Path, monkeypatch
) -> None:
    """Whoever can write the database could point a bundle key at another folder's files, or
    a part at another part's key: the worker computes the keys from the rows' fields first."""
    key = _submit(served_farm, stub, _request(folder))["bundle_key"]
    signer = Signer(Ed25519PrivateKey.generate())
    part_id, _ = _compiled(served_farm, signer, tmp_path)
    planted = _plant(served_farm, tmp_path)
    with served_farm.session() as session:
        build = session.scalars(select(BundleBuild)).one()
        build.files = {**build.files, "openvino_model.bin": planted}
        session.commit()
        assert (
            served.publish_ready(session, served_farm.store, signer, part_id, limits=LIMITS) == []
        )
        session.refresh(build)
        assert build.state == "failed" and "not those of its key" in (build.error or "")
    assert published(served_farm.store, key) is None

    # A part queued under another part's key is refused before anything compiles.
    monkeypatch.setattr(served, "stage_folder", _never)
    monkeypatch.setattr(served, "pipeline_in_child", _never)
    with served_farm.session() as session:
        session.execute(update(BundleBuild).values(files=folder, state="queued", error=None))
        session.execute(update(BundlePart).values(state="queued", part_key="0" * 64))
        session.commit()
    limits = RunLimits(max_run_seconds=60)
    state = served.run_part(
        served_farm.sessions, served_farm.store, part_id, worker="w1", limits=limits, signer=signer
    )
    assert state == "failed"
    assert "not the pipeline part of bundle" in (_part(served_farm).error or "")


def _never(*args, **kwargs):
    raise AssertionError("nothing may be staged or compiled")


def test_a_farm_without_a_broker_refuses_before_recording_anything(served_farm, folder) -> None:
    from farm.core.errors import NotInstalled
    from farm.server.jobs.dispatch import InlineDispatcher

    with pytest.raises(NotInstalled, match="this farm has no broker"):
        _submit(served_farm, InlineDispatcher(lambda job_id: None), _request(folder))
    with served_farm.session() as session:
        assert session.scalar(select(BundleBuild)) is None


def test_a_bundle_that_cannot_be_published_fails_with_the_reason_not_left_running(
    served_farm, stub, folder
) -> None:
    _submit(served_farm, stub, _request(folder))
    part_id = _part(served_farm).id
    with served_farm.session() as session:
        session.execute(update(BundlePart).values(state="done", output_files={}, metrics={}))
        session.commit()
        # No signing key on this worker: nothing can be published, and no retry changes that.
        assert served.publish_ready(session, served_farm.store, None, part_id, limits=LIMITS) == []
        build = session.scalars(select(BundleBuild)).one()
        assert build.state == "failed" and build.finished_at is not None
        assert build.error == (
            "publishing the bundle failed: this worker has no signing key (FARM_SIGNING_KEY) "
            "to sign bundle manifests with"
        )


def test_a_worker_without_a_signing_key_fails_the_part_before_compiling(
    served_farm, stub, folder, monkeypatch
) -> None:
    """Its listing could not be signed, nor the bundle's manifest: hours of compiling would
    end in a bundle no edge takes."""
    _submit(served_farm, stub, _request(folder))
    part_id = _part(served_farm).id
    monkeypatch.setattr(served, "stage_folder", _never)
    monkeypatch.setattr(served, "pipeline_in_child", _never)
    limits = RunLimits(max_run_seconds=60)
    state = served.run_part(
        served_farm.sessions, served_farm.store, part_id, worker="w1", limits=limits, signer=None
    )
    assert state == "failed"
    part = _part(served_farm)
    assert part.state == "failed" and part.error == served.NO_SIGNING_KEY
    assert part.seconds is None and part.output_files is None  # nothing compiled
    with served_farm.session() as session:
        build = session.scalars(select(BundleBuild)).one()
        assert build.state == "failed" and served.NO_SIGNING_KEY in (build.error or "")


def test_a_bundle_whose_rows_lost_a_part_is_never_signed(served_farm, stub, tmp_path: Path) -> None:
    from farm.server.db.models import BundleBuildPart
    from tests.unit.test_pipelines import _text2image

    root = _text2image(tmp_path / "sd")
    for sub in ("text_encoder", "unet", "vae_decoder"):  # each compiles apart on CPU
        (root / sub / "config.json").write_text("{}")
    files = _uploaded(served_farm, root)
    _submit(served_farm, stub, _request(files, pipeline="text2image"))
    signer = Signer(Ed25519PrivateKey.generate())
    with served_farm.session() as session:
        rows = session.scalars(select(BundlePart)).all()
        assert sorted(r.name for r in rows) == ["text_encoder", "unet", "vae_decoder"]
        dropped, kept = rows[0], rows[1:]
        session.delete(session.get(BundleBuildPart, (dropped.bundle_build_id, dropped.id)))
        session.commit()
        for row in kept:
            entry = tmp_path / f"{row.name}.blob"
            entry.write_bytes(row.name.encode())
            unit = parts.Part(row.name, row.part_key, {}, row.memory_bytes)
            output = parts.PartOutput({f"cache/{row.name}.blob": entry}, {})
            [compiled], _ = parts.publish_part(served_farm.store, unit, output, signer)
            row.state, row.output_files = "done", {compiled.path: {"sha256": compiled.sha256}}
        session.commit()
        assert (
            served.publish_ready(session, served_farm.store, signer, kept[0].id, limits=LIMITS)
            == []
        )
        build = session.scalars(select(BundleBuild)).one()
        assert build.state == "failed" and "its parts are" in (build.error or "")
        assert published(served_farm.store, build.bundle_key) is None


def test_a_part_of_another_bundle_linked_to_this_one_is_never_signed(
    served_farm, stub, folder, tmp_path: Path
) -> None:
    """A second `pipeline` row linked in the database (another folder's, its listing genuinely
    signed) would add its files to this bundle's manifest."""
    from farm.server.db.models import BundleBuildPart

    root = _llm(tmp_path / "other")
    (root / "config.json").write_text('{"max_position_embeddings": 1024}')
    other = _uploaded(served_farm, root)
    del other["README.md"]
    first = _submit(served_farm, stub, _request(folder))["bundle_key"]
    _submit(served_farm, stub, _request(other))
    signer = Signer(Ed25519PrivateKey.generate())
    with served_farm.session() as session:
        builds_by_key = {b.bundle_key: b for b in session.scalars(select(BundleBuild))}
        rows = session.scalars(select(BundlePart)).all()
        for row in rows:
            entry = tmp_path / f"{row.id}.blob"
            entry.write_bytes(row.part_key.encode())
            unit = parts.Part(row.name, row.part_key, {}, row.memory_bytes)
            output = parts.PartOutput({f"cache/{row.id}.blob": entry}, {})
            [compiled], _ = parts.publish_part(served_farm.store, unit, output, signer)
            row.state, row.output_files = "done", {compiled.path: {"sha256": compiled.sha256}}
        mine = next(r for r in rows if r.bundle_build_id == builds_by_key[first].id)
        theirs = next(r for r in rows if r is not mine)
        session.add(BundleBuildPart(bundle_build_id=mine.bundle_build_id, part_id=theirs.id))
        session.commit()
        assert (
            served.publish_ready(session, served_farm.store, signer, mine.id, limits=LIMITS) == []
        )
        build = builds_by_key[first]
        session.refresh(build)
        assert build.state == "failed" and "its parts are ['pipeline', 'pipeline']" in build.error
    assert published(served_farm.store, first) is None


def test_a_worker_reuses_a_stored_part_only_when_a_key_it_trusts_signed_its_listing(
    served_farm, stub, folder, tmp_path: Path, monkeypatch
) -> None:
    """A part compiled before (an embedded farm on the same store, a worker of the old key) is
    taken as it is only when the key that signed its listing is this worker's or trusted."""
    import farm.genai

    key = _submit(served_farm, stub, _request(folder))["bundle_key"]
    row = _part(served_farm)
    old, signer = Signer(Ed25519PrivateKey.generate()), Signer(Ed25519PrivateKey.generate())
    entry = tmp_path / "entry.blob"
    entry.write_bytes(b"compiled")
    unit = parts.Part(row.name, row.part_key, {}, row.memory_bytes)
    parts.publish_part(served_farm.store, unit, parts.PartOutput({"cache/1.blob": entry}, {}), old)
    monkeypatch.setattr(farm.genai, "toolchain", lambda target: dict(TOOLCHAIN))
    monkeypatch.setattr(served, "stage_folder", _never)
    monkeypatch.setattr(served, "pipeline_in_child", _never)

    def run(trusted: TrustedKeys | None) -> str | None:
        return served.run_part(
            served_farm.sessions,
            served_farm.store,
            row.id,
            worker="w1",
            limits=LIMITS,
            signer=signer,
            trusted=trusted,
        )

    with pytest.raises(AssertionError, match="nothing may be staged"):
        run(None)  # the old key untrusted: compiled again
    assert _part(served_farm).state == "queued"
    assert run(TrustedKeys({old.key_id: old.public_key})) == "done"
    signed = published(served_farm.store, key)
    assert signed is not None
    manifest = verify(signed, TrustedKeys({}).with_key(signer.public_key), key)
    assert "cache/1.blob" in {f.path for f in manifest.files}


def test_a_served_bundle_of_sub_model_parts_is_opened_whole_in_the_sandboxed_child(
    served_farm, stub, tmp_path: Path, monkeypatch
) -> None:
    """The last check of a pipeline whose sub-models compiled apart opens the whole submitted
    folder: the worker runs it in a child with its limits, never in its own process."""
    from tests.unit.test_pipelines import _text2image

    root = _text2image(tmp_path / "t2i")
    for sub in ("text_encoder", "unet", "vae_decoder"):  # what makes each a part of its own
        (root / sub / "config.json").write_text(f'{{"model": "{sub}"}}')
    files = _uploaded(served_farm, root)
    key = _submit(served_farm, stub, _request(files, pipeline="text2image"))["bundle_key"]
    signer = Signer(Ed25519PrivateKey.generate())
    with served_farm.session() as session:
        rows = session.scalars(select(BundlePart).order_by(BundlePart.name)).all()
    assert [row.name for row in rows] == ["text_encoder", "unet", "vae_decoder"]
    for row in rows:
        entry = tmp_path / f"{row.name}.blob"
        entry.write_bytes(row.name.encode())
        unit = parts.Part(row.name, row.part_key, {}, row.memory_bytes)
        output = parts.PartOutput({f"cache/{row.name}.blob": entry}, {})
        parts.publish_part(served_farm.store, unit, output, signer)
    with served_farm.session() as session:
        session.execute(update(BundlePart).values(state="done", output_files={}))
        session.commit()
    opened = []

    def in_child(limits: RunLimits):
        def check(folder, options, cache: Path) -> dict:
            opened.append((limits, folder.kind, sorted(p.name for p in cache.iterdir())))
            return {"image_sha256": "0" * 64}

        return check

    monkeypatch.setattr(served, "sandboxed_check", in_child)
    monkeypatch.setattr(parts, "check_in_process", _never)
    with served_farm.session() as session:
        assert served.publish_ready(
            session, served_farm.store, signer, rows[0].id, limits=LIMITS
        ) == [key]
    entries = ["text_encoder.blob", "unet.blob", "vae_decoder.blob"]
    assert opened == [(LIMITS, "text2image", entries)]
    signed = published(served_farm.store, key)
    assert signed is not None
    manifest = verify(signed, TrustedKeys({}).with_key(signer.public_key), key)
    assert manifest.reference == {"image_sha256": "0" * 64}


def test_the_embedded_farm_compiles_and_checks_a_pipeline_in_sandboxed_children(
    embedded_farm, tmp_path: Path, monkeypatch
) -> None:
    from farm.cli.backends.direct import Direct
    from farm.core.pipelines import GenAIOptions, detect
    from farm.server.bundles import service
    from tests.unit.test_pipelines import _text2image

    limits = RunLimits(max_run_seconds=7, compile_user="nobody")
    monkeypatch.setattr(type(embedded_farm), "run_limits", property(lambda self: limits))
    given = {}

    def build_bundle(store, signer, folder, options, compile, trusted, check):
        given.update(compile=compile, check=check)
        return {}

    monkeypatch.setattr(service, "sandboxed", lambda got: ("compile in a child", got))
    monkeypatch.setattr(service, "sandboxed_check", lambda got: ("check in a child", got))
    monkeypatch.setattr(service, "build_bundle", build_bundle)
    folder = detect(_text2image(tmp_path / "t2i"))
    Direct(embedded_farm).submit_pipeline(folder, GenAIOptions(folder.kind, CPU, {}))
    assert given == {
        "compile": ("compile in a child", limits),
        "check": ("check in a child", limits),
    }


def test_every_pipeline_child_becomes_the_compile_user_through_the_launcher(
    served_farm, stub, folder, tmp_path: Path, monkeypatch
) -> None:
    """A worker that is not root (docker/Dockerfile's) reaches the compile user only through
    FARM_COMPILE_LAUNCHER: every pipeline child is given it, or it runs as the worker, which
    can read the signing key."""
    import farm.genai
    from farm.core.pipelines import GenAIOptions, detect
    from farm.server.jobs import sandbox
    from tests.unit.test_pipelines import _text2image

    class Started(Exception):
        pass

    asked = []

    def identity(user: str | None, launcher: Path | None = None):
        asked.append((user, launcher))
        raise Started

    monkeypatch.setattr(sandbox, "compile_identity", identity)
    launcher = Path("/usr/local/libexec/farm-compile-launcher")
    limits = RunLimits(max_run_seconds=60, compile_user="farm-compile", compile_launcher=launcher)
    t2i = detect(_text2image(tmp_path / "t2i"))
    options = GenAIOptions(t2i.kind, CPU, {})
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "1.blob").write_bytes(b"compiled")
    with pytest.raises(Started):
        parts.sandboxed_check(limits)(t2i, options, cache)
    with pytest.raises(Started):
        parts.sandboxed_part(limits)(t2i, options, parts.Part("unet", "k", {}, 1), tmp_path / "w")
    # The worker's own compile of a part.
    _submit(served_farm, stub, _request(folder))
    monkeypatch.setattr(farm.genai, "toolchain", lambda target: dict(TOOLCHAIN))
    monkeypatch.setattr(served, "pipeline_in_child", sandbox.pipeline_in_child)
    with pytest.raises(Started):
        served.run_part(
            served_farm.sessions,
            served_farm.store,
            _part(served_farm).id,
            worker="w1",
            limits=limits,
            signer=Signer(Ed25519PrivateKey.generate()),
        )
    assert asked == [("farm-compile", launcher)] * 3
