"""Hypothesis strategies shared by the spec and hashing property tests."""

from __future__ import annotations

from hypothesis import strategies as st

from farm.core.spec import KNOWN_TARGETS, CompileSpec, Target

names = st.sampled_from(["x", "image", "input_ids", "a.b:0"])
dims = st.lists(st.integers(1, 64), min_size=1, max_size=4)


@st.composite
def specs(draw) -> CompileSpec:
    target = Target.parse(draw(st.sampled_from(KNOWN_TARGETS)))
    kwargs: dict = {"weightless": draw(st.booleans())}
    if draw(st.booleans()):
        kwargs["performance_hint"] = draw(st.sampled_from(["latency", "THROUGHPUT"]))
    if target.is_npu:
        kwargs["tiles"] = draw(st.none() | st.integers(1, target.max_tiles))
        kwargs["compiler_params"] = draw(
            st.dictionaries(
                st.sampled_from(["optimization-level", "performance-hint-override"]),
                st.just("1"),
                max_size=1,
            ).map(lambda d: {k: "latency" if "hint" in k else v for k, v in d.items()})
        )
        kwargs["config"] = draw(
            st.dictionaries(
                st.sampled_from(["NPU_TURBO", "NPU_QDQ_OPTIMIZATION"]),
                st.sampled_from(["YES", "NO"]),
                max_size=2,
            )
        )
    else:
        kwargs["config"] = draw(
            st.dictionaries(
                st.sampled_from(["NUM_STREAMS", "PERFORMANCE_HINT_NUM_REQUESTS"]),
                st.integers(1, 8).map(str),
                max_size=2,
            )
        )
    if draw(st.booleans()):
        kwargs["shapes"] = draw(st.dictionaries(names, dims, min_size=1, max_size=3))
    elif draw(st.booleans()):
        kwargs["batch"] = draw(st.integers(1, 64))
        kwargs["layout"] = draw(
            st.dictionaries(names, st.sampled_from(["NCHW", "NC", "N...", "?N"]), max_size=2)
        )
    return CompileSpec.create(target, **kwargs)


def _cases(text: str):
    return st.sampled_from([text, text.lower(), text.upper(), text.title()])


@st.composite
def respellings(draw, spec: CompileSpec) -> tuple[str, dict]:
    """Another way to write `spec`, as a user or a client might: ``(device, create kwargs)``
    with other letter cases, orders, spaces and forms (CLI strings or mappings)."""
    target = spec.target
    if target.is_npu:
        p = target.platform
        device = draw(st.sampled_from([p, f"NPU{p}", f"npu.{p}", f" Npu.{p} "]))
    else:
        device = draw(st.sampled_from(["CPU", "cpu", " Cpu "]))
    kwargs: dict = {"weightless": spec.weightless, "tiles": spec.tiles, "batch": spec.batch}
    if spec.performance_hint:
        kwargs["performance_hint"] = draw(_cases(spec.performance_hint))
    if spec.compiler_params:
        items = draw(st.permutations(list(spec.compiler_params.items())))
        if draw(st.booleans()):
            kwargs["compiler_params"] = " ".join(
                f"{draw(_cases(k))}={draw(_cases(v))}" for k, v in items
            )
        else:
            kwargs["compiler_params"] = {k.upper(): v.upper() for k, v in items}
    if spec.shapes:
        items = draw(st.permutations(list(spec.shapes.items())))
        if draw(st.booleans()):
            kwargs["shapes"] = [f" {name}[{', '.join(map(str, dims))}] " for name, dims in items]
        else:
            kwargs["shapes"] = {name: list(dims) for name, dims in items}
    if spec.layout:
        items = draw(st.permutations(list(spec.layout.items())))
        kwargs["layout"] = [
            (f"{name}:" if name else "")
            + draw(st.sampled_from([text.lower(), f"[{','.join(text)}]"]))
            for name, text in items
        ]
    if spec.config:
        items = draw(st.permutations(list(spec.config.items())))
        kwargs["config"] = [
            f"{key.lower()}={f' 0{value} ' if value.isdigit() else value.lower()}"
            for key, value in items
        ]
    return device, kwargs


sha256s = st.text("0123456789abcdef", min_size=64, max_size=64)
model_identities = st.one_of(
    st.fixed_dictionaries({"xml": sha256s, "bin": sha256s}),
    st.fixed_dictionaries({"onnx": sha256s}),
)
