"""The parts of a pipeline bundle (farm/server/bundles/parts.py) without GenAI: the plan, and
which stored parts are believed (the compile a stand-in that writes a file)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from farm.core.hashing import sha256_file
from farm.core.pipelines import (
    GenAIOptions,
    PipelineFolder,
    compile_memory_bytes,
    detect,
    identity,
    toolchain_part,
)
from farm.core.signing import Signer, TrustedKeys
from farm.core.spec import Target
from farm.server.bundles.parts import (
    WHOLE,
    BuiltParts,
    Part,
    PartOutput,
    build_parts,
    part_storage_key,
    plan_parts,
    publish_part,
    stored_part,
)
from farm.server.bundles.storage import file_storage_key
from farm.server.storage.local import LocalStore
from tests.unit.test_pipelines import TOOLS, _llm

CPU = Target.parse("CPU")
NPU = Target.parse("4000")


def test_an_llm_is_one_part_keyed_by_its_files_target_options_and_toolchain(
    tmp_path: Path,
) -> None:
    folder = _llm(tmp_path / "llm")
    options = GenAIOptions.create("llm", CPU)
    tools = toolchain_part(TOOLS, CPU)
    [part] = plan_parts(folder, None, CPU, options, tools)
    assert part.name == WHOLE
    assert part.files == identity(detect(folder))
    assert part.memory_bytes == compile_memory_bytes(detect(folder), CPU)
    # The canonical mapping stored with a job plans the same part as the options object.
    assert plan_parts(folder, "llm", CPU, options.canonical(), tools) == [part]
    # The content, not the path: a copy elsewhere has the same key.
    copy = shutil.copytree(folder, tmp_path / "elsewhere")
    assert plan_parts(copy, None, CPU, options, tools)[0].key == part.key
    npu = GenAIOptions.create("llm", NPU)
    [on_npu] = plan_parts(folder, None, NPU, npu, toolchain_part(TOOLS, NPU))
    assert on_npu.key != part.key
    longer = GenAIOptions.create("llm", NPU, max_prompt_len=2048)
    assert plan_parts(folder, None, NPU, longer, toolchain_part(TOOLS, NPU))[0].key != on_npu.key
    (copy / "openvino_model.bin").write_bytes(b"other weights")
    assert plan_parts(copy, None, CPU, options, tools)[0].key != part.key


def _sd(root: Path, unet: bytes) -> Path:
    """A Stable Diffusion folder of stand-in IR (`tests.unit.test_pipelines._text2image`)."""
    from tests.unit.test_pipelines import _text2image

    _text2image(root)
    (root / "unet" / "openvino_model.bin").write_bytes(unet)
    for sub in ("text_encoder", "unet", "vae_decoder"):
        (root / sub / "config.json").write_text("{}")
    return root


def test_a_stable_diffusion_folder_on_cpu_is_three_parts_and_shares_its_vae(
    tmp_path: Path,
) -> None:
    first, second = _sd(tmp_path / "a", b"unet a"), _sd(tmp_path / "b", b"unet b")
    options = GenAIOptions.create("text2image", CPU)
    tools = toolchain_part(TOOLS, CPU)
    a = {p.name: p for p in plan_parts(first, None, CPU, options, tools)}
    b = {p.name: p for p in plan_parts(second, None, CPU, options, tools)}
    assert list(a) == ["text_encoder", "unet", "vae_decoder"]
    assert sorted(a["unet"].files) == [
        "unet/config.json",
        "unet/openvino_model.bin",
        "unet/openvino_model.xml",
    ]
    assert a["vae_decoder"].key == b["vae_decoder"].key  # the same VAE: compiled once
    assert a["text_encoder"].key == b["text_encoder"].key
    assert a["unet"].key != b["unet"].key
    assert a["unet"].memory_bytes < compile_memory_bytes(detect(first), CPU)
    # The VAE's config is compiled in: another scaling factor is another part.
    (second / "vae_decoder" / "config.json").write_text('{"scaling_factor": 0.5}')
    assert plan_parts(second, None, CPU, options, tools)[2].key != a["vae_decoder"].key


def test_npu_and_unmeasured_layouts_compile_as_one_part(tmp_path: Path) -> None:
    folder = _sd(tmp_path / "sd", b"unet")
    npu = GenAIOptions.create("text2image", NPU)
    [whole] = plan_parts(folder, None, NPU, npu, toolchain_part(TOOLS, NPU))
    assert whole.name == WHOLE and whole.files == identity(detect(folder))
    from tests.unit.test_pipelines import _ir

    _ir(folder / "text_encoder_2" / "openvino_model.xml")  # an SDXL layout
    (folder / "text_encoder_2" / "config.json").write_text("{}")
    cpu = GenAIOptions.create("text2image", CPU)
    assert [p.name for p in plan_parts(folder, None, CPU, cpu, toolchain_part(TOOLS, CPU))] == [
        WHOLE
    ]


def _writing_compile(compiled: list[str]):
    """Stands in for GenAI: one output file per part, its content naming the part key."""

    def run(folder: PipelineFolder, options: GenAIOptions, part: Part, work: Path) -> PartOutput:
        compiled.append(part.name)
        out = work / "compiled.blob"
        out.write_bytes(f"compiled {part.key}".encode())
        return PartOutput({"cache/compiled.blob": out}, {"reference": {"tokens": [7, 8]}})

    return run


def _key() -> Signer:
    return Signer(Ed25519PrivateKey.generate())


def test_a_stored_part_is_reused_only_when_a_trusted_key_signed_its_listing(
    tmp_path: Path,
) -> None:
    """The listing decides which files the signed manifest lists: a listing anyone who can
    write the store could have altered is compiled again, never believed."""
    store_root = tmp_path / "store"
    store = LocalStore(store_root)
    folder = detect(_llm(tmp_path / "llm"))
    options = GenAIOptions.create("llm", CPU)
    tools = toolchain_part(TOOLS, CPU)
    farm_key = _key()
    compiled: list[str] = []

    def build(signer: Signer, trusted: TrustedKeys | None = None) -> BuiltParts:
        compile = _writing_compile(compiled)
        return build_parts(store, folder, options, tools, signer, compile, None, trusted)

    first = build(farm_key)
    assert first.compiled == [WHOLE] and first.reference == {"tokens": [7, 8]}
    reused = build(farm_key)
    assert reused.compiled == [] and reused.files == first.files
    assert reused.reference == first.reference
    [part] = plan_parts(folder.root, None, CPU, options, tools)
    listing = store_root / part_storage_key(part.key, farm_key.key_id)
    signed = listing.read_text()

    # Someone with write access to the store lists a file of their own under the part.
    planted = tmp_path / "planted.blob"
    planted.write_bytes(b"not what the farm compiled")
    planted_sha = sha256_file(planted)
    store.put_file(file_storage_key(planted_sha), planted, expected_sha256=planted_sha)
    forged = json.loads(signed)
    forged["listing"]["files"][0]["sha256"] = planted_sha
    for altered in (
        json.dumps(forged),
        json.dumps(forged["listing"] | {"v": 1}),  # unsigned, as version 1 wrote them
        "{not json",
        "[" * 100_000,
    ):
        listing.write_text(altered)
        again = build(farm_key)
        assert again.compiled == [WHOLE] and again.files == first.files
        assert listing.read_text() == signed  # replaced by the signed listing
    # Another farm's key: its listing stands beside this one's, reused only if trusted.
    other_key = _key()
    assert build(other_key).compiled == [WHOLE]
    assert listing.read_text() == signed
    assert build(other_key).compiled == []
    assert build(_key(), TrustedKeys({other_key.key_id: other_key.public_key})).compiled == []
    assert compiled == [WHOLE] * 6


def test_a_signed_listing_of_another_part_is_not_taken_for_this_one(tmp_path: Path) -> None:
    store_root = tmp_path / "store"
    store = LocalStore(store_root)
    options = GenAIOptions.create("llm", CPU)
    tools = toolchain_part(TOOLS, CPU)
    farm_key = _key()
    compiled: list[str] = []
    folders = [detect(_llm(tmp_path / "a")), detect(_llm(tmp_path / "b"))]
    (folders[1].root / "config.json").write_text('{"max_position_embeddings": 1024}')
    keys = [plan_parts(f.root, None, CPU, options, tools)[0].key for f in folders]
    assert keys[0] != keys[1]
    built = [
        build_parts(store, f, options, tools, farm_key, _writing_compile(compiled)) for f in folders
    ]
    # The first part's listing, genuinely signed, copied over the second's.
    listings = [store_root / part_storage_key(k, farm_key.key_id) for k in keys]
    shutil.copyfile(listings[0], listings[1])
    again = build_parts(store, folders[1], options, tools, farm_key, _writing_compile(compiled))
    assert again.compiled == [WHOLE] and again.files == built[1].files
    assert again.files != built[0].files


def test_a_part_published_twice_keeps_the_first_listing(tmp_path: Path) -> None:
    """Two builds of one part finishing together (two embedded farms on one store): the
    second takes the first's signed listing, files and metrics, and fails nothing."""
    store = LocalStore(tmp_path / "store")
    folder = detect(_llm(tmp_path / "llm"))
    options = GenAIOptions.create("llm", CPU)
    tools = toolchain_part(TOOLS, CPU)
    [part] = plan_parts(folder.root, None, CPU, options, tools)
    farm_key = _key()
    outputs = []
    for n in (1, 2):
        out = tmp_path / f"compiled-{n}.blob"
        out.write_bytes(f"compile {n}".encode())  # a compile need not be byte for byte
        outputs.append(PartOutput({"cache/compiled.blob": out}, {"run": n}))
    first = publish_part(store, part, outputs[0], farm_key)
    assert publish_part(store, part, outputs[1], farm_key) == first
    assert stored_part(store, part.key, TrustedKeys({farm_key.key_id: farm_key.public_key})) == (
        first
    )
    assert first[1] == {"run": 1}


