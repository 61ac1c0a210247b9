"""Measurements that run in a fresh child process: ``python -m bench.probes NAME JSON_ARGS``.

Each prints one JSON line: its own numbers plus, for `measured` sections, the wall time, the
process's peak RSS over that section (VmHWM, reset at its start, so it includes what was
resident then: the interpreter, OpenVINO's libraries) and the peak anonymous and file-backed
RSS seen by a 5 ms sampler (the file-backed part is page cache mapped into the process).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

SAMPLE_SECONDS = 0.005


def _status() -> dict[str, int]:
    values = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, rest = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                values[key] = int(rest.split()[0]) * 1024
    return values


class Measured:
    """Wall time and memory peaks of a `with` block."""

    def __init__(self) -> None:
        self.peak_anon = 0
        self.peak_file = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while True:
            now = _status()
            self.peak_anon = max(self.peak_anon, now["RssAnon"])
            self.peak_file = max(self.peak_file, now["RssFile"])
            if self._stop.wait(SAMPLE_SECONDS):
                return

    def __enter__(self) -> Measured:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")  # VmHWM := current RSS
        self.start_rss = _status()["VmRSS"]
        self._thread.start()
        self.started = time.perf_counter()
        self.cpu_started = time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.started
        self.cpu_seconds = time.process_time() - self.cpu_started
        self._stop.set()
        self._thread.join()
        self.peak_rss = _status()["VmHWM"]

    def as_dict(self) -> dict[str, Any]:
        return {
            "seconds": self.seconds,
            "cpu_seconds": self.cpu_seconds,
            "start_rss_bytes": self.start_rss,
            "peak_rss_bytes": self.peak_rss,
            "peak_anon_bytes": self.peak_anon,
            "peak_file_bytes": self.peak_file,
        }


def _checksum(compiled) -> float:
    """One inference on a fixed input: the same number from every way of loading a model."""
    import numpy as np

    port = compiled.inputs[0]
    shape = [1 if dim.is_dynamic else dim.get_length() for dim in port.get_partial_shape()]
    request = compiled.create_infer_request()
    request.infer({0: np.full(shape, 0.5, dtype=np.float32)})
    return float(np.asarray(request.get_output_tensor(0).data, dtype=np.float64).sum())


# --- models -------------------------------------------------------------------------------------


def build_model(xml: str, megabytes: int, seed: int) -> dict:
    from tests import models

    models.save_ir(models.large_net(megabytes, seed), Path(xml))
    return {"bin_bytes": Path(xml).with_suffix(".bin").stat().st_size}


def build_small_models(folder: str, count: int) -> dict:
    from tests import models

    for seed in range(count):
        models.save_ir(models.conv_net(seed=seed), Path(folder) / f"small-{seed:03d}.xml")
    return {"count": count}


# --- edge: ways of getting a ready model --------------------------------------------------------


def ov_cache_hit(xml: str, cache_dir: str, expect_hit: bool = True) -> dict:
    """OpenVINO's own model cache: `compile_model(path, CPU, CACHE_DIR)` finding its entry
    (`expect_hit=False`: the first call, which compiles and writes it)."""
    import openvino as ov

    core = ov.Core()
    with Measured() as measured:
        compiled = core.compile_model(xml, "CPU", {"CACHE_DIR": cache_dir})
    if expect_hit and not compiled.get_property("LOADED_FROM_CACHE"):
        raise RuntimeError("the OpenVINO cache entry was not used")
    return {**measured.as_dict(), "checksum": _checksum(compiled)}


def ov_import_bytes(blob: str) -> dict:
    """The plain way: read the exported bytes, `core.import_model(bytes)`."""
    import openvino as ov

    from farm.core.blobformat import read_header

    core = ov.Core()
    with Measured() as measured:
        offset = read_header(blob).payload_offset
        with open(blob, "rb") as stream:
            stream.seek(offset)
            data = stream.read()
        compiled = core.import_model(data, "CPU")
        del data
    return {**measured.as_dict(), "checksum": _checksum(compiled)}


def _agent():
    import farm.server.jobs.compiler  # noqa: F401 - OpenVINO loaded before measuring, as in the others
    from farm.edge import agent_from_settings

    return agent_from_settings()


def farm_sdk(xml: str) -> dict:
    """The edge SDK from a model path: key, resolve, fetch (cached or downloaded), import,
    pull report: `farm.edge.compile_model(xml, device="CPU")`."""
    import farm.edge
    import farm.server.jobs.compiler

    with Measured() as measured:
        compiled = farm.edge.compile_model(xml, device="CPU")
    return {
        **measured.as_dict(),
        "import_seconds": compiled.farm_import.import_seconds,
        "checksum": _checksum(compiled),
    }


def farm_load(key: str) -> dict:
    """The agent by cache key: resolve, cached blob, import from a memory map, report."""
    agent = _agent()
    with Measured() as measured:
        imported = agent.load(key)
    agent.source.close()
    return {
        **measured.as_dict(),
        "import_seconds": imported.import_seconds,
        "checksum": _checksum(imported.compiled),
    }


def farm_fetch(key: str) -> dict:
    """The agent's download alone: resolve, compatibility check, presigned GET streamed to a
    file, sha256 verified, renamed into the cache."""
    agent = _agent()
    blob = agent.resolve(key)
    agent.check(blob)  # host toolchain probed before the clock starts (a cached fact)
    with Measured() as measured:
        fetched = agent.fetch(key, blob=blob)
    agent.source.close()
    if not fetched.downloaded:
        raise RuntimeError("the blob was already cached; empty the cache first")
    return {**measured.as_dict(), "bytes": fetched.path.stat().st_size}


def boto3_get(
    endpoint: str, bucket: str, key: str, dest: str, chunk: int, verify: bool = False
) -> dict:
    """A raw boto3 GET of the object, streamed to a file (no API); `verify`: also the sha256
    of the bytes on the way, as the farm's download does."""
    import hashlib

    import boto3

    import farm.server.jobs.compiler  # noqa: F401 - same resident libraries as the farm side

    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id=os.environ["FARM_S3_ACCESS_KEY_ID"],
        aws_secret_access_key=os.environ["FARM_S3_SECRET_ACCESS_KEY"],
    )
    client.head_bucket(Bucket=bucket)  # connection set up before the clock starts
    with Measured() as measured:
        body = client.get_object(Bucket=bucket, Key=key)["Body"]
        size = 0
        digest = hashlib.sha256()
        with open(dest, "wb") as sink:
            while data := body.read(chunk):
                sink.write(data)
                if verify:
                    digest.update(data)
                size += len(data)
    return {**measured.as_dict(), "bytes": size}


