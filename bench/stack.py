"""A served farm of the benchmark's own on the real services (`scripts/services up`): a fresh
PostgreSQL database (dropped afterwards), a bucket prefix of its own in SeaweedFS (emptied
afterwards), optionally Redis as the broker, `farm worker` processes and `farm api`.

The processes are started with the tests' helpers (`tests.integration.served`), so the
benchmark runs exactly what the served-mode tests run.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tests.conftest import POSTGRES_ADMIN_URL, REDIS_URL, S3_CREDENTIALS, S3_ENDPOINT_URL
from tests.integration.served import ApiServer, ServedFarm

from .common import log

REDIS_DB = 0
"""The tests take Redis databases 1-15 at random and flush them; the benchmark keeps to 0 and
refuses to start when something else is in it."""


@dataclass
class Stack:
    env: dict[str, str]
    farm: ServedFarm
    prefix: str
    api: ApiServer | None = None
    tokens: dict[str, str] = field(default_factory=dict)

    @property
    def bucket(self) -> str:
        return self.prefix.split("/", 1)[0]

    def object_key(self, storage_key: str) -> str:
        """The S3 key of a farm storage key (`blobs/<key>.blob`) under this stack's prefix."""
        return f"{self.prefix.split('/', 1)[1]}/{storage_key}"

    def client_env(self, role: str = "submit", **extra: str) -> dict[str, str]:
        """What a CLI or edge process on another machine has: the API URL and a token only."""
        assert self.api is not None
        env = {"FARM_API_URL": self.api.url, "FARM_TOKEN": self.tokens[role]}
        # Blobs are signed once farm.signing is in (the embedded farm's own key, created
        # under FARM_HOME on first use): an edge trusts that key.
        public = Path(self.env["FARM_HOME"]) / "keys" / "signing.pem.pub"
        if public.exists():
            env["FARM_TRUSTED_KEYS"] = str(public)
        return {**env, **extra}


@contextlib.contextmanager
def fresh_database() -> Iterator[str]:
    import psycopg
    from sqlalchemy.engine import make_url

    admin = make_url(POSTGRES_ADMIN_URL)
    conninfo = admin.set(drivername="postgresql").render_as_string(hide_password=False)
    name = f"farm_bench_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(conninfo, autocommit=True, connect_timeout=5) as connection:
        connection.execute(f'CREATE DATABASE "{name}"')
    try:
        yield admin.set(database=name).render_as_string(hide_password=False)
    finally:
        with psycopg.connect(conninfo, autocommit=True) as connection:
            connection.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextlib.contextmanager
def broker_database() -> Iterator[str]:
    import redis

    url = f"{REDIS_URL}/{REDIS_DB}"
    client = redis.Redis.from_url(url, socket_connect_timeout=2)
    if client.dbsize():
        raise RuntimeError(f"{url} is not empty; the benchmark uses it as a private broker")
    try:
        yield url
    finally:
        client.flushdb()
        client.close()


def empty_prefix(store, prefix: str) -> None:
    """Delete every object under the stack's prefix (blobs of 512 MB add up)."""
    client = store.client
    bucket, _, folder = prefix.partition("/")
    paginator = client.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=bucket, Prefix=f"{folder}/"):
        keys = [{"Key": item["Key"]} for item in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=bucket, Delete={"Objects": keys})
    with contextlib.suppress(Exception):
        for upload in client.list_multipart_uploads(Bucket=bucket, Prefix=f"{folder}/").get(
            "Uploads", []
        ):
            client.abort_multipart_upload(
                Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"]
            )


@contextlib.contextmanager
def served_stack(
    root: Path, *, broker: bool = True, api: bool = True, env: dict[str, str] | None = None
) -> Iterator[Stack]:
    """A served farm under `root`; `farm worker` processes are started by the caller
    (`stack.farm.start_worker(name)`) and stopped here."""
    from farm.server.tokens import create_token

    logs = root / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    prefix = f"farm/bench-{uuid.uuid4().hex[:12]}"
    with contextlib.ExitStack() as cleanup:
        database_url = cleanup.enter_context(fresh_database())
        stack_env = {
            "FARM_HOME": str(root / "farm-home"),
            "FARM_DATABASE_URL": database_url,
            "FARM_STORAGE_URL": f"s3://{prefix}",
            "FARM_S3_ENDPOINT_URL": S3_ENDPOINT_URL,
            "FARM_S3_ACCESS_KEY_ID": S3_CREDENTIALS["access_key_id"],
            "FARM_S3_SECRET_ACCESS_KEY": S3_CREDENTIALS["secret_access_key"],
            "FARM_CACHE_DIR": str(root / "client-cache"),
            # The dedup storm sends hundreds of requests a second with one token.
            "FARM_API_REQUESTS_PER_MINUTE": "1000000",
            "FARM_WORKER_HEARTBEAT_SECONDS": "2",
            **(env or {}),
        }
        if broker:
            stack_env["FARM_BROKER_URL"] = cleanup.enter_context(broker_database())
        farm = ServedFarm(stack_env, logs)
        cleanup.callback(empty_prefix, farm.store, prefix)
        cleanup.callback(farm.stop)
        stack = Stack(stack_env, farm, prefix)
        if api:
            stack.api = ApiServer(stack_env, logs / "api.log").start()
            cleanup.callback(stack.api.stop)
            with farm.sessions() as session:
                stack.tokens = {
                    role: create_token(session, f"bench-{role}", role)
                    for role in ("pull", "submit", "admin")
                }
        log(f"served stack up: database {database_url.rsplit('/', 1)[1]}, s3://{prefix}")
        yield stack
