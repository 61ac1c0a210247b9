"""Queue names (one per target and toolchain class) and which queues a worker consumes."""

from __future__ import annotations

import hashlib

from farm.server.routing import queue_name, toolchain_tag, worker_queues

GiB = 2**30
AVX2 = {"openvino": "2026.4.1", "runtime_requirements": "meta=1.0;ov=2026.4.1;isa=Intel AVX2"}
AVX512 = {"openvino": "2026.4.1", "runtime_requirements": "meta=1.0;ov=2026.4.1;isa=AVX512"}
NPU_2026 = {"openvino": "2026.4.1"}
NPU_2025 = {"openvino": "2025.4.1"}


def _tag(part: dict[str, str]) -> str:
    canonical = ",".join(f'"{k}":"{v}"' for k, v in sorted(part.items()))
    return f"{part['openvino']}.{hashlib.sha256(('{' + canonical + '}').encode()).hexdigest()[:8]}"


def test_the_tag_is_the_release_and_a_digest_of_the_whole_key_part():
    assert toolchain_tag(AVX2) == _tag(AVX2)
    assert toolchain_tag(AVX2) != toolchain_tag(AVX512)  # same release, another ISA
    assert toolchain_tag(NPU_2026).startswith("2026.4.1.") and toolchain_tag(NPU_2025) != (
        toolchain_tag(NPU_2026)
    )


def test_one_queue_per_target_and_toolchain_and_a_large_one():
    assert queue_name("4000", NPU_2026) == f"compile.npu.4000.{_tag(NPU_2026)}"
    assert queue_name("NPU.3720", NPU_2025, large=True) == (
        f"compile.npu.3720.{_tag(NPU_2025)}.large"
    )
    assert queue_name("cpu", AVX2) == f"compile.cpu.{_tag(AVX2)}"
    assert queue_name("CPU", AVX2) != queue_name("CPU", AVX512)


def test_only_workers_with_enough_memory_take_large_models():
    assert worker_queues({"CPU": AVX2}, 8 * GiB, 16 * GiB) == [queue_name("CPU", AVX2)]
    assert worker_queues({"CPU": AVX2, "NPU.4000": NPU_2026}, 64 * GiB, 16 * GiB) == [
        queue_name("CPU", AVX2),
        queue_name("NPU.4000", NPU_2026),
        queue_name("CPU", AVX2, large=True),
        queue_name("NPU.4000", NPU_2026, large=True),
    ]
