"""A model compiles in a folder of its own: an ONNX file that names "external data" beside
itself cannot read another model's weights out of the embedded farm's local store."""

from __future__ import annotations

from farm.compiler import host_toolchain
from farm.config import Settings
from farm.db.models import Blob
from farm.identity import ModelRef
from farm.local import LocalFarm
from farm.service import submit_from_disk
from farm.spec import CompileSpec
from tests import hostile, models


def test_onnx_external_data_cannot_reach_other_models_in_the_store(tmp_path):
    farm = LocalFarm.open(Settings(home=tmp_path / "farm"))
    spec = CompileSpec.create("CPU")
    toolchain = host_toolchain(spec.target)
    victim = ModelRef.from_path(models.save_ir(models.conv_net(), tmp_path / "v" / "v.xml"))
    # The attacker knows the victim's weights digest: the store keeps them at models/<sha256>.
    attack = ModelRef.from_path(hostile._onnx_external(tmp_path / "a", victim.identity["bin"], 64))
    with farm.session() as session:
        first = submit_from_disk(session, farm.store, victim, spec, toolchain, queue="embedded")
        second = submit_from_disk(session, farm.store, attack, spec, toolchain, queue="embedded")
    assert farm.run(first.job_id).state == "succeeded"
    job = farm.run(second.job_id)
    assert job.state == "failed"
    assert "externally stored data" in job.error
    with farm.session() as session:
        assert [b.cache_key for b in session.query(Blob)] == [first.cache_key]
    farm.sessions.kw["bind"].dispose()
