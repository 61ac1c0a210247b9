"""Listing a large catalog through the real API: pages of a bounded size, a cursor in the
`X-Next-Cursor` and `Link` headers, and `farm blobs` / `farm jobs` paging through them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta

import httpx

from farm.core.clock import now
from farm.core.config import Settings
from farm.server.context import FarmContext
from farm.server.db.models import Blob, Job
from tests.integration.served import ApiServer
from tests.unit.conftest import CPU, TOOLCHAIN, add_model, key, sha256

BLOBS = 2503
"""More than two of the CLI's 1000-row pages."""


def _fill(farm: FarmContext) -> None:
    """BLOBS blob rows (and as many succeeded jobs), inserted in bulk."""
    model = add_model(farm)
    at = now()
    blobs, jobs = [], []
    for n in range(BLOBS):
        cache_key = key(n)
        created = at - timedelta(seconds=n // 3)  # three blobs per second: ties to break
        blobs.append(
            dict(
                cache_key=cache_key,
                model_id=model,
                target="CPU",
                spec=CPU.canonical(),
                toolchain=TOOLCHAIN.as_dict(),
                openvino_version=TOOLCHAIN.openvino,
                storage_key=f"blobs/{cache_key}.blob",
                size_bytes=1,
                sha256=sha256(cache_key.encode()),
                payload_offset=0,
                weightless=False,
                created_at=created,
            )
        )
        jobs.append(
            dict(
                cache_key=cache_key,
                model_id=model,
                target="CPU",
                queue="embedded",
                spec=CPU.canonical(),
                toolchain=TOOLCHAIN.as_dict(),
                state="succeeded",
                created_at=created,
            )
        )
    with farm.session() as session:
        session.execute(Blob.__table__.insert(), blobs)
        session.execute(Job.__table__.insert(), jobs)
        session.commit()


def _farm(env: dict[str, str], *args: str) -> list:
    result = subprocess.run(
        [sys.executable, "-m", "farm", *args, "--json"],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_lists_come_in_pages_and_the_cli_pages_through_them(tmp_path):
    home = tmp_path / "home"
    farm = FarmContext.open(Settings(home=home))
    _fill(farm)
    with farm.session() as session:
        newest_first = [
            row.cache_key
            for row in session.query(Blob).order_by(Blob.created_at.desc(), Blob.id.desc())
        ]
    farm.sessions.kw["bind"].dispose()
    env = {"FARM_HOME": str(home)}
    token = subprocess.run(
        [sys.executable, "-m", "farm", "token", "create", "--name", "me", "--role", "submit"],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        check=True,
    ).stdout.strip()
    server = ApiServer(env, tmp_path / "api.log").start()
    try:
        headers = {"Authorization": f"Bearer {token}"}
        first = httpx.get(f"{server.url}/v1/blobs", params={"limit": 7}, headers=headers)
        assert first.status_code == 200
        assert [b["cache_key"] for b in first.json()] == newest_first[:7]
        cursor = first.headers["X-Next-Cursor"]
        link = first.headers["Link"]
        assert link.endswith('>; rel="next"') and f"cursor={cursor}" in link
        second = httpx.get(link[1 : link.index(">")], headers=headers)
        assert [b["cache_key"] for b in second.json()] == newest_first[7:14]

        # No request answers more than its page, whatever the catalog holds.
        default = httpx.get(f"{server.url}/v1/blobs", headers=headers)
        assert len(default.json()) == 100
        too_many = httpx.get(f"{server.url}/v1/blobs", params={"limit": 1001}, headers=headers)
        assert too_many.status_code == 422
        forged = httpx.get(f"{server.url}/v1/blobs", params={"cursor": "x"}, headers=headers)
        assert (forged.status_code, forged.json()["code"]) == (422, "invalid_cursor")

        client = {"FARM_API_URL": server.url, "FARM_TOKEN": token, "FARM_HOME": str(tmp_path)}
        everything = _farm(client, "blobs", "--all")
        assert [b["cache_key"] for b in everything] == newest_first
        assert len(_farm(client, "blobs")) == 100
        jobs = _farm(client, "jobs", "--limit", "2100")
        assert len(jobs) == 2100 and len({j["id"] for j in jobs}) == 2100
        assert [j["id"] for j in jobs] == sorted((j["id"] for j in jobs), reverse=True)
        # The same pages read straight from the database.
        assert [b["cache_key"] for b in _farm(env, "blobs", "--all")] == newest_first
    finally:
        server.stop()