def test_gc_keeps_what_signed_listings_list_and_drops_version_1s_listings(
    served_farm, tmp_path: Path
) -> None:
    from farm.server.bundles.gc import collect_bundles
    from farm.server.bundles.parts import is_signed_name, part_key_of

    store = served_farm.store
    folder = detect(_llm(tmp_path / "llm"))
    options = GenAIOptions.create("llm", CPU)
    tools = toolchain_part(TOOLS, CPU)
    farm_key = _key()
    built = build_parts(store, folder, options, tools, farm_key, _writing_compile([]))
    [part] = plan_parts(folder.root, None, CPU, options, tools)
    signed_name = part_storage_key(part.key, farm_key.key_id)
    assert part_key_of(signed_name) == part.key and is_signed_name(signed_name)
    legacy_name = f"bundle-parts/{part.key}.json"
    assert part_key_of(legacy_name) == part.key and not is_signed_name(legacy_name)
    legacy_file = tmp_path / "legacy.blob"
    legacy_file.write_bytes(b"listed by an unsigned listing only")
    legacy_sha = sha256_file(legacy_file)
    store.put_file(file_storage_key(legacy_sha), legacy_file, expected_sha256=legacy_sha)
    legacy = tmp_path / "legacy.json"
    legacy.write_text(json.dumps({"v": 1, "files": [{"path": "x", "sha256": legacy_sha}]}))
    store.put_file(legacy_name, legacy)
    with served_farm.session() as session:
        report = collect_bundles(session, store, unpulled_days=30, grace_seconds=0)
    assert report.errors == []
    assert [f.sha256 for f in report.files] == [legacy_sha]
    assert not store.exists(legacy_name) and not store.exists(file_storage_key(legacy_sha))
    assert store.exists(signed_name)
    assert all(store.exists(file_storage_key(f.sha256)) for f in built.files)
