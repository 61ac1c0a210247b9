"""A model compiles in a folder of its own: an ONNX file that names "external data" beside
itself cannot read another model's weights out of the embedded farm's local store."""

from __future__ import annotations

from farm.core.config import Settings
from farm.core.identity import ModelRef
from farm.core.spec import CompileSpec
from farm.server.context import FarmContext
from farm.server.db.models import Blob
from tests import hostile, models
from tests.integration.served import submit_ref


def test_onnx_external_data_cannot_reach_other_models_in_the_store(tmp_path):
    farm = FarmContext.open(Settings(home=tmp_path / "farm"))
    spec = CompileSpec.create("CPU")
    victim = ModelRef.from_path(models.save_ir(models.conv_net(), tmp_path / "v" / "v.xml"))
    # The attacker knows the victim's weights digest: the store keeps them at models/<sha256>.
    attack = ModelRef.from_path(hostile._onnx_external(tmp_path / "a", victim.identity["bin"], 64))
    first = submit_ref(farm, victim, spec)  # queued, not run: the stub dispatcher sends nothing
    second = submit_ref(farm, attack, spec)
    assert farm.run(first.job_id).state == "succeeded"
    job = farm.run(second.job_id)
    assert job.state == "failed"
    assert "externally stored data" in job.error
    with farm.session() as session:
        assert [b.cache_key for b in session.query(Blob)] == [first.cache_key]
    farm.sessions.kw["bind"].dispose()
