"""Queue names and which queues a worker consumes."""

from farm.server.routing import queue_name, worker_queues

GiB = 2**30


def test_one_queue_per_target_and_a_large_one():
    assert queue_name("4000") == "compile.npu.4000"
    assert queue_name("NPU.3720", large=True) == "compile.npu.3720.large"
    assert queue_name("cpu") == "compile.cpu"


def test_only_workers_with_enough_memory_take_large_models():
    assert worker_queues(["CPU"], 8 * GiB, 16 * GiB) == ["compile.cpu"]
    assert worker_queues(["CPU", "NPU.4000"], 64 * GiB, 16 * GiB) == [
        "compile.cpu",
        "compile.npu.4000",
        "compile.cpu.large",
        "compile.npu.4000.large",
    ]
