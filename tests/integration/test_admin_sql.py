"""Every query in the README's "Admin SQL" section, run on PostgreSQL and SQLite against a farm
with real compiles, real imports reported as pulls, a real `farm gc`, and registered workers."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pytest
from sqlalchemy import inspect, select, text

from farm.server import routing
from farm.server.db.models import Blob, Job, Pull
from farm.server.db.session import make_engine, upgrade_database
from tests import models
from tests.integration.admin_farm import admin_farm

ROOT = Path(__file__).resolve().parents[2]


def readme_queries() -> dict[str, str]:
    """`### title` → the SQL block under it, in README.md's "Admin SQL" section."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Admin SQL\n", 1)[1].split("\n## ", 1)[0]
    found = re.findall(r"^### (.+?)\n```sql\n(.*?)```", section, re.M | re.S)
    return {title: sql.strip() for title, sql in found}


@dataclass
class History:
    keys: dict[str, str]
    """'a', 'b' (conv net, batch 1 and 2), 'c' (deleted by gc), 'd' (never pulled)."""
    sizes: dict[str, int]
    imports: dict[str, list[float]]
    """Import seconds of the successful pulls, by blob."""
    jobs: list[Job]
    worker: str
    gc: dict


@pytest.fixture
def history(database_url, tmp_path):
    env = {"FARM_DATABASE_URL": database_url, "FARM_STORAGE_URL": str(tmp_path / "store")}
    with admin_farm(env, tmp_path) as farm:
        conv = farm.submit(
            models.conv_net(), "conv", "-d", "CPU", "--batch", "1,2", "--layout", "x:NCHW"
        )
        keys = {"a": conv[0]["cache_key"], "b": conv[1]["cache_key"]}
        # A compile OpenVINO refuses (a value out of its range): a real failed job. (An NPU
        # target is no longer one here: the embedded farm answers `unavailable`, no job.)
        bad = ("--config", "PERFORMANCE_HINT_NUM_REQUESTS=999999999999")
        farm.submit(models.conv_net(), "conv", "-d", "CPU", *bad, expect=1)
        keys["c"] = farm.submit(models.transformer_block(), "block", "-d", "CPU")[0]["cache_key"]
        keys["d"] = farm.submit(models.two_input_net(), "adder", "-d", "CPU")[0]["cache_key"]

        imports = {"a": [], "b": []}
        for key, agent, device in (
            ("a", "edge-1", "CPU"),
            ("a", "edge-2", "CPU"),
            ("b", "edge-1", "CPU"),
        ):
            imports[key].append(farm.pull(keys[key], agent, device)["import_seconds"])
        assert not farm.pull(keys["a"], "edge-3", "NPU")["ok"]  # no NPU device here
        assert farm.verify(keys["a"], "edge-1")["passed"]
        # b (batch 2) given a's reference (batch 1): it cannot run those inputs, an error of
        # the verification (exit 4), which quarantines nothing.
        own = farm.reference_of(keys["b"])
        farm.give_reference_of(keys["a"], to=keys["b"])
        assert farm.verify(keys["b"], "edge-1", expect=4)["outcome"] == "error"
        # b's outputs outside its reference: a real failed verification, which quarantines b.
        farm.skew_reference(keys["b"], 1.5, own)
        assert farm.verify(keys["b"], "edge-2", expect=9)["outcome"] == "failed"

        farm.age(Blob, Blob.cache_key == keys["b"], 45)
        farm.age(Pull, Pull.cache_key == keys["b"], 40)
        farm.age(Blob, Blob.cache_key == keys["c"], 60)
        with farm.sessions() as session:
            sizes = {
                name: session.scalar(select(Blob.size_bytes).where(Blob.cache_key == key))
                for name, key in keys.items()
            }
        gc = farm.gc("--unpulled-days", "50")

        with farm.sessions() as session:
            jobs = list(session.scalars(select(Job).order_by(Job.id)))
            worker = jobs[0].worker  # the embedded API records its host as the worker
            for name in (worker, "old@host"):
                routing.register_worker(
                    session,
                    name=name,
                    host=name.split("@")[-1],
                    pid=1,
                    targets={"CPU": None},
                    queues=["compile.cpu"],
                    openvino_version="2026.0.0",
                    memory_bytes=2**34,
                )
            routing.mark_stopped(session, "old@host")
        yield farm, History(keys, sizes, imports, jobs, worker, gc)


