"""Channels at fleet scale (issue 29): one `farm api` on the real PostgreSQL and SeaweedFS.

1. A channel sync with nothing to change: 20 edge processes at once, each the real agent
   (`farm.edge.channel.sync_channel` over `FarmClient`, its own cache), each syncing
   `SYNCS` times after its first switch; the latency of each sync, p50 and p99 over all.
2. A 500-edge simulated fleet: asyncio clients against the real API, each doing what
   `sync_channel` does (fetch the signed document and verify it, pick its revision by its
   bucket, compute each key for this host's toolchain, resolve and download each new blob
   through its presigned URL, report what it runs), through a staged rollout: revision 1 to
   everyone, revision 2 to 10 %, 50 %, 100 %, then a rollback. Per phase: the API's p50 and
   p99 and the blob downloads, against the expected count (each edge downloads each new blob
   once).

    python -m bench.channels [--edges 500] [--processes 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .common import child_env, log, percentile, scaled, scratch, target, write_result
from .stack import served_stack

CHANNEL = "fleet"
SYNCS = scaled(50, 3)
"""No-change syncs per edge process, after its first switch."""


def edge_process(url: str, token: str, trusted: str, cache: str, agent: str, syncs: int) -> None:
    """One edge: switch once, then `syncs` syncs with nothing to change; prints the latencies
    (ms) as JSON on stdout."""
    from farm.client import FarmClient
    from farm.core.filecache import BlobCache
    from farm.core.signing import TrustedKeys
    from farm.edge.agent import EdgeAgent
    from farm.edge.channel import sync_channel

    client = FarmClient(url, token)
    agent_ = EdgeAgent(
        client, BlobCache(Path(cache) / "blobs"), TrustedKeys.from_files([Path(trusted)]), agent
    )
    first = sync_channel(agent_, client, CHANNEL, Path(cache))
    assert first.status == "switched", first
    key = first.keys[0]["cache_key"]
    times: dict[str, list[float]] = {"sync": [], "resolve": []}
    for _ in range(syncs):  # interleaved: the baseline sees the same load
        began = time.perf_counter()
        result = sync_channel(agent_, client, CHANNEL, Path(cache))
        times["sync"].append((time.perf_counter() - began) * 1000)
        assert result.status == "unchanged", result
        began = time.perf_counter()
        client.resolve(key)
        times["resolve"].append((time.perf_counter() - began) * 1000)
    print(json.dumps(times))


def no_change(stack, trusted: str, root: Path, processes: int) -> dict[str, Any]:
    command = [sys.executable, "-m", "bench.channels", "--edge"]
    running = []
    for n in range(processes):
        args = [stack.api.url, stack.tokens["pull"], trusted, str(root / f"edge-{n}"), f"e{n}"]
        running.append(
            subprocess.Popen(
                [*command, *args, str(SYNCS)],
                env=child_env(),
                stdout=subprocess.PIPE,
                text=True,
            )
        )
    latencies: dict[str, list[float]] = {"sync": [], "resolve": []}
    for process in running:
        out, _ = process.communicate(timeout=600)
        assert process.returncode == 0, "an edge process failed"
        for kind, values in json.loads(out).items():
            latencies[kind] += values
    return {
        "edges": processes,
        "syncs": len(latencies["sync"]),
        "p50_ms": percentile(latencies["sync"], 50),
        "p99_ms": percentile(latencies["sync"], 99),
        "baseline_resolve_p50_ms": percentile(latencies["resolve"], 50),
        "baseline_resolve_p99_ms": percentile(latencies["resolve"], 99),
    }


class Fleet:
    """`count` simulated edges: the document, its signature, the revision, the keys, the
    downloads and the reports, as `sync_channel` does them, on asyncio."""

    def __init__(self, url: str, token: str, trust, toolchain, count: int) -> None:
        self.url, self.token, self.trust, self.toolchain = url, token, trust, toolchain
        self.agents = [f"sim-{n:04d}" for n in range(count)]
        self.cached: dict[str, set[str]] = {a: set() for a in self.agents}
        self.running: dict[str, int | None] = dict.fromkeys(self.agents)
        self.sequence: dict[str, int] = dict.fromkeys(self.agents, 0)
        self.accepted: dict[str, Any] = dict.fromkeys(self.agents)

    async def sync_all(self) -> dict[str, Any]:
        import httpx

        latencies: dict[str, list[float]] = {"document": [], "resolve": [], "report": []}
        downloads = 0
        limits = httpx.Limits(max_connections=100)
        headers = {"Authorization": f"Bearer {self.token}"}

        async def timed(kind: str, request) -> Any:
            began = time.perf_counter()
            response = await request
            latencies[kind].append((time.perf_counter() - began) * 1000)
            response.raise_for_status()
            return response

        async def edge(http, agent: str) -> None:
            nonlocal downloads
            from farm.core.channels import Document, check_successor, verify_document

            answer = (await timed("document", http.get(f"/v1/channels/{CHANNEL}/document"))).json()
            document = Document.from_dict(answer["document"])
            verify_document(
                self.trust,
                document,
                answer["signing_key_id"],
                answer["signature"],
                answer.get("certificate"),
            )
            check_successor(self.accepted[agent], document)
            self.accepted[agent] = document
            revision = document.revision_for(agent)
            wanted = revision.number if revision else None
            if wanted == self.running[agent] and document.sequence == self.sequence[agent]:
                return
            for entry in revision.entries if revision else ():
                key = entry.cache_key(self.toolchain)
                if key in self.cached[agent]:
                    continue
                await timed("resolve", http.get(f"/v1/blobs/{key}"))
                located = await http.get(f"/v1/blobs/{key}/download")
                where = located.headers.get("location")
                blob = await plain.get(where) if located.is_redirect and where else located
                blob.raise_for_status()
                downloads += 1
                self.cached[agent].add(key)
            self.running[agent], self.sequence[agent] = wanted, document.sequence
            report = {
                "agent_id": agent,
                "revision": wanted,
                "wanted_revision": wanted,
                "sequence": document.sequence,
                "openvino": self.toolchain.openvino,
                "runtime_requirements": self.toolchain.runtime_requirements,
                "targets": ["CPU"],
                "ok": True,
            }
            await timed("report", http.post(f"/v1/channels/{CHANNEL}/edges", json=report))

        began = time.perf_counter()
        async with (
            httpx.AsyncClient(
                base_url=self.url, headers=headers, limits=limits, timeout=120
            ) as http,
            httpx.AsyncClient(limits=limits, timeout=120) as plain,
        ):
            await asyncio.gather(*(edge(http, agent) for agent in self.agents))
        every = [v for values in latencies.values() for v in values]
        return {
            "seconds": time.perf_counter() - began,
            "requests": len(every),
            "api_p50_ms": percentile(every, 50) if every else None,
            "api_p99_ms": percentile(every, 99) if every else None,
            "p99_ms": {k: percentile(v, 99) for k, v in latencies.items() if v},
            "downloads": downloads,
            "revisions": {
                str(r): list(self.running.values()).count(r) for r in set(self.running.values())
            },
        }


def fleet_rollout(stack, trust, toolchain, count: int) -> list[dict[str, Any]]:
    from farm.client import FarmClient
    from farm.core.channels import in_stage

    admin = FarmClient(stack.api.url, stack.tokens["admin"])
    fleet = Fleet(stack.api.url, stack.tokens["pull"], trust, toolchain, count)
    phases = []

    def phase(name: str, expected: int) -> None:
        result = asyncio.run(fleet.sync_all())
        result.update(phase=name, expected_downloads=expected)
        log(f"{name}: {result}")
        phases.append(result)

    phase("revision 1 to every edge", count)
    admin.promote_channel(CHANNEL, 2, 10, False)
    first = sum(in_stage(CHANNEL, a, 10) for a in fleet.agents)
    phase("revision 2 to 10 %", first)
    admin.promote_channel(CHANNEL, 2, 50, False)
    half = sum(in_stage(CHANNEL, a, 50) for a in fleet.agents)
    phase("revision 2 to 50 %", half - first)
    phase("no change (same document)", 0)
    admin.promote_channel(CHANNEL, 2, 100, False)
    phase("revision 2 to 100 %", count - half)
    admin.rollback_channel(CHANNEL)
    phase("rollback to revision 1 (cached)", 0)
    admin.close()
    return phases


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--edge":
        url, token, trusted, cache, agent, syncs = argv[1:]
        edge_process(url, token, trusted, cache, agent, int(syncs))
        return 0
    parser = argparse.ArgumentParser(prog="python -m bench.channels")
    parser.add_argument("--edges", type=int, default=scaled(500, 20))
    parser.add_argument("--processes", type=int, default=scaled(20, 3))
    options = parser.parse_args(argv)
    from farm.client import FarmClient
    from farm.core.signing import TrustedKeys
    from farm.core.spec import Target
    from farm.toolchain import host_toolchain
    from tests import models

    env = {"FARM_CHANNEL_MIN_VERIFICATIONS": "0"}  # the simulated edges do not verify
    with scratch("channels") as root, served_stack(root, broker=False, env=env) as stack:
        submitter = {**os.environ, **stack.client_env("submit")}
        paths = [
            models.save_ir(models.conv_net(seed=40 + n), root / f"m{n}" / "m.xml") for n in (1, 2)
        ]
        for path in paths:
            done = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "farm",
                    "submit",
                    str(path),
                    "-d",
                    "CPU",
                    "--wait",
                    "--json",
                ],
                env=child_env(submitter),
                capture_output=True,
                text=True,
                check=False,
            )
            assert done.returncode == 0, done.stderr
        trusted = stack.client_env()["FARM_TRUSTED_KEYS"]
        admin = FarmClient(stack.api.url, stack.tokens["admin"])
        from farm.core.channels import Entry
        from farm.core.identity import ModelRef
        from farm.core.spec import CompileSpec

        def entries(path: Path) -> list[dict[str, Any]]:
            ref = ModelRef.from_path(path)
            return [Entry(ref.name, ref.identity, CompileSpec.create("CPU")).as_dict()]

        admin.create_channel(CHANNEL)
        admin.set_channel(CHANNEL, entries(paths[0]))
        admin.set_channel(CHANNEL, entries(paths[1]))
        log(f"no-change syncs: {options.processes} edge processes x {SYNCS}")
        quiet = no_change(stack, trusted, root, options.processes)
        log(f"no-change: {quiet}")
        trust = TrustedKeys.from_files([Path(trusted)])
        phases = fleet_rollout(stack, trust, host_toolchain(Target.parse("CPU")), options.edges)
        admin.close()
    from .common import comparison

    comparisons = [
        comparison(
            f"no-change channel sync p50, {options.processes} edges at once",
            "one resolve of a cache key (GET /v1/blobs/KEY), interleaved",
            quiet["baseline_resolve_p50_ms"],
            quiet["p50_ms"],
            "ms",
        )
    ]
    for p in phases:
        comparisons.append(
            comparison(
                f"{options.edges} edges, {p['phase']}: blob downloads",
                "each edge, each new blob once",
                p["expected_downloads"] or None,
                p["downloads"],
            )
        )
        comparisons.append(
            comparison(
                f"{options.edges} edges, {p['phase']}: API p99 ({p['requests']} requests, "
                f"p50 {p['api_p50_ms'] or 0:.0f} ms)",
                "",
                None,
                p["api_p99_ms"] or 0,
                "ms",
            )
        )
    worst = max(p["api_p99_ms"] for p in phases if p["api_p99_ms"] is not None)
    targets = [
        target(
            f"no-change channel sync p50 per edge, {options.processes} concurrent edges",
            quiet["p50_ms"],
            20,
            unit="ms",
        ),
        target(
            "blob downloads beyond one per edge and new blob (staged rollout)",
            sum(p["downloads"] - p["expected_downloads"] for p in phases),
            0,
            unit="",
        ),
    ]
    write_result(
        "channels",
        {
            "title": f"channels: no-change sync x{options.processes}, a {options.edges}-edge "
            "staged rollout (issue 29)",
            "note": "2 cores shared with other agents' builds and tests; one `farm api` process",
            "no_change": quiet,
            "rollout": phases,
            "rollout_worst_api_p99_ms": worst,
            "comparisons": comparisons,
            "targets": targets,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
