"""hashing.py: streaming digests and the caching hash v1, pinned by golden vectors."""

from __future__ import annotations

import hashlib
import io

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from farm.core import hashing
from farm.core.identity import ModelRef, file_version
from farm.core.spec import CompileSpec, Toolchain
from tests.strategies import model_identities, respellings, specs

RR = "meta=1.0;ov=2026.4.1;isa=Intel AVX-512 with Intel DL Boost"
TOOLCHAIN = Toolchain("2026.4.1", runtime_requirements=RR)
IR = {"xml": "1" * 64, "bin": "2" * 64}


def key(model=IR, spec=None, toolchain=TOOLCHAIN, **kwargs) -> str:
    spec = spec or CompileSpec.create(kwargs.pop("device", "CPU"), **kwargs)
    return hashing.cache_key(
        model, spec.target.name, spec.canonical(), toolchain.key_part(spec.target)
    )


# A change to any of these three values changes every cache key in every fleet: every blob
# already compiled becomes unreachable. Make it only on purpose, with CACHE_KEY_VERSION bumped.
GOLDEN = [
    (
        (IR, CompileSpec.create("CPU")),
        "d0f6a6315d4b1fb713fc519b580327dd7cff9539e40b98a436107cc6e22af127",
    ),
    (
        (
            IR,
            CompileSpec.create(
                "4000",
                tiles=4,
                performance_hint="latency",
                compiler_params="optimization-level=2 performance-hint-override=latency",
            ),
        ),
        "32d3cb446242088e00412e3023c6d6a24d8b224ddf741cac0473b3a1625829e7",
    ),
    (
        (
            {"onnx": "3" * 64},
            CompileSpec.create("3720", weightless=True, shapes=["input_ids[1,128]"]),
        ),
        "2e340b04f9c10a85ec868718c67d58ddce3549a3983db848853f416268e8767c",
    ),
]


@pytest.mark.parametrize(
    ("inputs", "expected"), GOLDEN, ids=["cpu-ir", "npu4000-ir", "npu3720-onnx"]
)
def test_golden_vectors(inputs, expected):
    model, spec = inputs
    assert key(model, spec) == expected


def test_the_key_is_sha256_of_the_documented_canonical_json():
    """docs/architecture.md §5, written out by hand: sorted keys, no spaces, UTF-8."""
    document = (
        '{"model":{"bin":"' + "2" * 64 + '","xml":"' + "1" * 64 + '"},'
        '"spec":{"batch":null,"compiler_params":null,"config":{},"layout":{},'
        '"performance_hint":null,"shapes":{},"tiles":null,"weightless":false},'
        '"target":"CPU","toolchain":{"openvino":"2026.4.1","runtime_requirements":"' + RR + '"},'
        '"v":1}'
    )
    assert key() == hashlib.sha256(document.encode()).hexdigest()


def test_equivalent_spellings_give_one_key():
    base = key(
        device="4000",
        performance_hint="latency",
        compiler_params="optimization-level=2 performance-hint-override=latency",
    )
    assert base == key(
        device="NPU.4000",
        performance_hint="LATENCY",
        compiler_params="performance-hint-override=latency optimization-level=2",
    )
    assert base == key(
        device="npu4000",
        performance_hint="Latency",
        compiler_params={"optimization-level": "2", "performance-hint-override": "LATENCY"},
    )


def test_everything_that_changes_the_blob_changes_the_key():
    base = key(device="4000", tiles=2, shapes=["x[1,3,8,8]"])
    changed = [
        key(
            model={"xml": "1" * 64, "bin": "3" * 64}, device="4000", tiles=2, shapes=["x[1,3,8,8]"]
        ),
        key(device="4000", tiles=3, shapes=["x[1,3,8,8]"]),
        key(device="4000", tiles=2, shapes=["x[1,3,8,9]"]),
        key(device="5010", tiles=2, shapes=["x[1,3,8,8]"]),
        key(device="4000", tiles=2, shapes=["x[1,3,8,8]"], weightless=True),
        key(device="4000", tiles=2, shapes=["x[1,3,8,8]"], performance_hint="throughput"),
        key(device="4000", tiles=2, shapes=["x[1,3,8,8]"], toolchain=Toolchain("2026.4.2")),
    ]
    assert len({base, *changed}) == len(changed) + 1
    cpu = key()
    assert cpu != key(toolchain=Toolchain("2026.4.1", runtime_requirements=RR.replace("512", "2")))


# --- properties: equal specs give one key, different ones different keys -------------------


@given(st.data())
def test_every_spelling_of_a_spec_gives_its_key(data):
    spec = data.draw(specs())
    device, kwargs = data.draw(respellings(spec))
    again = CompileSpec.create(device, **kwargs)
    assert again == spec
    assert key(spec=again) == key(spec=spec)