def percentile(values: list[float], p: float) -> float:
    """percentile_cont: linear interpolation between the ranks around p·(n-1)."""
    ordered = sorted(values)
    position = p * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def seconds(start: datetime, end: datetime) -> float:
    return (end - start).total_seconds()


# --- one check per README query, by its title ---------------------------------------------


def check_inventory(rows, h: History):
    (row,) = rows
    assert (row["target"], row["blobs"]) == ("CPU", 3)  # c was deleted by gc
    assert row["total_bytes"] == h.sizes["a"] + h.sizes["b"] + h.sizes["d"]
    assert row["npu_compiler"] is None and row["openvino_version"].count(".") == 2


def check_largest(rows, h: History):
    sizes = [row["size_bytes"] for row in rows]
    assert sizes == sorted(sizes, reverse=True) and len(rows) == 3
    assert {row["cache_key"]: row["pulls"] for row in rows} == {
        h.keys["a"]: 3,
        h.keys["b"]: 1,
        h.keys["d"]: 0,
    }


def check_states(rows, h: History):
    assert {row["state"]: row["jobs"] for row in rows} == {"failed": 1, "succeeded": 4}


def check_failures(rows, h: History):
    (row,) = rows
    assert row["target"] == "CPU" and row["jobs"] == 1
    assert "Wrong value" in row["reason"] and len(row["reason"]) <= 200


def check_compile_vs_import(rows, h: History):
    (row,) = rows  # only the conv net was imported on an edge
    ok = h.imports["a"] + h.imports["b"]
    assert (row["model_name"], row["target"], row["blobs"], row["imports"]) == (
        "conv.xml",
        "CPU",
        2,
        3,
    )
    assert row["import_seconds_avg"] == pytest.approx(sum(ok) / len(ok))
    compiles = [j.compile_seconds for j in h.jobs if j.cache_key in (h.keys["a"], h.keys["b"])]
    assert row["compile_seconds_avg"] == pytest.approx(sum(compiles) / 2)
    expected = row["compile_seconds_avg"] / row["import_seconds_avg"]
    assert float(row["import_times_faster"]) == pytest.approx(expected, abs=0.051)


def check_never_pulled(rows, h: History):
    assert [row["cache_key"] for row in rows] == [h.keys["d"]]
    assert rows[0]["model_name"] == "adder.xml"


def check_unpulled_30_days(rows, h: History):
    (row,) = rows  # b: pulled 40 days ago; c was older but gc took it
    assert (row["cache_key"], row["pulls"]) == (h.keys["b"], 1)
    assert row["idle_days"] == pytest.approx(40, abs=0.01)


def check_percentiles(rows, h: History):
    (row,) = rows
    done = [j for j in h.jobs if j.state == "succeeded"]
    waits = [seconds(j.created_at, j.started_at) for j in done]
    runs = [seconds(j.started_at, j.finished_at) for j in done]
    assert (row["target"], row["jobs"]) == ("CPU", 4)
    for column, values, p in (
        ("queue_wait_p50", waits, 0.5),
        ("queue_wait_p90", waits, 0.9),
        ("run_p50", runs, 0.5),
        ("run_p90", runs, 0.9),
    ):
        assert row[column] == pytest.approx(percentile(values, p), abs=1e-3), column
    assert row["run_max"] == pytest.approx(max(runs), abs=1e-3)
    assert row["run_p50"] <= row["run_p90"] <= row["run_max"]


def check_slowest(rows, h: History):
    done = sorted((j for j in h.jobs if j.state == "succeeded"), key=lambda j: -j.compile_seconds)
    assert [row["job_id"] for row in rows] == [j.id for j in done]
    assert all(row["peak_rss_bytes"] > 10 * 2**20 and row["worker"] == h.worker for row in rows)


def check_phase_summary(rows, h: History):
    done = [j for j in h.jobs if j.state == "succeeded"]
    by_phase = {row["phase"]: row for row in rows if row["target"] == "CPU"}
    assert {"fetch", "compile", "upload", "record"} <= set(by_phase)
    assert by_phase["compile"]["attempts"] >= len(done)
    assert by_phase["compile"]["max_ms"] >= max(j.compile_seconds for j in done) * 1000 - 1
    totals = [row["total_seconds"] for row in rows]
    assert totals == sorted(totals, reverse=True)


def check_failed_imports(rows, h: History):
    (row,) = rows
    assert (row["agent_id"], row["target"], row["cache_key"]) == ("edge-3", "CPU", h.keys["a"])
    assert row["error"]


def check_pulls_per_agent(rows, h: History):
    assert [(r["agent_id"], r["pulls"], r["blobs"]) for r in rows] == [
        ("edge-1", 2, 2),
        ("edge-2", 1, 1),
        ("edge-3", 1, 1),
    ]


