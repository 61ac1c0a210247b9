"""`farm gc` deletes model files no job names once they are older than
FARM_MODEL_GRACE_SECONDS, on SQLite with a local store and on PostgreSQL with SeaweedFS; the
dry run lists them, and the files of submitted models stay."""

from __future__ import annotations

import hashlib
import os

from farm.client import FarmClient
from farm.core.hashing import model_files, sha256_file
from farm.server.storage import open_store
from tests import models
from tests.integration.admin_farm import admin_farm, farm_cli
from tests.integration.test_gc import farm_env  # noqa: F401 (the fixture: both set-ups)


def stored_model_files(farm) -> set[str]:
    store = open_store(farm.env["FARM_STORAGE_URL"], farm.settings)
    return {key.removeprefix("models/") for key, _, _ in store.list_objects("models/")}


def test_gc_deletes_model_files_no_job_names_after_the_grace_period(farm_env, tmp_path):  # noqa: F811
    with admin_farm(farm_env, tmp_path) as farm:
        farm.submit(models.conv_net(), "conv", "-d", "CPU")
        xml = tmp_path / "conv" / "conv.xml"
        submitted = {sha256_file(path) for path in model_files(xml).values()}
        # A file uploaded and never submitted (a submit refused, a CLI killed before its submit).
        orphan = tmp_path / "orphan.bin"
        orphan.write_bytes(os.urandom(100_000))
        digest = hashlib.sha256(orphan.read_bytes()).hexdigest()
        with FarmClient(farm.api.url, farm.tokens["submit"]) as client:
            assert client.upload(digest, orphan)["stored"]
        assert stored_model_files(farm) == submitted | {digest}

        # Within the grace period (a day by default): kept, it may be submitted yet.
        young = farm.gc("--unpulled-days", "7", "--dry-run")
        assert young["models"] == [] and young["model_grace_seconds"] == 24 * 3600
        assert farm.gc("--unpulled-days", "7")["models"] == []
        assert stored_model_files(farm) == submitted | {digest}

        no_grace = {**farm.env, "FARM_MODEL_GRACE_SECONDS": "0"}
        dry = farm_cli(no_grace, "gc", "--unpulled-days", "7", "--dry-run")
        assert [(m["sha256"], m["size_bytes"]) for m in dry["models"]] == [(digest, 100_000)]
        assert dry["model_bytes"] == 100_000 and dry["dry_run"]
        assert stored_model_files(farm) == submitted | {digest}

        done = farm_cli(no_grace, "gc", "--unpulled-days", "7")
        assert [m["sha256"] for m in done["models"]] == [digest] and done["errors"] == []
        assert stored_model_files(farm) == submitted
        with FarmClient(farm.api.url, farm.tokens["submit"]) as client:
            assert client.missing(sorted(submitted | {digest})) == [digest]
        assert farm_cli(no_grace, "gc", "--unpulled-days", "7")["models"] == []
