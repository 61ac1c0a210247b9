"""Compression through the embedded farm and the real `farm` command: a cached `compress`
stage (two compile specs, one compression), its size and drift in `farm status` and the blob
listing, `--max-drift`, the edge's offline key, `farm pull --ir`, and INT8 quantization with a
calibration folder."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import numpy as np
import pytest

from tests.integration.test_cli_embedded import farm, farm_json
from tests.integration.test_compress_stage import cnn_classifier, matmul_chain, save

pytest.importorskip("nncf")


@pytest.fixture
def farm_home(tmp_path) -> Path:
    return tmp_path / "farm-home"


@pytest.fixture
def chain_xml(tmp_path) -> Path:
    return save(matmul_chain(layers=4, width=256), tmp_path / "model" / "chain.xml")


def stage_rows(farm_home: Path) -> list[tuple]:
    with sqlite3.connect(farm_home / "farm.db") as connection:
        return connection.execute(
            "SELECT kind, state, job_id, stage_key FROM stage_outputs ORDER BY id"
        ).fetchall()


def _dashboard_blobs(farm_home: Path) -> str:
    """The dashboard's blob table as the page renders it, from this farm's rows."""
    from farm.core.config import Settings
    from farm.server.api.dashboard_html import blobs_table
    from farm.server.blobs import service
    from farm.server.context import FarmContext
    from farm.server.views import compressions

    farm = FarmContext.open(Settings(home=farm_home))
    with farm.session() as session:
        blobs = service.list_blobs(session, None, 10)
        return blobs_table(blobs, {}, compressions(session, blobs))


def test_two_specs_over_one_compressed_model_compress_once(farm_home, chain_xml):
    first = farm_json(farm_home, "submit", str(chain_xml), "-d", "CPU", "--compress", "int8")
    second = farm_json(
        farm_home,
        "submit",
        str(chain_xml),
        "-d",
        "CPU",
        "--hint",
        "THROUGHPUT",
        "--compress",
        "int8",
    )
    assert first["cache_key"] != second["cache_key"]
    assert first["job"]["state"] == second["job"]["state"] == "succeeded"
    rows = stage_rows(farm_home)
    assert [(kind, state) for kind, state, _, _ in rows] == [("compress", "done")]
    assert rows[0][2] == first["job"]["id"]  # the first job compressed; the second reused it

    status = farm_json(farm_home, "status", first["cache_key"])
    compression = status["blob"]["compression"]
    assert compression["kind"] == "compress"
    assert compression["args"] == {"mode": "int8_asym"}
    metrics = compression["metrics"]
    assert metrics["size_after"] / metrics["size_before"] < 0.27
    assert 0 < metrics["drift"]["max_abs_diff"] < 0.05
    assert compression["tool_versions"]["nncf"]
    listed_human = farm(farm_home, "blobs").stdout
    assert listed_human.count("int8_asym 0.25") == 2
    human = farm(farm_home, "status", first["cache_key"]).stdout
    assert "int8_asym" in human and "max-abs" in human

    listing = farm_json(farm_home, "blobs")
    listed = {
        b["cache_key"]: b for b in (listing if isinstance(listing, list) else listing["blobs"])
    }
    assert listed[second["cache_key"]]["compression"]["stage_key"] == rows[0][3]

    dashboard = _dashboard_blobs(farm_home)
    assert dashboard.count("int8_asym 0.25") == 2 and "drift max-abs" in dashboard

    with sqlite3.connect(farm_home / "farm.db") as connection:
        view = connection.execute(
            "SELECT cache_key, kind, mode, size_before, size_after, max_abs_diff, nncf_version, "
            "source_name FROM compressed_blobs ORDER BY cache_key"
        ).fetchall()
    assert sorted(row[0] for row in view) == sorted([first["cache_key"], second["cache_key"]])
    assert all(row[1:3] == ("compress", "int8_asym") for row in view)
    assert all(row[4] < row[3] and row[5] > 0 and row[6] for row in view)
    assert all(row[7] == "chain.xml" for row in view)


def test_the_edge_computes_the_compressed_blobs_key_offline(farm_home, chain_xml, tmp_path):
    submitted = farm_json(
        farm_home, "submit", str(chain_xml), "-d", "CPU", "--compress", "int4-sym"
    )
    pulled = farm_json(farm_home, "pull", str(chain_xml), "-d", "CPU", "--compress", "int4-sym")
    assert pulled["cache_key"] == submitted["cache_key"]
    other = farm(farm_home, "pull", str(chain_xml), "-d", "CPU", "--compress", "int8", check=False)
    assert other.returncode != 0  # another compression: another key, not compiled


def test_pull_ir_gives_the_compressed_ir(farm_home, chain_xml, tmp_path):
    farm_json(farm_home, "submit", str(chain_xml), "-d", "CPU", "--compress", "int8")
    # The blob computes the compressed model's reference outputs (not the uncompressed ones).
    verified = farm(farm_home, "verify", str(chain_xml), "-d", "CPU", "--compress", "int8")
    assert "passed" in verified.stdout
    out = tmp_path / "ir"
    pulled = farm_json(farm_home, "pull", str(chain_xml), "--compress", "int8", "--ir", str(out))
    import openvino as ov

    xml = Path(pulled["files"]["xml"])
    assert xml == out / "model.xml"
    model = ov.Core().read_model(xml)
    types = {
        op.get_output_element_type(0).get_type_name()
        for op in model.get_ops()
        if op.get_type_name() == "Constant"
    }
    assert "u8" in types
    assert xml.with_suffix(".bin").stat().st_size < chain_xml.with_suffix(".bin").stat().st_size
    assert pulled["kind"] == "compress"
    assert pulled["tool_versions"]["nncf"]
    missing = farm(farm_home, "pull", str(chain_xml), "--compress", "nf4", "--ir", str(out),
                   check=False)  # fmt: skip
    assert missing.returncode == 3  # not found: nothing compressed that way yet
    plain = farm(farm_home, "pull", str(chain_xml), "--ir", str(out), check=False)
    assert plain.returncode == 2
    assert "--ir is for sources the farm converts or compresses" in plain.stderr


def test_max_drift_fails_the_job_with_the_figure(farm_home, chain_xml):
    result = farm(
        farm_home,
        "submit",
        str(chain_xml),
        "-d",
        "CPU",
        "--compress",
        "int4-sym",
        "--max-drift",
        "0.000001",
        "--json",
        check=False,
    )
    assert result.returncode != 0
    answer = json.loads(result.stdout)
    assert answer["job"]["state"] == "failed"
    assert "max_abs_diff=" in answer["job"]["error"]
    assert "--max-drift max-abs=1e-06" in answer["job"]["error"]
    with sqlite3.connect(farm_home / "farm.db") as connection:
        assert connection.execute("SELECT count(*) FROM blobs").fetchone()[0] == 0


def test_refusals_before_anything_is_uploaded(farm_home, chain_xml):
    nf4 = farm(farm_home, "submit", str(chain_xml), "-d", "3720", "--compress", "nf4", check=False)
    assert nf4.returncode == 2
    assert "NF4 data type needs NPU 4000" in nf4.stderr
    bad = farm(
        farm_home, "submit", str(chain_xml), "-d", "CPU", "--compress", "int8", "--ratio", "0.5",
        check=False,
    )  # fmt: skip
    assert bad.returncode == 2
    assert "apply to 4-bit modes only" in bad.stderr


def test_int8_quantization_with_a_calibration_folder(farm_home, tmp_path):
    xml = save(cnn_classifier(), tmp_path / "cnn" / "cnn.xml")
    calibration = tmp_path / "calibration"
    calibration.mkdir()
    rng = np.random.default_rng(3)
    np.save(calibration / "batch.npy", rng.standard_normal((16, 3, 16, 16)).astype(np.float32))
    submitted = farm_json(
        farm_home,
        "submit",
        str(xml),
        "-d",
        "CPU",
        "--quantize",
        "int8",
        "--calibration",
        str(calibration),
    )
    assert submitted["job"]["state"] == "succeeded"
    compression = farm_json(farm_home, "status", submitted["cache_key"])["blob"]["compression"]
    assert compression["kind"] == "quantize"
    assert compression["metrics"]["resolved"]["calibration_samples"] == 16
    assert compression["metrics"]["drift"]["top1_agreement"] >= 0.8

    small = tmp_path / "small"
    small.mkdir()
    np.save(small / "few.npy", rng.standard_normal((3, 3, 16, 16)).astype(np.float32))
    failed = farm(
        farm_home, "submit", str(xml), "-d", "CPU", "--quantize", "int8", "--calibration",
        str(small), "--json", check=False,
    )  # fmt: skip
    assert failed.returncode != 0
    assert "fewer than 10" in failed.stdout + failed.stderr


def test_the_drift_is_measured_in_its_own_child_as_its_own_phase(farm_home, chain_xml):
    """The compression's child runs NNCF only; the drift is the next child's, timed as the
    job's `drift` phase (out of the `compress` phase) with its own seconds and peak in the stage
    metrics. A job reusing the stage measures nothing again."""
    first = farm_json(farm_home, "submit", str(chain_xml), "-d", "CPU", "--compress", "int8")
    again = farm_json(
        farm_home, "submit", str(chain_xml), "-d", "CPU", "--hint", "LATENCY", "--compress", "int8"
    )
    assert first["job"]["state"] == again["job"]["state"] == "succeeded"
    with sqlite3.connect(farm_home / "farm.db") as connection:

        def phases(job_id: int) -> list[tuple[str, float]]:
            return connection.execute(
                "SELECT phase, seconds FROM job_phases WHERE job_id = ? ORDER BY started_at",
                (job_id,),
            ).fetchall()

        ran, reused = phases(first["job"]["id"]), phases(again["job"]["id"])
        (metrics,) = connection.execute("SELECT metrics FROM stage_outputs").fetchone()
    names = [name for name, _ in ran]
    assert names.index("fetch") < names.index("compress") < names.index("drift")
    assert names.index("drift") < names.index("compile")
    assert all(seconds > 0 for name, seconds in ran if name in ("compress", "drift"))
    assert "drift" not in [name for name, _ in reused]  # reused with its drift: none measured

    metrics = json.loads(metrics)
    assert metrics["drift"]["samples"] == 1 and metrics["drift"]["max_abs_diff"] > 0
    assert 0 < metrics["drift_seconds"] <= metrics["drift_child_seconds"]
    # Two children, two peaks: the compression's (NNCF's) and the drift's, each its own.
    assert metrics["peak_rss_bytes"] > 0 and metrics["drift_peak_rss_bytes"] > 0
    assert metrics["peak_rss_bytes"] != metrics["drift_peak_rss_bytes"]


def test_a_step_is_timed_as_its_own_phase_out_of_the_enclosing_one():
    import time

    from farm.server.jobs.phases import PhaseClock, step

    clock = PhaseClock()
    with step("outside"):  # no attempt's phase running: nothing timed
        pass
    with clock.phase("compress"):
        time.sleep(0.05)
        with step("drift"):
            time.sleep(0.2)
    (outer, outer_at, outer_s), (inner, inner_at, inner_s) = sorted(clock.timed, key=lambda t: t[1])
    assert (outer, inner) == ("compress", "drift") and outer_at <= inner_at
    assert inner_s >= 0.2 and 0.05 <= outer_s < 0.2