def check_workers(rows, h: History):
    assert [(r["name"], r["status"]) for r in rows] == [
        (h.worker, "running"),
        ("old@host", "stopped"),
    ]
    assert 0 <= rows[0]["seconds_since_heartbeat"] < 60
    assert (rows[0]["running_jobs"], rows[0]["succeeded_jobs"]) == (0, 4)


def check_submitters(rows, h: History):
    assert [(r["submitter"], r["jobs"], r["failed"]) for r in rows] == [("test-submit", 5, 1)]


def check_never_verified(rows, h: History):
    assert [(r["cache_key"], r["quarantined_at"]) for r in rows] == [(h.keys["d"], None)]


def check_latency_by_platform(rows, h: History):
    (row,) = rows  # only a passed
    assert (row["target"], row["blobs"], row["verifications"]) == ("CPU", 1, 1)
    assert row["device_name"] and 0 < row["best_p50_ms"] <= row["mean_p50_ms"]


def check_failed_somewhere(rows, h: History):
    failed, could_not_run = rows  # newest first
    assert (failed["cache_key"], failed["agent_id"]) == (h.keys["b"], "edge-2")
    assert failed["error"] is None and failed["max_abs_error"] > 0
    assert failed["quarantined_at"] is not None
    assert (could_not_run["agent_id"], could_not_run["cache_key"]) == ("edge-1", h.keys["b"])
    assert "the blob's input takes [2,3,32,32]" in could_not_run["error"]


def check_gc_record(rows, h: History):
    assert [(r["state"], r["blobs"], r["bytes"], r["pulls"]) for r in rows] == [
        ("deleted", 1, h.sizes["c"], 0)
    ]
    assert [blob["cache_key"] for blob in h.gc["blobs"]] == [h.keys["c"]]


def check_compressed(rows, h: History):
    # This history compiles models as they are: none of its blobs may show as compressed
    # (tests/integration/test_compress_farm.py checks the view on compressed blobs).
    assert rows == []


CHECKS = {
    "Blob inventory by target and toolchain": check_inventory,
    "Largest blobs": check_largest,
    "Jobs by state": check_states,
    "Why jobs fail": check_failures,
    "Compile time on the farm versus import time on the edges": check_compile_vs_import,
    "Blobs no edge ever pulled": check_never_pulled,
    "Blobs not pulled for 30 days (what `farm gc --unpulled-days 30` deletes)": (
        check_unpulled_30_days
    ),
    "Queue wait and run time percentiles per target": check_percentiles,
    "Slowest compiles and their memory": check_slowest,
    "Where the farm spends its time": check_phase_summary,
    "Failed imports on the edges": check_failed_imports,
    "Pulls per edge agent": check_pulls_per_agent,
    "Workers and their last heartbeat": check_workers,
    "Jobs and failures per submitter": check_submitters,
    "Blobs never verified on a real device": check_never_verified,
    "Latency by platform": check_latency_by_platform,
    "Blobs that failed somewhere": check_failed_somewhere,
    "What `farm gc` deleted": check_gc_record,
    "Compressed blobs: what they saved and how far they drift": check_compressed,
}


def test_every_readme_query_answers_right_on_a_real_history(history):
    farm, facts = history
    queries = readme_queries()
    assert len(queries) >= 10
    assert set(queries) == set(CHECKS), "a README query without a check, or a check without one"
    with farm.engine.connect() as connection:
        for title, sql in queries.items():
            rows = [dict(row._mapping) for row in connection.execute(text(sql))]
            CHECKS[title](rows, facts)


def test_the_schema_doc_covers_every_table_view_and_column(sqlite_url):
    upgrade_database(sqlite_url)
    engine = make_engine(sqlite_url)
    try:
        inspector = inspect(engine)
        relations = {
            name: [c["name"] for c in inspector.get_columns(name)]
            for name in [*inspector.get_table_names(), *inspector.get_view_names()]
            if name != "alembic_version"
        }
    finally:
        engine.dispose()
    doc = (ROOT / "docs" / "schema.md").read_text()
    sections = dict(re.findall(r"^### `(\w+)`\n(.*?)(?=^### |\Z)", doc, re.M | re.S))
    assert set(sections) == set(relations)
    for name, columns in relations.items():
        documented = re.findall(r"^\| `(\w+)` \|", sections[name], re.M)
        assert documented == columns, f"docs/schema.md, {name}: columns in table order"
