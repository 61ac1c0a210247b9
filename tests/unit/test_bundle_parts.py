"""The parts of a pipeline bundle (farm/server/bundles/parts.py): the plan, without GenAI."""

from __future__ import annotations

import shutil
from pathlib import Path

from farm.core.pipelines import (
    GenAIOptions,
    compile_memory_bytes,
    detect,
    identity,
    toolchain_part,
)
from farm.core.spec import Target
from farm.server.bundles.parts import WHOLE, plan_parts
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
