"""A farm with a history, for the admin tests: real compiles through `farm submit` over the API,
real imports reported as pulls, and workers registered the way `farm worker` registers them.

The API runs without a broker, so it compiles each job in its own process (the embedded API),
on whichever database and store the test gives it. Ageing rows (`age`) is the one shortcut:
a test cannot wait 30 days for a blob to go unpulled.
"""

from __future__ import annotations

import gc
import json
import shutil
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from click.testing import CliRunner
from sqlalchemy import select

from farm.client import FarmClient
from farm.core.config import Settings
from farm.server.db.session import make_engine, make_session_factory, upgrade_database
from farm.server.tokens import create_token
from tests import models
from tests.integration.served import ApiServer


def farm_cli(env: dict[str, str], *args: str, expect: int = 0) -> dict:
    """Run `farm ARGS --json` in this process (the real command, without a new interpreter)."""
    from farm.cli import main

    with warnings.catch_warnings():
        # A `farm` process leaves its HTTP client's socket to process exit; in this process
        # that would be a ResourceWarning once the result (and the traceback it holds) goes.
        warnings.simplefilter("ignore", ResourceWarning)
        result = CliRunner().invoke(main, [*args, "--json"], env=env, catch_exceptions=False)
        code, stdout, output = result.exit_code, result.stdout, result.output
        del result
        gc.collect()
    assert code == expect, f"farm {' '.join(args)} → {code}\n{output}"
    return json.loads(stdout) if stdout.strip() else {}


