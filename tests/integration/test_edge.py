"""The edge agent through a real `farm api` (uvicorn) in front of an embedded farm: pull by the
key this machine computes, compatibility before download, resume after a cut connection,
verification, weightless imports, the OpenVINO cache-dir drop-in, fleet sync, the SDK."""

from __future__ import annotations

import json
import os
import resource
import sqlite3
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import openvino as ov
import pytest

from farm.core.config import Settings
from farm.server.context import FarmContext
from farm.server.tokens import create_token
from tests import models
from tests.integration.faults import TcpProxy, free_port
from tests.integration.served import ApiServer, wait_until


def run_farm(env: dict, *args: str, preexec_fn=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "farm", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=300,
        check=False,
        preexec_fn=preexec_fn,
    )


def ok_json(env: dict, *args: str):
    result = run_farm(env, *args, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@dataclass
class EdgeFarm:
    home: Path
    api: ApiServer
    tokens: dict[str, str]
    xml: Path
    key: str
    tmp: Path

    @property
    def farm_env(self) -> dict[str, str]:
        return {"FARM_HOME": str(self.home)}

    def edge_env(self, role: str = "pull", url: str | None = None) -> dict[str, str]:
        """An edge: the API and a token, a cache of its own, no farm database."""
        return {
            "FARM_API_URL": url or self.api.url,
            "FARM_TOKEN": self.tokens[role],
            "FARM_CACHE_DIR": str(self.tmp / "edge-cache"),
            "FARM_HOME": str(self.tmp / "edge-home"),
            "FARM_AGENT_ID": "edge-042",
            "FARM_TRUSTED_KEYS": str(self.home / "keys" / "signing.pem.pub"),
        }

    @property
    def blob_cache(self) -> Path:
        return self.tmp / "edge-cache" / "blobs"

    def sql(self, query: str, *params) -> list[tuple]:
        with sqlite3.connect(self.home / "farm.db") as connection:
            return connection.execute(query, params).fetchall()


@pytest.fixture
def edge_farm(tmp_path) -> EdgeFarm:
    home = tmp_path / "farm"
    env = {"FARM_HOME": str(home)}
    xml = models.save_ir(models.conv_net(), tmp_path / "model" / "conv.xml")
    key = ok_json(env, "submit", str(xml), "--device", "CPU")["cache_key"]
    farm = FarmContext.open(Settings(home=home))
    with farm.session() as session:
        tokens = {role: create_token(session, f"t-{role}", role) for role in ("pull", "submit")}
    farm.sessions.kw["bind"].dispose()
    api = ApiServer(env, tmp_path / "api.log").start()
    yield EdgeFarm(home, api, tokens, xml, key, tmp_path)
    api.stop()


def test_pull_by_model_checks_downloads_imports_reports_and_caches(edge_farm):
    env = edge_farm.edge_env()
    first = ok_json(env, "pull", str(edge_farm.xml), "--device", "CPU", "--import")
    assert first["cache_key"] == edge_farm.key  # the key the edge computed is the worker's
    assert first["downloaded"] is True and first["import_seconds"] > 0
    assert Path(first["path"]) == edge_farm.blob_cache / f"{edge_farm.key}.blob"

    pulls = edge_farm.sql("SELECT agent_id, ok, import_seconds, cache_key FROM pulls")
    assert pulls == [("edge-042", 1, pytest.approx(first["import_seconds"]), edge_farm.key)]

    again = ok_json(env, "pull", edge_farm.key)
    assert again["downloaded"] is False  # served from the local cache
    assert edge_farm.api.requests_logged("/download") == 1

    ran = ok_json(env, "run", first["path"], "--device", "CPU")
    assert list(ran["outputs"].values()) == [[1, 8]] and ran["import_seconds"] > 0


def test_a_cut_connection_is_resumed_with_a_range_request(tmp_path):
    home = tmp_path / "farm"
    env = {"FARM_HOME": str(home)}
    xml = models.save_ir(models.large_net(16), tmp_path / "big" / "big.xml")
    submitted = ok_json(env, "submit", str(xml), "--device", "CPU")
    key = submitted["cache_key"]
    assert submitted["job"]["state"] == "succeeded"
    token = ok_json(env, "token", "create", "--name", "edge", "--role", "pull")["token"]
    api = ApiServer(env, tmp_path / "api.log").start()
    proxy = TcpProxy(api.port, cut_once_after=4 * 2**20)
    proxy.start()
    try:
        edge = {
            "FARM_TRUSTED_KEYS": str(home / "keys" / "signing.pem.pub"),
            "FARM_API_URL": f"http://127.0.0.1:{proxy.port}",
            "FARM_TOKEN": token,
            "FARM_CACHE_DIR": str(tmp_path / "edge-cache"),
        }
        out = str(tmp_path / "out.blob")
        pulled = ok_json(edge, "pull", key, "-o", out, "--format", "cache-entry")
    finally:
        proxy.cut()
        api.stop()
    assert proxy.cuts == 1
    assert b"range: bytes=" in bytes(proxy.sent).lower()  # the second try resumed
    assert api.requests_logged("/download") == 2
    assert pulled["downloaded"] is True
    stored = home / "store" / "blobs" / f"{key}.blob"
    assert (tmp_path / "out.blob").read_bytes() == stored.read_bytes()
    assert not any((tmp_path / "edge-cache" / "blobs" / "partial").iterdir())


def test_a_corrupt_blob_is_refused_and_nothing_is_kept(edge_farm):
    stored = edge_farm.home / "store" / "blobs" / f"{edge_farm.key}.blob"
    stored.chmod(0o644)
    data = bytearray(stored.read_bytes())
    data[-100] ^= 0xFF
    stored.write_bytes(bytes(data))

    result = run_farm(edge_farm.edge_env(), "pull", edge_farm.key, "--import")
    assert result.returncode == 5
    assert "sha256" in result.stderr and "not imported" in result.stderr
    assert list(edge_farm.blob_cache.glob("*.blob")) == []
    assert list((edge_farm.blob_cache / "partial").iterdir()) == []
    assert edge_farm.sql("SELECT count(*) FROM pulls") == [(0,)]


def test_an_incompatible_toolchain_is_refused_before_any_download(edge_farm):
    toolchain = json.loads(
        edge_farm.sql("SELECT toolchain FROM blobs WHERE cache_key = ?", edge_farm.key)[0][0]
    )
    toolchain["runtime_requirements"] = "meta=1.0;ov=2026.4.1;isa=Intel AMX"
    with sqlite3.connect(edge_farm.home / "farm.db") as connection:
        connection.execute("UPDATE blobs SET toolchain = ?", (json.dumps(toolchain),))
    tampered = run_farm(edge_farm.edge_env(), "pull", edge_farm.key)
    assert tampered.returncode == 8 and "invalid signature" in tampered.stderr  # it is signed
    resign_manifest(edge_farm)  # a blob the farm's key really signed for another CPU

    result = run_farm(edge_farm.edge_env(), "pull", edge_farm.key)
    assert result.returncode == 4
    assert "isa=Intel AMX" in result.stderr and "nothing was downloaded" in result.stderr
    assert edge_farm.api.requests_logged("/download") == 0
    assert list(edge_farm.blob_cache.glob("*.blob")) == []


def resign_manifest(edge_farm: EdgeFarm) -> None:
    """Sign the blob rows' manifests as they are now with the farm's key (as a worker would)."""
    from sqlalchemy import select

    from farm.server.blobs.signatures import sign_row
    from farm.server.db.models import Blob

    farm = FarmContext.open(Settings(home=edge_farm.home))
    with farm.session() as session:
        for blob in session.scalars(select(Blob)):
            sign_row(blob, farm.signer)
        session.commit()
    farm.sessions.kw["bind"].dispose()


def test_weightless_round_trip_checks_the_bin_before_import(edge_farm, tmp_path):
    xml = models.save_ir(models.conv_net(seed=3), tmp_path / "wl" / "wl.xml")
    submitted = ok_json(edge_farm.farm_env, "submit", str(xml), "-d", "CPU", "--weightless")
    key = submitted["cache_key"]
    env = edge_farm.edge_env()

    pulled = ok_json(env, "pull", str(xml), "-d", "CPU", "--weightless", "--import")
    assert pulled["cache_key"] == key and pulled["weightless"] is True
    assert pulled["size_bytes"] < xml.with_suffix(".bin").stat().st_size
    assert pulled["import_seconds"] > 0

    impostor = tmp_path / "impostor.bin"
    weights = xml.with_suffix(".bin").read_bytes()
    impostor.write_bytes(weights[::-1])  # same size, other bytes: OpenVINO would take it
    refused = run_farm(env, "pull", key, "--import", "--weights", str(impostor))
    assert refused.returncode == 5
    assert "not the weights file" in refused.stderr
    rows = edge_farm.sql("SELECT ok, error FROM pulls WHERE cache_key = ? ORDER BY id", key)
    assert rows[0] == (1, None) and rows[-1][0] == 0 and "not the weights" in rows[-1][1]


def test_the_cache_dir_drop_in_is_loaded_from_openvino_cache(edge_farm, tmp_path):
    env = edge_farm.edge_env()
    for_object, for_path = tmp_path / "app-cache-a", tmp_path / "app-cache-b"
    ok_json(env, "pull", edge_farm.key, "--into-cache-dir", str(for_object))
    ok_json(
        env,
        "pull",
        edge_farm.key,
        "--into-cache-dir",
        str(for_path),
        "--for-model",
        str(edge_farm.xml),
    )
    core = ov.Core()
    config = {"CACHE_BLOB_ID": edge_farm.key}
    # An unmodified app compiling an ov.Model, and one compiling the model by its path.
    compiled = core.compile_model(
        core.read_model(edge_farm.xml), "CPU", {**config, "CACHE_DIR": str(for_object)}
    )
    assert compiled.get_property("LOADED_FROM_CACHE") is True
    compiled = core.compile_model(str(edge_farm.xml), "CPU", {**config, "CACHE_DIR": str(for_path)})
    assert compiled.get_property("LOADED_FROM_CACHE") is True


def test_bad_input_is_a_clear_error_and_leaves_the_cache_consistent(edge_farm):
    env = edge_farm.edge_env()
    unknown = run_farm(env, "pull", "0" * 64)
    assert unknown.returncode == 3 and "no blob" in unknown.stderr

    forged = run_farm({**env, "FARM_TOKEN": "farm_forged"}, "pull", edge_farm.key)
    assert forged.returncode == 6

    down = run_farm(edge_farm.edge_env(url=f"http://127.0.0.1:{free_port()}"), "pull", "1" * 64)
    assert down.returncode == 5 and "FARM_API_URL" in down.stderr

    def small_files() -> None:  # the disk fills after 4 kB
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))

    full = run_farm(env, "pull", edge_farm.key, preexec_fn=small_files)
    assert full.returncode == 5 and "no room" in full.stderr
    assert list(edge_farm.blob_cache.glob("*.blob")) == []
    assert list((edge_farm.blob_cache / "partial").iterdir()) == []
    for result in (unknown, forged, down, full):
        assert "Traceback" not in result.stderr and len(result.stderr.splitlines()) == 1


