"""Resident memory of one `farm api` process while many model uploads stream at once.

    .venv/bin/python scripts/upload_memory.py [--uploads 48] [--mib 32] [--bound 4] [--code DIR]

Starts the API (SQLite, the SeaweedFS of `scripts/services` as store), uploads `--uploads`
distinct files of `--mib` MiB at once through `FarmClient.upload` (which waits out 503
`too_many_uploads`), and prints the API's RSS before, at its peak, and 5 s after the last
upload (JSON). `--bound` sets FARM_MAX_CONCURRENT_UPLOADS; `--code DIR` runs the API from
another copy of the code (`git archive HEAD farm migrations | tar -x -C DIR`, with migrations/
copied to DIR/farm/migrations), for a before/after comparison.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from farm.client import FarmClient

S3 = {
    "FARM_S3_ENDPOINT_URL": os.environ.get("FARM_TEST_S3_ENDPOINT_URL", "http://127.0.0.1:8333"),
    "FARM_S3_ACCESS_KEY_ID": "farm",
    "FARM_S3_SECRET_ACCESS_KEY": "farm-secret",
}


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--uploads", type=int, default=48)
    parser.add_argument("--mib", type=int, default=32)
    parser.add_argument("--bound", type=int, default=4)
    parser.add_argument("--code", type=Path, default=None)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="farm-upload-memory-"))
    base = os.urandom(args.mib * 2**20)
    files = []
    for i in range(args.uploads):
        data = i.to_bytes(8, "big") + base[8:]
        path = work / f"f{i}"
        path.write_bytes(data)
        files.append((hashlib.sha256(data).hexdigest(), path))
    del base

    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("FARM_")},
        **S3,
        "FARM_HOME": str(work / "home"),
        "FARM_DATABASE_URL": f"sqlite:///{work / 'farm.db'}",
        "FARM_STORAGE_URL": f"s3://farm/upload-memory-{uuid.uuid4().hex[:8]}",
        "FARM_MAX_CONCURRENT_UPLOADS": str(args.bound),
        "FARM_API_REQUESTS_PER_MINUTE": "100000",
    }
    if args.code:
        env["PYTHONPATH"] = str(args.code)
    token = subprocess.run(
        [sys.executable, "-m", "farm", "token", "create", "--name", "u", "--role", "submit"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    port = 18000 + os.getpid() % 1000
    log = open(work / "api.log", "wb")  # noqa: SIM115 (closed at the end)
    api = subprocess.Popen(
        [sys.executable, "-m", "farm", "api", "--port", str(port)], env=env, stdout=log, stderr=log
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(200):
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        time.sleep(1)
        before = rss_mib(api.pid)
        samples = [before]
        done = threading.Event()

        def sample() -> None:
            while not done.wait(0.05):
                samples.append(rss_mib(api.pid))

        sampler = threading.Thread(target=sample)
        sampler.start()
        started = time.monotonic()

        def upload(item) -> dict:
            with FarmClient(url, token) as client:
                return client.upload(*item)

        with ThreadPoolExecutor(args.uploads) as pool:
            answers = list(pool.map(upload, files))
        seconds = time.monotonic() - started
        time.sleep(5)
        done.set()
        sampler.join()
        after = rss_mib(api.pid)
        turned_away = (work / "api.log").read_text(errors="replace").count('" 503')
        print(
            json.dumps(
                {
                    "code": str(args.code or "this tree"),
                    "uploads": args.uploads,
                    "mib_each": args.mib,
                    "bound": args.bound,
                    "stored": sum(answer["stored"] for answer in answers),
                    "turned_away_503": turned_away,
                    "seconds": round(seconds, 1),
                    "rss_before_mib": round(before),
                    "rss_peak_mib": round(max(samples)),
                    "rss_after_mib": round(after),
                }
            )
        )
    finally:
        api.terminate()
        api.wait(30)
        log.close()
        for _, path in files:
            path.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