@dataclass
class AdminFarm:
    env: dict[str, str]
    """Where the farm's data lives: FARM_DATABASE_URL, FARM_STORAGE_URL (+ S3 settings)."""
    api: ApiServer
    tokens: dict[str, str]
    workdir: Path
    engine: object = None
    keys: dict[str, str] = field(default_factory=dict)
    """Cache keys by the names the tests give them."""

    def __post_init__(self) -> None:
        self.engine = make_engine(self.env["FARM_DATABASE_URL"])
        self.sessions = make_session_factory(self.engine)

    @property
    def settings(self) -> Settings:
        return Settings(
            **{
                k.removeprefix("FARM_").lower(): v
                for k, v in self.env.items()
                if k.startswith("FARM_")
            }
        )

    @property
    def client_env(self) -> dict[str, str]:
        return {
            "FARM_API_URL": self.api.url,
            "FARM_TOKEN": self.tokens["submit"],
            "FARM_CACHE_DIR": str(self.workdir / "cache"),
            "FARM_HOME": str(self.workdir / "client-home"),
        }

    def submit(self, model, name: str, *spec: str, expect: int = 0) -> list[dict]:
        """Compile `model` through `farm submit --wait` over the API; one result per spec."""
        xml = models.save_ir(model, self.workdir / name / f"{name}.xml")
        answer = farm_cli(self.client_env, "submit", str(xml), *spec, "--wait", expect=expect)
        self.references_settled()
        return answer.get("results", [answer])

    def references_settled(self, timeout: float = 120) -> None:
        """Wait until no blob's reference is pending (it follows the blob: a worker computes
        it after recording the job succeeded)."""
        import time

        from farm.server.db.models import Blob

        deadline = time.monotonic() + timeout
        while True:
            with self.sessions() as session:
                pending = session.scalars(
                    select(Blob.cache_key).where(Blob.reference_state == "pending")
                ).all()
            if not pending:
                return
            assert time.monotonic() < deadline, f"references still pending: {pending}"
            time.sleep(0.1)

    def pull(self, cache_key: str, agent: str, device: str = "CPU") -> dict:
        return pull_and_report(
            self.api.url, self.tokens["pull"], cache_key, agent, self.workdir / "edge", device
        )

    def verify(self, cache_key: str, agent: str, *options: str, expect: int = 0) -> dict:
        """`farm verify KEY` on an edge with a pull token, trusting the farm's key."""
        env = {
            **self.client_env,
            "FARM_TOKEN": self.tokens["pull"],
            "FARM_AGENT_ID": agent,
            "FARM_CACHE_DIR": str(self.workdir / "verify" / agent),
            "FARM_TRUSTED_KEYS": str(Path(self.env["FARM_HOME"]) / "keys" / "signing.pem.pub"),
        }
        return farm_cli(env, "verify", cache_key, "--runs", "3", *options, expect=expect)

    def give_reference_of(self, source: str, to: str) -> None:
        """Record blob `source`'s reference outputs as blob `to`'s, signed by the farm's key:
        what a worker that ran the reference of the wrong model would have stored."""
        from farm.core.signing import Signer
        from farm.server.blobs.signatures import sign_reference
        from farm.server.db.models import Blob

        store = Path(self.env["FARM_STORAGE_URL"]) / "references"
        signer = Signer.from_file(Path(self.env["FARM_HOME"]) / "keys" / "signing.pem")
        with self.sessions() as session:
            rows = {b.cache_key: b for b in session.scalars(select(Blob))}
            digest = rows[source].reference_sha256
            (store / to).mkdir(exist_ok=True)
            shutil.copyfile(store / source / f"{digest}.npz", store / to / f"{digest}.npz")
            rows[to].reference_sha256 = rows[source].reference_sha256
            rows[to].reference_size_bytes = rows[source].reference_size_bytes
            sign_reference(rows[to], signer)
            session.commit()

    def reference_of(self, key: str) -> str:
        """The sha256 of blob `key`'s reference file."""
        from farm.server.db.models import Blob

        with self.sessions() as session:
            return session.scalars(select(Blob.reference_sha256).where(Blob.cache_key == key)).one()

    def skew_reference(self, key: str, factor: float, digest: str | None = None) -> None:
        """Record blob `key`'s reference (or its earlier one, of sha256 `digest`) with its
        outputs times `factor`, signed by the farm's key: a reference the blob's numbers are
        outside of (a blob that computes wrong)."""
        from farm.core import hashing
        from farm.core.reference import Reference
        from farm.core.signing import Signer
        from farm.server.blobs.signatures import sign_reference
        from farm.server.db.models import Blob

        store = Path(self.env["FARM_STORAGE_URL"]) / "references" / key
        signer = Signer.from_file(Path(self.env["FARM_HOME"]) / "keys" / "signing.pem")
        with self.sessions() as session:
            row = session.scalars(select(Blob).where(Blob.cache_key == key)).one()
            reference = Reference.load(store / f"{digest or row.reference_sha256}.npz")
            outputs = {name: value * factor for name, value in reference.outputs.items()}
            skewed = Reference(reference.inputs, outputs).save(store / "skewed.npz")
            digest, size = hashing.sha256_file(skewed), skewed.stat().st_size
            skewed.rename(store / f"{digest}.npz")
            row.reference_sha256, row.reference_size_bytes = digest, size
            sign_reference(row, signer)
            session.commit()

    def age(self, model, where, days: float) -> None:
        """Move the `created_at` of `model` rows matching `where` `days` into the past (a test
        cannot wait 30 days for a blob to go unpulled)."""
        with self.sessions() as session:
            for row in session.scalars(select(model).where(where)):
                row.created_at -= timedelta(days=days)
            session.commit()

    def gc(self, *args: str, expect: int = 0) -> dict:
        return farm_cli(self.env, "gc", *args, expect=expect)

    def close(self) -> None:
        self.api.stop()
        self.engine.dispose()


def pull_and_report(
    api_url: str, token: str, cache_key: str, agent: str, workdir: Path, device: str = "CPU"
) -> dict:
    """What an edge does: download a blob, import it with OpenVINO on `device`, report it."""
    from farm.edge import import_blob

    path = workdir / agent / f"{cache_key}.blob"
    path.parent.mkdir(parents=True, exist_ok=True)
    with FarmClient(api_url, token) as client:
        client.download(cache_key, path)
        try:
            imported = import_blob(path, device)
        except RuntimeError as error:
            report = {"ok": False, "error": " ".join(str(error).split())[:300]}
        else:
            report = {"ok": True, "import_seconds": imported.import_seconds}
            del imported
        client.report_pull(cache_key, agent, **report)
    return report


@contextmanager
def admin_farm(env: dict[str, str], workdir: Path) -> Iterator[AdminFarm]:
    """The embedded API on `env`'s database and store, with a token per role."""
    env = {"FARM_HOME": str(workdir / "farm-home"), **env}
    upgrade_database(env["FARM_DATABASE_URL"])
    engine = make_engine(env["FARM_DATABASE_URL"])
    with make_session_factory(engine)() as session:
        tokens = {role: create_token(session, f"test-{role}", role) for role in ("pull", "submit")}
    engine.dispose()
    api = ApiServer(env, workdir / "api.log").start()
    farm = AdminFarm(env, api, tokens, workdir)
    try:
        yield farm
    finally:
        farm.close()
