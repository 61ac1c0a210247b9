"""Fleet rollouts for real: a served farm (PostgreSQL, Redis, SeaweedFS, a `farm worker`, `farm
api` holding its own certified key and not the blob signing key), and edge agents that are
separate `farm agent sync --channel` processes, each with its own cache and agent id,
following one channel through its first revision, a staged promotion (the same half of the
fleet moves), a promotion the fleet's failed verification blocks, a rollback, a proxy that
swaps or replays the channel document, an edge killed in the middle of a switch, and a
prebuild for a second OpenVINO release whose edges then find hits."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from farm.core.channels import in_stage
from farm.core.signing import Signer
from farm.toolchain import openvino_release
from tests import models
from tests.integration.test_releases import OLD_RELEASE, old_python  # noqa: F401

CHANNEL = "cameras"


@pytest.fixture
def api_env(served, tmp_path) -> dict[str, str]:
    """The API as docker/compose.yaml runs it: its own key (FARM_STATUS_KEY), certified by the
    workers' signing key with `farm keys create-status`, and no FARM_SIGNING_KEY: it signs
    statuses and channel documents, never a blob. Edges trust only the signing key."""
    key = tmp_path / "api-key" / "api.pem"
    served.farm("keys", "create-status", str(key))
    env = {k: v for k, v in served.env.items() if k != "FARM_SIGNING_KEY"}
    return {**env, "FARM_STATUS_KEY": str(key)}


class DocumentProxy:
    """Forwards every request to the API; `rewrite` changes the channel document's answer,
    `stall` holds the answers of paths containing one of its strings until `release` is set."""

    def __init__(self, upstream: str) -> None:
        self.upstream = httpx.URL(upstream)
        self.rewrite: Callable[[dict], dict] | None = None
        self.stall: set[str] = set()
        self.stalled = threading.Event()
        self.release = threading.Event()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                proxy.answer(self)

            def do_POST(self) -> None:
                proxy.answer(self)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()

    def answer(self, request: BaseHTTPRequestHandler) -> None:
        if any(part in request.path for part in self.stall):
            self.stalled.set()
            self.release.wait(120)
        length = int(request.headers.get("Content-Length") or 0)
        body = request.rfile.read(length) if length else None
        headers = {
            k: v
            for k, v in request.headers.items()
            if k.lower() in ("authorization", "content-type")
        }
        connection = http.client.HTTPConnection(self.upstream.host, self.upstream.port, timeout=60)
        try:
            connection.request(request.command, request.path, body=body, headers=headers)
            response = connection.getresponse()
            kept = {
                k: v for k, v in response.getheaders() if k.lower() in ("content-type", "location")
            }
            status, answer = response.status, response.read()
        finally:
            connection.close()
        if self.rewrite is not None and request.path.endswith("/document") and status == 200:
            answer = json.dumps(self.rewrite(json.loads(answer))).encode()
        request.send_response(status)
        for name, value in kept.items():
            request.send_header(name, value)
        request.send_header("Content-Length", str(len(answer)))
        request.end_headers()
        request.wfile.write(answer)


def farm_run(
    env: dict[str, str],
    *args: str,
    python: str = sys.executable,
    expect: int = 0,
    stdout: bool = False,
):
    """`farm ARGS --json`: its answer (stdout), or with an `expect`ed failure its error
    (stderr), or its answer anyway with `stdout` (a command that answers and fails)."""
    done = subprocess.run(
        [python, "-m", "farm", *args, "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert done.returncode == expect, (
        f"farm {' '.join(args)} → {done.returncode}\n{done.stderr}\n{done.stdout[-2000:]}"
    )
    if expect == 0 or stdout:
        return json.loads(done.stdout)
    return json.loads(done.stderr or "{}")


class Fleet:
    """Edge agents: each its own FARM_AGENT_ID, cache and process."""

    def __init__(self, api, served, root: Path, names: list[str]) -> None:
        self.api, self.served, self.root, self.names = api, served, root, names

    def env(self, name: str, url: str | None = None, python_tag: str = "") -> dict[str, str]:
        base = {k: v for k, v in os.environ.items() if not k.startswith("FARM_")}
        return {
            **base,
            "FARM_API_URL": url or self.api.url,
            "FARM_TOKEN": self.api.tokens["pull"],
            "FARM_AGENT_ID": name,
            "FARM_HOME": str(self.root / f"{name}{python_tag}" / "home"),
            "FARM_CACHE_DIR": str(self.root / f"{name}{python_tag}" / "cache"),
            "FARM_TRUSTED_KEYS": self.served.env["FARM_TRUSTED_KEYS"],
        }

    def current(self, name: str, python_tag: str = "") -> dict | None:
        path = self.root / f"{name}{python_tag}" / "cache" / "channels" / CHANNEL / "current.json"
        return json.loads(path.read_text()) if path.exists() else None

    def sync(self, *extra: str, names: list[str] | None = None) -> dict[str, dict]:
        """`farm agent sync --channel` on every edge at once, each a process of its own."""
        running = {
            name: subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "farm",
                    "agent",
                    "sync",
                    "--channel",
                    CHANNEL,
                    "--json",
                    *extra,
                ],
                env={**self.env(name), "PYTHONUNBUFFERED": "1"},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for name in names or self.names
        }
        results = {}
        for name, process in running.items():
            out, err = process.communicate(timeout=600)
            assert process.returncode in (0, 1), f"{name}: {process.returncode}\n{err}"
            results[name] = json.loads(out)
        return results


def stage_members(percent: int, count: int) -> tuple[list[str], list[str]]:
    """Agent ids, `count` inside the stage of `percent` and `count` outside it."""
    inside, outside = [], []
    for n in range(1000):
        name = f"edge-{n}"
        group = inside if in_stage(CHANNEL, name, percent) else outside
        if len(group) < count:
            group.append(name)
        if len(inside) == len(outside) == count:
            return inside, outside
    raise AssertionError("no split found")


@pytest.fixture
def rollout(served, api, tmp_path):
    served.start_worker("w1")
    submitter = {
        **{k: v for k, v in os.environ.items() if not k.startswith("FARM_")},
        "FARM_API_URL": api.url,
        "FARM_TOKEN": api.tokens["submit"],
        "FARM_HOME": str(tmp_path / "submitter"),
        "FARM_CACHE_DIR": str(tmp_path / "submitter-cache"),
    }
    admin = {**submitter, "FARM_TOKEN": api.tokens["admin"]}
    paths = {}
    for n in (1, 2, 3):
        paths[n] = models.save_ir(models.conv_net(seed=20 + n), tmp_path / f"m{n}" / "m.xml")
        job = farm_run(submitter, "submit", str(paths[n]), "-d", "CPU", "--wait")["job"]
        assert job["state"] == "succeeded", job
    return submitter, admin, paths


def test_a_fleet_follows_a_channel_through_stages_a_blocked_promotion_and_a_rollback(
    served, api, tmp_path, rollout
):
    submitter, admin, paths = rollout
    inside, outside = stage_members(50, 2)
    fleet = Fleet(api, served, tmp_path / "edges", inside + outside)

    farm_run(admin, "channel", "create", CHANNEL)
    farm_run(submitter, "channel", "create", "other", expect=6)  # a submit token may not
    first = farm_run(admin, "channel", "set", CHANNEL, str(paths[1]), "-d", "CPU")
    assert first["stable_revision"] == 1
    # Signed by the API's own key, with the certificate the signing key gave it.
    assert "FARM_SIGNING_KEY" not in api.env
    pull = {"Authorization": f"Bearer {api.tokens['pull']}"}
    served_document = httpx.get(f"{api.url}/v1/channels/{CHANNEL}/document", headers=pull).json()
    api_key = Signer.from_file(Path(api.env["FARM_STATUS_KEY"]))
    blob_key = Signer.from_file(Path(served.env["FARM_SIGNING_KEY"]))
    assert served_document["signing_key_id"] == api_key.key_id
    assert served_document["certificate"]["signer_id"] == blob_key.key_id
    synced = fleet.sync("--verify")
    assert {r["status"] for r in synced.values()} == {"switched"}
    assert {r["revision"] for r in synced.values()} == {1}
    assert sum(r["downloaded"] for r in synced.values()) == 4  # each edge once
    key_one = synced[inside[0]]["keys"][0]["cache_key"]
    again = fleet.sync()
    assert {(r["status"], r["downloaded"]) for r in again.values()} == {("unchanged", 0)}

    # A second revision, staged: the first stage is not gated, and the same half moves.
    farm_run(admin, "channel", "set", CHANNEL, str(paths[2]), "-d", "CPU")
    assert farm_run(admin, "channel", "show", CHANNEL)["stable_revision"] == 1
    from farm.server.tokens import create_token

    with served.sessions() as session:
        releaser = {**admin, "FARM_TOKEN": create_token(session, "release-mgr", "release")}
    staged = farm_run(releaser, "channel", "promote", CHANNEL, "--revision", "2", "--percent", "50")
    assert (staged["candidate_revision"], staged["percent"]) == (2, 50)
    synced = fleet.sync("--verify")
    for name in inside:
        assert (synced[name]["status"], synced[name]["revision"]) == ("switched", 2)
    for name in outside:
        assert (synced[name]["status"], synced[name]["revision"]) == ("unchanged", 1)
    status = farm_run(submitter, "channel", "status", CHANNEL)
    assert {g["revision"]: g["edges"] for g in status["by_revision"]} == {1: 2, 2: 2}
    assert status["gates"] == []  # two passed verifications from the first stage

    # The fleet finds revision 2's blob wrong on one device: the next stage is refused.
    key_two = synced[inside[0]]["keys"][0]["cache_key"]
    blob = httpx.get(
        f"{api.url}/v1/blobs/{key_two}", headers={"Authorization": f"Bearer {api.tokens['pull']}"}
    ).json()
    failed = {
        "agent_id": inside[1],
        "blob_sha256": blob["sha256"],
        "device_name": "CPU on a device that computes it wrong",
        "openvino_version": openvino_release(),
        "passed": False,
        "max_abs_error": 3.0,
        "mean_abs_error": 1.0,
        "min_cosine": 0.2,
        "tolerance": {"atol": 1e-4, "rtol": 1e-3, "min_cosine": 0.9999},
        "outputs": [],
        "runs": 1,
    }
    reported = httpx.post(
        f"{api.url}/v1/blobs/{key_two}/verifications",
        json=failed,
        headers={"Authorization": f"Bearer {api.tokens['pull']}"},
    )
    assert reported.status_code in (200, 201), reported.text
    refused = farm_run(
        admin, "channel", "promote", CHANNEL, "--revision", "2", "--percent", "100", expect=2
    )
    assert refused["code"] == "promotion_blocked" and "failed verification" in refused["message"]
    forced = ("--revision", "2", "--percent", "100", "--force")
    assert (
        farm_run(releaser, "channel", "promote", CHANNEL, *forced, expect=6)["code"] == "forbidden"
    )
    halted = farm_run(submitter, "channel", "status", CHANNEL)
    assert any("quarantined" in problem for problem in halted["gates"])

    # Rollback: everyone on revision 1 at their next sync, from their cache.
    back = farm_run(admin, "channel", "rollback", CHANNEL)
    assert (back["stable_revision"], back["candidate_revision"]) == (1, None)
    synced = fleet.sync()
    assert {r["revision"] for r in synced.values()} == {1}
    assert {r["keys"][0]["cache_key"] for r in synced.values()} == {key_one}
    assert sum(r["downloaded"] for r in synced.values()) == 0
    moves = farm_run(admin, "channel", "show", CHANNEL)["moves"]
    assert [m["action"] for m in moves][:3] == ["rollback", "promote", "set"]
    assert {m["actor"] for m in moves} == {"test-admin", "release-mgr"}

    # A proxy that swaps the document (another revision, a bigger share) is refused: the
    # signature no longer verifies; one that replays an older signed document is refused too.
    proxy = DocumentProxy(api.url)
    try:
        name = inside[0]
        proxied = fleet.env(name, proxy.url)
        before = fleet.current(name)

        def swap(answer: dict) -> dict:
            document = dict(answer["document"])
            document["percent"], document["candidate"] = 100, staged_document["candidate"]
            return {**answer, "document": document}

        staged_document = _signed_at(served, api, CHANNEL, 3)["document"]
        proxy.rewrite = swap
        error = farm_run(proxied, "agent", "sync", "--channel", CHANNEL, expect=8)
        assert error["code"] == "signature_invalid"
        proxy.rewrite = lambda answer: {**answer, **_signed_at(served, api, CHANNEL, 3)}
        error = farm_run(proxied, "agent", "sync", "--channel", CHANNEL, expect=8)
        assert error["code"] == "channel_replay" and "older than" in error["message"]
        assert fleet.current(name) == before

        # An edge killed while switching (its second blob's record held back) stays on its
        # revision, and completes the switch at its next sync.
        farm_run(
            admin, "channel", "set", CHANNEL, str(paths[1]), str(paths[3]), "-d", "CPU"
        )  # revision 3
        farm_run(
            admin, "channel", "promote", CHANNEL, "--revision", "3", "--percent", "100", "--force"
        )
        key_three = _key_of(submitter, paths[3])
        proxy.rewrite = None
        proxy.stall = {f"/v1/blobs/{key_three}"}
        process = subprocess.Popen(
            [sys.executable, "-m", "farm", "agent", "sync", "--channel", CHANNEL],
            env=proxied,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        assert proxy.stalled.wait(120), "the edge never asked for the second blob"
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(30)
        assert fleet.current(name)["revision"] == 1
    finally:
        proxy.stop()
    synced = fleet.sync(names=[name])
    assert (synced[name]["status"], synced[name]["revision"]) == ("switched", 3)
    assert fleet.current(name)["revision"] == 3
    final = farm_run(submitter, "channel", "status", CHANNEL)
    assert {g["revision"]: g["edges"] for g in final["by_revision"]} == {1: 3, 3: 1}
    assert final["failures"] == []


@pytest.mark.slow  # a second OpenVINO release in a virtualenv of its own, as test_releases.py
def test_a_prebuild_for_the_next_openvino_gives_upgraded_edges_hits(
    served,
    api,
    tmp_path,
    rollout,
    old_python,  # noqa: F811
):
    submitter, admin, paths = rollout
    served.start_worker("old", python=old_python)
    farm_run(admin, "channel", "create", CHANNEL)
    farm_run(admin, "channel", "set", CHANNEL, str(paths[1]), str(paths[2]), "-d", "CPU")
    toolchain = tmp_path / "old.json"
    toolchain.write_text(json.dumps(farm_run({**os.environ}, "toolchain", python=old_python)))

    before = farm_run(submitter, "channel", "status", CHANNEL, "--toolchain", str(toolchain))
    assert [e["state"] for e in before["missing"]] == ["missing", "missing"]
    built = farm_run(submitter, "prebuild", "--toolchain", str(toolchain), "--channel", CHANNEL)
    assert [r["outcome"] for r in built] == ["queued", "queued"]
    for result in built:
        assert served.wait_job(result["job"], timeout=300).state == "succeeded"
    after = farm_run(submitter, "channel", "status", CHANNEL, "--toolchain", str(toolchain))
    assert after["missing"] == [] and {e["state"] for e in after["prebuilt"]} == {"built"}
    page = httpx.get(
        f"{api.url}/dashboard", headers={"Authorization": f"Bearer {api.tokens['submit']}"}
    ).text
    assert "<h2>Channels</h2>" in page  # what is built for each release the workers have
    assert f"{OLD_RELEASE}: 2/2" in page and f"{openvino_release()}: 2/2" in page
    again = farm_run(submitter, "prebuild", "--toolchain", str(toolchain), "--channel", CHANNEL)
    assert [r["outcome"] for r in again] == ["hit", "hit"]

    # An edge on the old release follows the channel: every key it computes is a hit.
    fleet = Fleet(api, served, tmp_path / "edges", ["upgraded"])
    env = fleet.env("upgraded")
    synced = farm_run(env, "agent", "sync", "--channel", CHANNEL, "--import", python=old_python)
    assert (synced["status"], synced["revision"], synced["downloaded"]) == ("switched", 1, 2)
    assert {k["cache_key"] for k in synced["keys"]} == {r["cache_key"] for r in built}
    status = farm_run(submitter, "channel", "status", CHANNEL)
    assert [(g["openvino"], g["edges"]) for g in status["by_revision"]] == [(OLD_RELEASE, 1)]


def _key_of(env: dict[str, str], model: Path) -> str:
    return farm_run(env, "submit", str(model), "-d", "CPU")["cache_key"]


def _channel_row(served, name: str):
    from sqlalchemy import select

    from farm.server.db.models import Channel

    with served.sessions() as session:
        return session.scalar(select(Channel).where(Channel.name == name))


def _signed_at(served, api, name: str, sequence: int) -> dict:
    """A genuine older document: rebuilt from the audit and the revisions, signed with the
    API's key exactly as the API signed it at that sequence (what a proxy that recorded it
    would replay)."""
    from sqlalchemy import select

    from farm.core.apikey import ApiSigner
    from farm.core.channels import Document, signed_document
    from farm.server.channels import service
    from farm.server.db.models import ChannelMove

    channel = _channel_row(served, name)
    with served.sessions() as session:
        move = session.scalar(
            select(ChannelMove).where(
                ChannelMove.channel_id == channel.id, ChannelMove.sequence == sequence
            )
        )
        revisions = {r.number: r for r in service.revisions_of(session, channel)}
    document = Document(
        name,
        sequence,
        revisions.get(move.stable_revision),
        revisions.get(move.candidate_revision),
        move.percent if move.candidate_revision else 0,
        move.action,
    )
    signer = ApiSigner.from_file(Path(api.env["FARM_STATUS_KEY"]))
    return {"document": document.as_dict(), **signed_document(signer, document)}


def test_a_switch_that_cannot_complete_leaves_the_edge_on_its_revision_and_says_why(tmp_path):
    """The embedded farm (no services): revision 2 names a spec whose compile failed, so the
    farm has no blob for it; the edge stays on revision 1, exits 1, and the farm shows why."""
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("FARM_")},
        "FARM_HOME": str(tmp_path / "farm"),
        "FARM_CACHE_DIR": str(tmp_path / "cache"),
        "FARM_AGENT_ID": "edge-1",
    }
    xml = models.save_ir(models.conv_net(seed=31), tmp_path / "m" / "m.xml")
    farm_run(env, "submit", str(xml), "-d", "CPU")
    refused = ("--config", "PERFORMANCE_HINT_NUM_REQUESTS=999999999999")  # OpenVINO refuses it
    farm_run(env, "submit", str(xml), "-d", "CPU", *refused, expect=1)
    farm_run(env, "channel", "create", CHANNEL)
    farm_run(env, "channel", "set", CHANNEL, str(xml), "-d", "CPU")
    first = farm_run(env, "agent", "sync", "--channel", CHANNEL)
    assert (first["status"], first["revision"]) == ("switched", 1)
    farm_run(env, "channel", "set", CHANNEL, str(xml), "-d", "CPU", *refused)
    farm_run(env, "channel", "promote", CHANNEL, "--revision", "2", "--percent", "100", "--force")

    failed = farm_run(env, "agent", "sync", "--channel", CHANNEL, expect=1, stdout=True)
    assert (failed["status"], failed["revision"], failed["wanted_revision"]) == ("failed", 1, 2)
    assert "no blob" in failed["error"]
    pointer = json.loads((tmp_path / "cache" / "channels" / CHANNEL / "current.json").read_text())
    assert pointer["revision"] == 1 and pointer["keys"] == first["keys"]
    status = farm_run(env, "channel", "status", CHANNEL)
    (failure,) = status["failures"]
    assert (failure["agent_id"], failure["revision"], failure["wanted_revision"]) == (
        "edge-1",
        1,
        2,
    )
    assert "no blob" in failure["error"]
    moves = farm_run(env, "channel", "show", CHANNEL)["moves"]
    assert moves[0]["forced"] and "0 passed verification" in moves[0]["gate_report"]