def boto3_parts(
    endpoint: str, bucket: str, key: str, dest: str, chunk: int, parts: int, verify: bool = True
) -> dict:
    """Issue 30 item 5's alternative, at its best: `parts` ranged GETs of the object on as many
    threads, each writing its range in place (pwrite) and hashing it (`verify`: a sha256 per
    part, what per-part digests signed by the worker would let an edge check). No API, no
    signature check: the upper bound of what parallel parts could give the edge."""
    import hashlib
    from concurrent.futures import ThreadPoolExecutor

    import boto3
    from botocore.config import Config

    import farm.server.jobs.compiler  # noqa: F401 - same resident libraries as the farm side

    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id=os.environ["FARM_S3_ACCESS_KEY_ID"],
        aws_secret_access_key=os.environ["FARM_S3_SECRET_ACCESS_KEY"],
        config=Config(max_pool_connections=parts),
    )
    size = client.head_object(Bucket=bucket, Key=key)["ContentLength"]
    step = -(-size // parts)

    def part(n: int) -> int:
        start, end = n * step, min(size, (n + 1) * step) - 1
        body = client.get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{end}")["Body"]
        digest, at = hashlib.sha256(), start
        while data := body.read(chunk):
            os.pwrite(fd, data, at)
            if verify:
                digest.update(data)
            at += len(data)
        return at - start

    with Measured() as measured:
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            with ThreadPoolExecutor(parts) as pool:
                got = sum(pool.map(part, range(parts)))
        finally:
            os.close(fd)
    return {**measured.as_dict(), "bytes": got}


# --- workers: the direct way to compile -------------------------------------------------------


def direct_compile(
    xml: str, out_dir: str, blob_id: str, hint: str | None = None, fresh_copy: bool = False
) -> dict:
    """The fastest direct way to compile and write a blob in one process: read the model,
    `compile_model` with CACHE_DIR + CACHE_BLOB_ID (OpenVINO writes the blob itself), the
    same call the worker's compile child makes (`farm.compiler.compile_to_file`).

    `fresh_copy`: first copy the model files to a new folder (not timed), as a worker's fetch
    writes them just before its compile: their pages are then still dirty, waiting to be
    written back to disk while OpenVINO writes the blob."""
    import shutil

    from farm.core.spec import CompileSpec
    from farm.server.jobs.compiler import compile_to_file

    files = {"xml": Path(xml), "bin": Path(xml).with_suffix(".bin")}
    if fresh_copy:
        copies = Path(out_dir).parent / "fresh-copy"
        copies.mkdir(parents=True, exist_ok=True)
        for role, path in list(files.items()):
            files[role] = Path(shutil.copyfile(path, copies / f"model.{role}"))
    spec = CompileSpec.create("CPU", performance_hint=hint)
    with Measured() as measured:
        result = compile_to_file(files, spec, Path(out_dir), blob_id)
    answer = {
        **measured.as_dict(),
        "compile_seconds": result.compile_seconds,
        "export_seconds": result.export_seconds,
        "blob_bytes": result.size_bytes,
    }
    if fresh_copy:
        shutil.rmtree(copies)
    return answer


def direct_compile_many(xmls: list[str], out_dir: str) -> dict:
    """`compile_to_file` for each model in turn, in this one (warm) process."""
    import shutil

    from farm.core.spec import CompileSpec
    from farm.server.jobs.compiler import compile_to_file

    spec = CompileSpec.create("CPU")
    with Measured() as measured:
        for number, xml in enumerate(xmls):
            files = {"xml": Path(xml), "bin": Path(xml).with_suffix(".bin")}
            compile_to_file(files, spec, Path(out_dir), f"{number:064x}")
    shutil.rmtree(out_dir, ignore_errors=True)
    return measured.as_dict()


# --- verify: what checking a blob's numbers costs over importing it -----------------------------


def import_and_infer_once(blob: str, reference: str) -> dict:
    """The least an edge does to use a blob: map it, `import_model`, one inference on the
    reference inputs (the baseline of `farm verify`)."""
    import openvino as ov

    from farm.core.reference import Reference
    from farm.edge.importer import import_blob

    inputs = list(Reference.load(Path(reference)).inputs.values())
    ov.Core().get_versions("CPU")  # the plugin loaded before measuring, as in farm_verify
    with Measured() as measured:
        imported = import_blob(blob, "CPU")
        imported.compiled.create_infer_request().infer(inputs)
    return measured.as_dict()


def farm_verify(key: str, runs: int) -> dict:
    """`farm verify KEY --runs N` in process, on the embedded farm: resolve, the cached blob
    re-checked, the reference fetched and checked, import, warm-up, N runs, compare, report."""
    from farm.cli.common import backend
    from farm.edge import agent_from_settings
    from farm.edge.verify import verify_blob

    agent = agent_from_settings(source=backend())
    import openvino as ov

    ov.Core().get_versions("CPU")
    with Measured() as measured:
        result = verify_blob(agent, key, runs=runs)
    if not result.passed:
        raise RuntimeError(f"verification failed: {result.error or result.figures}")
    return {**measured.as_dict(), "latency_p50_ms": result.report()["latency_p50_ms"]}


def build_pt2(path: str, megabytes: int) -> dict:
    """A torch.export program of a Linear chain with about `megabytes` of FP32 weights."""
    import torch

    torch.manual_seed(0)
    width = 1024
    layers = max(1, megabytes * 2**20 // (width * width * 4))
    module = torch.nn.Sequential(
        *(
            torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU())
            for _ in range(layers)
        )
    ).eval()
    torch.export.save(torch.export.export(module, (torch.rand(1, width),)), path)
    return {"path": path, "layers": layers}


def direct_convert_compile(pt2: str, out_dir: str) -> dict:
    """The direct way, in one process: torch.export.load, ov.convert_model, save the IR (as a
    farm stage does), then compile it for CPU writing the blob (`compile_to_file`). Timed from
    before torch and OpenVINO are imported; peak RSS of the conversion alone too."""
    started = time.perf_counter()
    import openvino as ov
    import torch

    from farm.core.spec import CompileSpec
    from farm.server.jobs.compiler import compile_to_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with Measured() as conversion:
        model = ov.convert_model(torch.export.load(pt2))
        ov.save_model(model, out / "model.xml", compress_to_fp16=False)
        del model
    files = {"xml": out / "model.xml", "bin": out / "model.bin"}
    compile_to_file(files, CompileSpec.create("CPU"), out, "direct")
    return {
        "seconds": time.perf_counter() - started,
        "conversion_seconds": conversion.seconds,
        "conversion_peak_rss_bytes": conversion.peak_rss,
    }


# --- pipelines: an edge opening a GenAI pipeline ---------------------------------------------


def _genai_loaded() -> None:
    """openvino_genai imported and its CPU plugin loaded before measuring, in both ways."""
    import openvino as ov
    import openvino_genai  # noqa: F401

    ov.Core().get_versions("CPU")


def pipeline_open_bundle(ready: str) -> dict:
    """`farm.edge.bundle.open_bundle` on a pulled ready folder; nothing may be compiled."""
    from farm.core.bundles import CACHE_FOLDER
    from farm.edge.bundle import cache_state, open_bundle

    _genai_loaded()
    before = cache_state(Path(ready) / CACHE_FOLDER)
    with Measured() as measured:
        pipeline = open_bundle(Path(ready))
    if cache_state(Path(ready) / CACHE_FOLDER) != before:
        raise RuntimeError("the pulled bundle's cache entries were rewritten: it compiled")
    del pipeline
    return measured.as_dict()


def pipeline_open_warm(folder: str, properties: dict) -> dict:
    """The baseline: the pipeline built from the folder with a warm CACHE_DIR."""
    from farm.edge.bundle import cache_state
    from farm.genai import open_pipeline

    _genai_loaded()
    before = cache_state(Path(properties["CACHE_DIR"]))
    with Measured() as measured:
        pipeline = open_pipeline("llm", Path(folder), "CPU", properties)
    if cache_state(Path(properties["CACHE_DIR"])) != before:
        raise RuntimeError("the warm CACHE_DIR was not warm: the pipeline compiled")
    del pipeline
    return measured.as_dict()


def pipeline_tokenizers(folder: str) -> dict:
    """What GenAI compiles outside any cache on every start: the tokenizer and detokenizer."""
    import openvino_genai

    _genai_loaded()
    with Measured() as measured:
        tokenizer = openvino_genai.Tokenizer(folder)
    del tokenizer
    return measured.as_dict()


def main() -> int:
    name, args = sys.argv[1], json.loads(sys.argv[2])
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    result = globals()[name](**args)
    with contextlib.suppress(BrokenPipeError):
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
