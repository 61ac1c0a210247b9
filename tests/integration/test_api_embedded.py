"""The API on the embedded farm (SQLite, local store, no broker): jobs run in the API process,
and downloads are streamed by the API with HTTP Range support."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import httpx

from tests import models
from tests.integration.served import ApiServer


def farm(env: dict, *args: str) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, "-m", "farm", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result


def test_embedded_api_compiles_and_streams_ranges(tmp_path):
    home = {"FARM_HOME": str(tmp_path / "home")}
    token = farm(home, "token", "create", "--name", "me", "--role", "submit").stdout.strip()
    server = ApiServer(home, tmp_path / "api.log").start()
    try:
        client_env = {
            "FARM_API_URL": server.url,
            "FARM_TOKEN": token,
            "FARM_HOME": str(tmp_path / "elsewhere"),
            "FARM_TRUSTED_KEYS": str(tmp_path / "home" / "keys" / "signing.pem.pub"),
        }
        xml = models.save_ir(models.conv_net(), tmp_path / "m" / "m.xml")
        answer = json.loads(
            farm(client_env, "submit", str(xml), "-d", "CPU", "--wait", "--json").stdout
        )
        assert answer["job"]["state"] == "succeeded" and answer["job"]["queue"] == "embedded"
        key = answer["cache_key"]

        headers = {"Authorization": f"Bearer {token}"}
        full = httpx.get(f"{server.url}/v1/blobs/{key}/download", headers=headers)
        assert full.status_code == 200
        meta = httpx.get(f"{server.url}/v1/blobs/{key}", headers=headers).json()
        assert hashlib.sha256(full.content).hexdigest() == meta["sha256"]
        part = httpx.get(
            f"{server.url}/v1/blobs/{key}/download", headers={**headers, "Range": "bytes=100-199"}
        )
        assert part.status_code == 206 and part.content == full.content[100:200]

        out = tmp_path / "pulled.blob"
        farm(client_env, "pull", key, "-o", str(out), "--format", "cache-entry")
        assert out.read_bytes() == full.content

        # A unique key prefix works through the API as it does on the database (issue 17.12).
        shown = json.loads(farm(client_env, "status", key[:10], "--json").stdout)
        assert shown["cache_key"] == key and shown["blob"]["sha256"] == meta["sha256"]

        # The embedded farm compiles on its own host only: an NPU spec it cannot compile is
        # `unavailable`, with the reason, and records no job; the CPU spec is answered (17.7).
        matrix = subprocess.run(
            [sys.executable, "-m", "farm", "submit", str(xml), "-d", "4000,CPU", "--json"],
            capture_output=True,
            text=True,
            env={**os.environ, **client_env},
            timeout=300,
            check=False,
        )
        assert matrix.returncode == 4, matrix.stderr
        npu, cpu = json.loads(matrix.stdout)["results"]
        assert (npu["target"], npu["outcome"], npu["job"]) == ("NPU.4000", "unavailable", None)
        assert "cannot compile for NPU.4000" in npu["reason"]
        assert (cpu["outcome"], cpu["cache_key"]) == ("hit", key)
        jobs = json.loads(farm(client_env, "jobs", "--json").stdout)
        assert [job["target"] for job in jobs] == ["CPU"]

        # farm doctor checks the API it is pointed at, not a farm of its own (17.3).
        checks = {c["check"]: c for c in json.loads(farm(client_env, "doctor", "--json").stdout)}
        assert checks["api"]["ok"] and checks["api"]["detail"].startswith(f"{server.url} ready")
        assert checks["token"] == {
            "check": "token",
            "ok": True,
            "detail": "valid, role submit or admin",
        }
        assert checks["trusted keys"]["ok"] and "database" not in checks
        assert not (tmp_path / "elsewhere").exists()  # no embedded farm created client-side
    finally:
        server.stop()