@given(specs(), specs())
def test_different_specs_give_different_keys(a, b):
    assume(a != b)
    assert key(spec=a) != key(spec=b)


@given(model_identities, model_identities, specs(), st.sampled_from(["2026.4.1", "2026.4.2"]))
def test_different_models_or_toolchains_give_different_keys(model_a, model_b, spec, openvino):
    toolchain = Toolchain(openvino, runtime_requirements=RR)
    same = model_a == model_b and openvino == TOOLCHAIN.openvino
    assert (key(model_a, spec) == key(model_b, spec, toolchain)) is same


def test_npu_key_ignores_cpu_runtime_requirements():
    """An edge without the farm's CPU ISA still computes the NPU key the worker recorded."""
    assert key(device="4000") == key(device="4000", toolchain=Toolchain("2026.4.1"))


def test_canonical_json_format():
    assert hashing.canonical_json({"b": 1, "a": [1, "é"]}) == '{"a":[1,"é"],"b":1}'.encode()
    with pytest.raises(ValueError):
        hashing.canonical_json({"x": float("nan")})


@pytest.mark.parametrize("size", [0, 1, hashing.CHUNK_BYTES, 3 * hashing.CHUNK_BYTES + 7])
def test_sha256_file_matches_hashlib(tmp_path, size):
    path = tmp_path / "data"
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    path.write_bytes(data)
    seen = []
    assert hashing.sha256_file(path, seen.append) == hashlib.sha256(data).hexdigest()
    assert sum(seen) == size


def _peak_rss_kib() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))


@pytest.mark.slow
def test_hashing_a_1_gib_file_takes_constant_memory(tmp_path):
    path = tmp_path / "big"
    with open(path, "wb") as f:
        f.truncate(1 << 30)  # sparse: reads as zeros, costs no disk
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # reset the peak
    before = _peak_rss_kib()
    digest = hashing.sha256_file(path)
    grown_mib = (_peak_rss_kib() - before) / 1024
    assert digest == "49bc20df15e412a64472421e13fe86ff1c5165e18b2afccf160d4dc19fe68a14"
    assert grown_mib < 16, f"peak RSS grew by {grown_mib:.1f} MiB while hashing 1 GiB"


def test_model_files_by_extension(tmp_path):
    xml, onnx = tmp_path / "m.xml", tmp_path / "m.onnx"
    xml.write_text("<net/>")
    onnx.write_bytes(b"x")
    with pytest.raises(hashing.ModelFileError, match=r"m.bin: its weights file does not exist"):
        hashing.model_files(xml)
    (tmp_path / "m.bin").write_bytes(b"w")
    assert set(hashing.model_files(xml)) == {"xml", "bin"}
    assert hashing.model_files(onnx) == {"onnx": onnx}
    with pytest.raises(hashing.ModelFileError, match="not a model"):
        hashing.model_files(tmp_path / "m.txt")
    with pytest.raises(hashing.ModelFileError, match="does not exist"):
        hashing.model_files(tmp_path / "gone.onnx")


def test_model_identity_and_digest(tmp_path):
    (tmp_path / "m.xml").write_bytes(b"a")
    (tmp_path / "m.bin").write_bytes(b"b")
    identity = hashing.model_identity(hashing.model_files(tmp_path / "m.xml"))
    assert identity == {
        "bin": hashlib.sha256(b"b").hexdigest(),
        "xml": hashlib.sha256(b"a").hexdigest(),
    }
    assert (
        hashing.model_digest(identity)
        == hashlib.sha256(hashing.canonical_json(identity)).hexdigest()
    )


class ChunkRecorder(io.BytesIO):
    """A stream that records how much each read asks for."""

    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self.asked: list[int | None] = []

    def read(self, size: int | None = -1, /) -> bytes:
        self.asked.append(size)
        return super().read(size)


def test_a_stream_is_hashed_in_bounded_chunks_not_read_whole():
    """An HTTP body may be gigabytes: it is never asked for all at once."""
    data = b"x" * (2 * hashing.CHUNK_BYTES + 1)
    stream = ChunkRecorder(data)
    assert hashing.sha256_stream(stream) == hashlib.sha256(data).hexdigest()
    assert stream.asked == [hashing.CHUNK_BYTES] * 4


def test_a_model_ref_records_each_files_version_before_hashing_it(tmp_path):
    """The embedded store copies a file without reading it again while its version is the one
    it was hashed at (`LocalStore.put_version`): without the versions, every upload re-hashes."""
    (tmp_path / "m.xml").write_bytes(b"xml")
    (tmp_path / "m.bin").write_bytes(b"bin")
    ref = ModelRef.from_path(tmp_path / "m.xml")
    assert ref.versions == {role: file_version(path) for role, path in ref.files.items()}
    assert set(ref.versions) == {"xml", "bin"}
