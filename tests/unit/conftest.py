"""Fixtures of the rule tests: a farm on SQLite with a local store under tmp_path, no service.

`embedded_farm` is the embedded default; `served_farm` has a broker URL, so it routes like a
served farm, but nothing contacts the broker: the tests hand the rules a `StubDispatcher`.
Rows are inserted or aged directly (`add_job`, `age`) instead of waiting for time to pass.
"""

from __future__ import annotations

import functools
import hashlib
import os
import tempfile
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import update

from farm.core.clock import now
from farm.core.config import Settings
from farm.core.identity import ModelInfo, ModelRef
from farm.core.spec import CompileSpec, Toolchain
from farm.server.context import FarmContext
from farm.server.db.models import Blob, Job
from farm.server.db.session import upgrade_database
from farm.server.jobs.dispatch import StubDispatcher
from farm.server.jobs.service import register_model
from farm.server.storage import blob_storage_key, model_storage_key

TOOLCHAIN = Toolchain(openvino="2026.4.1", runtime_requirements="x")
"""A toolchain that needs no OpenVINO probe (farm.toolchain compiles a tiny model)."""


@functools.cache
def cpu_spec() -> CompileSpec:
    """The default CPU spec (`CPU`)."""
    return CompileSpec.create("CPU")


def __getattr__(name: str) -> Any:
    """`CPU` is built on first use, not when pytest imports this module: mutation testing
    (scripts/mutation) makes every function of farm/core/spec.py raise once to check that the
    tests notice, and a conftest that cannot be imported stops pytest as a usage error instead
    of failing the tests that use it."""
    if name == "CPU":
        return cpu_spec()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


NOWHERE_BROKER = "redis://127.0.0.1:1/0"
"""Makes `Settings.served` true; never contacted (nothing calls `FarmContext.dispatcher`)."""


def open_farm(home: Path, monkeypatch: pytest.MonkeyPatch, **settings: Any) -> FarmContext:
    for name in list(os.environ):
        if name.startswith("FARM_") and name != "FARM_CACHE_DIR":
            monkeypatch.delenv(name)  # only what the test says, never the developer's setup
    database = home / "farm.db"
    if "database_url" not in settings and not database.exists():
        home.mkdir(parents=True, exist_ok=True)
        database.write_bytes(migrated_database())  # FarmContext.open finds it at head
    return FarmContext.open(Settings(home=home, **settings))


@functools.cache
def migrated_database() -> bytes:
    """An empty SQLite database at the schema's head, migrated once per test process: each
    farm starts from a copy (migrating from scratch costs 0.2-0.5 s a test, which mutation
    testing pays once per mutant and test)."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "farm.db"
        upgrade_database(f"sqlite:///{path}")
        return path.read_bytes()


def close_farm(farm: FarmContext) -> None:
    farm.sessions.kw["bind"].dispose()


@pytest.fixture
def embedded_farm(tmp_path, monkeypatch) -> Iterator[FarmContext]:
    farm = open_farm(tmp_path / "farm", monkeypatch)
    yield farm
    close_farm(farm)


@pytest.fixture
def served_farm(tmp_path, monkeypatch) -> Iterator[FarmContext]:
    farm = open_farm(tmp_path / "farm", monkeypatch, broker_url=NOWHERE_BROKER)
    assert farm.settings.served
    yield farm
    close_farm(farm)


@pytest.fixture
def stub() -> StubDispatcher:
    return StubDispatcher()


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def make_ref(folder: Path, name: str = "model", *, onnx: bool = False) -> ModelRef:
    """A fake model on disk (no OpenVINO reads it here): its files, digests and name."""
    folder.mkdir(parents=True, exist_ok=True)
    roles = {"onnx": ".onnx"} if onnx else {"xml": ".xml", "bin": ".bin"}
    files = {role: folder / f"{name}{suffix}" for role, suffix in roles.items()}
    for role, path in files.items():
        path.write_bytes(f"{name} {role} file".encode())
    identity = {role: sha256(path.read_bytes()) for role, path in sorted(files.items())}
    return ModelRef(files, identity, files["onnx" if onnx else "xml"].name)


def store_model(farm: FarmContext, ref: ModelRef) -> None:
    for role, path in ref.files.items():
        sha = ref.identity[role]
        farm.store.put_file(model_storage_key(sha), path, expected_sha256=sha)


def add_model(farm: FarmContext, name: str = "m") -> int:
    """A model row (its files are not in the store); returns its id."""
    info = ModelInfo({"xml": sha256(name.encode() + b"x"), "bin": sha256(name.encode())}, name, 10)
    with farm.session() as session:
        row = register_model(session, info)
        session.commit()
        return row.id


def key(n: int | str) -> str:
    """A distinct, valid cache key per `n`."""
    return sha256(f"key {n}".encode())


def add_job(farm: FarmContext, model_id: int, n: int | str, **fields: Any) -> int:
    """A job row as the rules would have left it; `fields` override (state, lease, times...)."""
    values: dict[str, Any] = {
        "cache_key": key(n),
        "model_id": model_id,
        "target": "CPU",
        "queue": "compile.cpu",
        "spec": cpu_spec().canonical(),
        "toolchain": TOOLCHAIN.key_part(cpu_spec().target),
        "state": "queued",
        "created_at": now(),
        **fields,
    }
    with farm.session() as session:
        job = Job(**values)
        session.add(job)
        session.commit()
        return job.id


def add_blob(
    farm: FarmContext,
    model_id: int,
    cache_key: str,
    *,
    created_at: datetime | None = None,
    target: str = "CPU",
) -> Blob:
    """A stored blob: its object in the local store and its row."""
    data = f"blob {cache_key}".encode()
    source = farm.settings.home / f"{cache_key}.source"
    source.write_bytes(data)
    farm.store.put_file(blob_storage_key(cache_key), source)
    source.unlink()
    with farm.session() as session:
        blob = Blob(
            cache_key=cache_key,
            model_id=model_id,
            target=target,
            spec=cpu_spec().canonical(),
            toolchain=TOOLCHAIN.as_dict(),
            openvino_version=TOOLCHAIN.openvino,
            storage_key=blob_storage_key(cache_key),
            size_bytes=len(data),
            sha256=sha256(data),
            payload_offset=0,
            weightless=False,
            created_at=created_at or now(),
        )
        session.add(blob)
        session.commit()
        return blob


def get_job(farm: FarmContext, job_id: int) -> Job:
    """The row as the database holds it now (a fresh session, nothing cached)."""
    with farm.session() as session:
        job = session.get(Job, job_id)
        assert job is not None
        return job


def columns(farm: FarmContext, job_id: int) -> dict[str, Any]:
    """Every column of a job row: compare before and after to prove a rule left it alone."""
    job = get_job(farm, job_id)
    return {column.key: getattr(job, column.key) for column in Job.__table__.columns}


def set_job(farm: FarmContext, job_id: int, **values: Any) -> None:
    with farm.session() as session:
        session.execute(update(Job).where(Job.id == job_id).values(**values))
        session.commit()
