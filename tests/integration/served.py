"""A served farm for tests: real PostgreSQL, Redis, SeaweedFS and `farm worker` processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy import func, select

from farm.core.config import Settings
from farm.server.db.models import Blob, Job, Worker
from farm.server.db.session import make_engine, make_session_factory, upgrade_database
from farm.server.storage import open_store


def wait_until(condition: Callable[[], object], timeout: float = 60, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


@dataclass
class ServedFarm:
    env: dict[str, str]
    logs: Path
    workers: dict[str, subprocess.Popen] = field(default_factory=dict)

    def __post_init__(self) -> None:
        settings = self.settings
        upgrade_database(settings.resolved_database_url)
        self.engine = make_engine(settings.resolved_database_url)
        self.sessions = make_session_factory(self.engine)
        self.store = open_store(settings.resolved_storage_url, settings)

    @property
    def settings(self) -> Settings:
        fields = {
            k.removeprefix("FARM_").lower(): v
            for k, v in self.env.items()
            if k.startswith("FARM_") and not k.startswith("FARM_TEST")
        }
        return Settings(**fields)

    # --- processes --------------------------------------------------------------------------

    def farm(self, *args: str, check: bool = True, env: dict | None = None):
        result = subprocess.run(
            [sys.executable, "-m", "farm", *args],
            capture_output=True,
            text=True,
            env={**os.environ, **self.env, **(env or {})},
            timeout=300,
            check=False,
        )
        if check and result.returncode != 0:
            raise AssertionError(f"farm {' '.join(args)} → {result.returncode}\n{result.stderr}")
        return result

    def farm_json(self, *args: str, **kwargs) -> dict:
        return json.loads(self.farm(*args, "--json", **kwargs).stdout)

    def start_worker(
        self,
        name: str = "w1",
        env: dict | None = None,
        wait: bool = True,
        prefix=(),
        python: str = sys.executable,
    ):
        """`prefix`: a command that execs the worker (so its pid is the worker's); `python`:
        the interpreter (another virtualenv, another OpenVINO)."""
        with open(self.logs / f"{name}.log", "ab") as log:
            process = subprocess.Popen(
                [*prefix, python, "-m", "farm", "worker", "-n", name],
                env={**os.environ, **self.env, **(env or {})},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.workers[name] = process
        if wait:
            wait_until(lambda: self._registered(name, process), 90, f"worker {name} to register")
        return process

    def _registered(self, name: str, process: subprocess.Popen) -> bool:
        if process.poll() is not None:
            raise AssertionError(
                f"worker {name} exited {process.returncode}:\n"
                f"{(self.logs / f'{name}.log').read_text()[-3000:]}"
            )
        with self.sessions() as session:
            row = session.get(Worker, name)
            return row is not None and row.stopped_at is None and row.pid == process.pid

    def kill_worker(self, name: str, sig: int = signal.SIGKILL) -> None:
        process = self.workers.pop(name)
        os.killpg(process.pid, sig)  # the worker, its pool and the compile child
        process.wait(timeout=60)

    def stop(self) -> None:
        for name in list(self.workers):
            self.kill_worker(name, signal.SIGTERM)
        self.engine.dispose()

    def worker_log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    # --- database ---------------------------------------------------------------------------

    def job(self, job_id: int) -> Job:
        with self.sessions() as session:
            return session.get(Job, job_id)

    def wait_job(self, job_id: int, states=("succeeded", "failed", "cancelled"), timeout=90):
        return wait_until(
            lambda: (j := self.job(job_id)) and j.state in states and j,
            timeout,
            f"job {job_id} to reach {states}",
        )

    def count(self, model, *where) -> int:
        with self.sessions() as session:
            return session.scalar(select(func.count()).select_from(model).where(*where))

    def blobs(self) -> list[Blob]:
        with self.sessions() as session:
            return list(session.scalars(select(Blob)))


@dataclass
class ApiServer:
    """`farm api` (uvicorn) on a loopback port of its own."""

    env: dict[str, str]
    log: Path
    port: int = 0
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ApiServer:
        import httpx

        from tests.integration.faults import free_port

        self.port = self.port or free_port()
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "farm", "api", "--port", str(self.port)],
                env={**os.environ, **self.env},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

        def healthy() -> bool:
            if self.process.poll() is not None:
                raise AssertionError(f"farm api exited:\n{self.log.read_text()[-3000:]}")
            try:
                return httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(healthy, 60, "the API to answer")
        return self

    def stop(self) -> None:
        if self.process is not None:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=30)
            self.process = None

    def requests_logged(self, fragment: str) -> int:
        return self.log.read_text(errors="replace").count(fragment)


def submit_ref(farm, ref, spec, *, dispatcher=None, submitter=None):
    """One spec through the farm's one submit use case (`submit_matrix`), as the CLI and the API
    submit; with no `dispatcher` the new job's message is never sent (a lost message)."""
    from farm.server.jobs import service
    from farm.server.jobs.dispatch import StubDispatcher
    from farm.toolchain import host_toolchain

    with farm.sessions() as session:
        submitted = service.submit_matrix(
            session,
            farm.store,
            farm.settings,
            dispatcher or StubDispatcher(),
            ref.identity,
            [spec],
            host_toolchain(spec.target),
            describe_model=lambda: ref.info,
            upload_from=ref,
            submitter=submitter,
        )
    return submitted.results[0][1]


def host_queue(device: str = "CPU", large: bool = False) -> str:
    """The queue of a job for `device` submitted with this host's toolchain."""
    from farm.core.spec import Target
    from farm.server.routing import queue_name
    from farm.toolchain import host_toolchain

    target = Target.parse(device)
    return queue_name(target, host_toolchain(target).key_part(target), large)


def send(farm, job_id: int, queue: str | None = None) -> None:
    """Send a job's message through the broker, as `submit_matrix` and the reconciler do; by
    default to the queue of a CPU job of this host's toolchain."""
    queue = queue or host_queue()
    from farm.server.jobs.dispatch import CeleryDispatcher, dispatch

    dispatcher = CeleryDispatcher(farm.settings)
    try:
        with farm.sessions() as session:
            dispatch(session, dispatcher, job_id, queue)
    finally:
        dispatcher.close()