def test_agent_sync_pulls_the_manifest_and_reports_what_the_farm_lacks(edge_farm, tmp_path):
    other = models.save_ir(models.conv_net(seed=9), tmp_path / "manifest" / "other.xml")
    manifest = tmp_path / "manifest" / "fleet.toml"
    manifest.write_text(
        f'[[model]]\npath = "{edge_farm.xml}"\ndevice = "CPU"\n\n'
        '[[model]]\npath = "other.xml"\ndevice = "cpu"\nshapes = ["x[1,3,32,32]"]\n'
    )
    result = run_farm(edge_farm.edge_env(), "agent", "sync", str(manifest), "--json")
    assert result.returncode == 3, result.stderr  # the farm lacks one of them
    ready, missing = json.loads(result.stdout)
    assert ready["status"] == "ready" and ready["cache_key"] == edge_farm.key
    assert missing["status"] == "missing" and missing["model"].endswith("other.xml")
    assert (edge_farm.blob_cache / f"{edge_farm.key}.blob").is_file()

    # Submitted meanwhile: the looping agent picks it up on a later pass.
    ok_json(edge_farm.farm_env, "submit", str(other), "-d", "CPU", "--shape", "x[1,3,32,32]")
    looping = subprocess.Popen(
        [sys.executable, "-m", "farm", "agent", "sync", str(manifest), "--interval", "0.2"],
        env={**os.environ, **edge_farm.edge_env()},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        lines = []
        wait_until(lambda: lines.append(looping.stdout.readline()) or len(lines) >= 4, 60)
    finally:
        looping.kill()
        looping.communicate()
    assert all(line.startswith("ready") for line in lines), lines

    broken = tmp_path / "broken.toml"
    broken.write_text('[[model]]\npath = "x.xml"\ndevice = "9999"\n')
    bad = run_farm(edge_farm.edge_env(), "agent", "sync", str(broken))
    assert bad.returncode == 2 and "unknown device" in bad.stderr


def test_sdk_compile_model_pulls_or_falls_back_and_submits(edge_farm, tmp_path, monkeypatch):
    import numpy as np

    import farm.edge

    for name, value in edge_farm.edge_env("submit").items():
        monkeypatch.setenv(name, value)
    compiled = farm.edge.compile_model(edge_farm.xml, "CPU")
    assert isinstance(compiled, ov.CompiledModel)
    # The pulled blob computes what the model does: the numbers of OpenVINO's own CPU compile.
    image = np.random.default_rng(0).standard_normal((1, 3, 32, 32)).astype(np.float32)
    result = next(iter(compiled.create_infer_request().infer({0: image}).values()))
    reference = ov.Core().compile_model(edge_farm.xml, "CPU").create_infer_request().infer([image])
    assert result.shape == (1, 8)
    np.testing.assert_allclose(result, next(iter(reference.values())), rtol=1e-5, atol=1e-6)
    assert np.abs(result).max() > 0  # a real output, not a zero-filled tensor
    assert edge_farm.sql("SELECT agent_id, ok FROM pulls") == [("edge-042", 1)]

    new = models.save_ir(models.conv_net(seed=5), tmp_path / "new" / "new.xml")
    with pytest.raises(farm.edge.BlobNotAvailable, match="fallback='compile'"):
        farm.edge.compile_model(new, "CPU")
    local = farm.edge.compile_model(new, "CPU", fallback="compile", submit=True)
    assert isinstance(local, ov.CompiledModel)
    # Submitted for the fleet: the farm compiles it, and the next call pulls it.
    wait_until(lambda: edge_farm.sql("SELECT count(*) FROM blobs")[0][0] == 2, 60, "the blob")
    pulled = farm.edge.compile_model(new, "CPU")
    assert pulled.farm_import.import_seconds > 0
