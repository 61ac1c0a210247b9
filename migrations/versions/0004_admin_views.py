"""Admin SQL: views for the common questions, the gc record table, tables that say when rows change.

The views are written twice where PostgreSQL and SQLite differ (time arithmetic, percentiles);
each keeps the same columns, so the README's queries run unchanged on both. Percentiles are
linear interpolation between ranks: `percentile_cont` on PostgreSQL, the same formula spelled
out with window functions on SQLite, so both dialects give the same numbers.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23 09:10:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from farm.migrations.checks import sha256_check

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

TABLE_COMMENTS = {
    "models": (
        "A model submitted to the farm, identified by the digests of its files. "
        "Inserted on first submission; never updated or deleted.",
        "A model submitted to the farm, identified by the digests of its files.",
    ),
    "jobs": (
        "A request to produce the blob of one cache key, and what became of it. "
        "Inserted on submit; state, lease and timing columns change while it runs; "
        "never deleted.",
        "A request to produce the blob of one cache key, and what became of it.",
    ),
    "blobs": (
        "A compiled blob in storage. Inserted once, after its upload is verified; "
        "never updated; deleted only by `farm gc` (recorded in blob_deletions).",
        "A compiled blob in storage. Written once, after its upload is verified.",
    ),
    "pulls": (
        "One edge download and import of a blob, as the edge reported it. "
        "Inserted per report; never updated; deleted with its blob by `farm gc`.",
        "One edge download and import of a blob, as the edge reported it.",
    ),
    "workers": (
        "Compile workers: what each serves, and when it was last seen. "
        "Upserted at worker start; heartbeat_at updated while alive; stopped_at set on a "
        "clean shutdown; never deleted.",
        "Compile workers: what each serves, and when it was last seen.",
    ),
    "api_tokens": (
        "Bearer tokens of the HTTP API. Only their sha256 is stored. Inserted by "
        "`farm token create`; last_used_at updated at most once a minute; revoked_at set "
        "once by `farm token revoke`.",
        "Bearer tokens of the HTTP API. Only their sha256 is stored.",
    ),
}


def _seconds(dialect: str, start: str, end: str) -> str:
    if dialect == "postgresql":
        return f"CAST(EXTRACT(EPOCH FROM ({end} - {start})) AS DOUBLE PRECISION)"
    return f"((julianday({end}) - julianday({start})) * 86400.0)"


def _days_ago(dialect: str, at: str) -> str:
    if dialect == "postgresql":
        return f"CAST(EXTRACT(EPOCH FROM (now() - {at})) AS DOUBLE PRECISION) / 86400.0"
    return f"(julianday('now') - julianday({at}))"


def _sqlite_percentile(p: float, value: str, rank: str, last: str = "m") -> str:
    """percentile_cont(p) over a group whose rows carry their 0-based `rank` and `last` rank."""
    pos = f"({p} * {last})"
    low = f"CAST({pos} AS INTEGER)"
    frac = f"({pos} - {low})"
    return (
        f"sum(CASE WHEN {rank} = {low} THEN {value} * (1 - {frac}) "
        f"WHEN {rank} = {low} + 1 THEN {value} * {frac} ELSE 0 END)"
    )


def _views(dialect: str) -> dict[str, str]:
    pg = dialect == "postgresql"
    json_text = "toolchain ->> '{}'" if pg else "json_extract(toolchain, '$.{}')"
    views = {}
    views["blob_inventory"] = f"""
        SELECT target, openvino_version,
               {json_text.format("npu_compiler")} AS npu_compiler,
               {json_text.format("runtime_requirements")} AS runtime_requirements,
               count(*) AS blobs,
               sum(size_bytes) AS total_bytes,
               sum(CASE WHEN weightless THEN 1 ELSE 0 END) AS weightless_blobs,
               min(created_at) AS first_created_at,
               max(created_at) AS last_created_at
        FROM blobs
        GROUP BY target, openvino_version,
                 {json_text.format("npu_compiler")}, {json_text.format("runtime_requirements")}
    """
    views["job_outcomes"] = """
        SELECT target, state, substr(error, 1, 200) AS reason,
               count(*) AS jobs, min(created_at) AS first_at, max(created_at) AS last_at
        FROM jobs
        GROUP BY target, state, substr(error, 1, 200)
    """
    views["job_durations"] = f"""
        SELECT id AS job_id, target, queue, state, worker, submitter, attempts,
               created_at, started_at, finished_at,
               {_seconds(dialect, "created_at", "started_at")} AS queue_wait_seconds,
               {_seconds(dialect, "started_at", "finished_at")} AS run_seconds,
               compile_seconds, export_seconds, peak_rss_bytes
        FROM jobs
    """
    if pg:
        views["job_time_percentiles"] = """
            SELECT target, count(*) AS jobs,
                   percentile_cont(0.5) WITHIN GROUP (ORDER BY queue_wait_seconds)
                       AS queue_wait_p50,
                   percentile_cont(0.9) WITHIN GROUP (ORDER BY queue_wait_seconds)
                       AS queue_wait_p90,
                   max(queue_wait_seconds) AS queue_wait_max,
                   percentile_cont(0.5) WITHIN GROUP (ORDER BY run_seconds) AS run_p50,
                   percentile_cont(0.9) WITHIN GROUP (ORDER BY run_seconds) AS run_p90,
                   max(run_seconds) AS run_max
            FROM job_durations
            WHERE state = 'succeeded'
            GROUP BY target
        """
    else:
        views["job_time_percentiles"] = f"""
            WITH ranked AS (
                SELECT target, queue_wait_seconds AS w, run_seconds AS r,
                       row_number() OVER (PARTITION BY target ORDER BY queue_wait_seconds) - 1
                           AS wi,
                       row_number() OVER (PARTITION BY target ORDER BY run_seconds) - 1 AS ri,
                       count(*) OVER (PARTITION BY target) - 1 AS m
                FROM job_durations
                WHERE state = 'succeeded'
            )
            SELECT target, max(m) + 1 AS jobs,
                   {_sqlite_percentile(0.5, "w", "wi")} AS queue_wait_p50,
                   {_sqlite_percentile(0.9, "w", "wi")} AS queue_wait_p90,
                   max(w) AS queue_wait_max,
                   {_sqlite_percentile(0.5, "r", "ri")} AS run_p50,
                   {_sqlite_percentile(0.9, "r", "ri")} AS run_p90,
                   max(r) AS run_max
            FROM ranked
            GROUP BY target
        """
    views["blob_usage"] = f"""
        SELECT b.id AS blob_id, b.cache_key, b.target, b.openvino_version,
               m.name AS model_name, m.digest AS model_digest, b.size_bytes, b.created_at,
               coalesce(p.pulls, 0) AS pulls,
               coalesce(p.ok_pulls, 0) AS ok_pulls,
               coalesce(p.pulls, 0) - coalesce(p.ok_pulls, 0) AS failed_pulls,
               p.last_pulled_at,
               {_days_ago(dialect, "coalesce(p.last_pulled_at, b.created_at)")} AS idle_days
        FROM blobs b
        JOIN models m ON m.id = b.model_id
        LEFT JOIN (
            SELECT blob_id, count(*) AS pulls,
                   sum(CASE WHEN ok THEN 1 ELSE 0 END) AS ok_pulls,
                   max(created_at) AS last_pulled_at
            FROM pulls
            GROUP BY blob_id
        ) p ON p.blob_id = b.id
    """
    views["compile_vs_import"] = """
        SELECT m.id AS model_id, m.name AS model_name, m.digest AS model_digest, b.target,
               count(*) AS blobs,
               avg(b.compile_seconds) AS compile_seconds_avg,
               max(b.compile_seconds) AS compile_seconds_max,
               avg(b.export_seconds) AS export_seconds_avg,
               coalesce(sum(p.imports), 0) AS imports,
               sum(p.import_seconds_sum) / nullif(sum(p.timed_imports), 0) AS import_seconds_avg,
               max(p.import_seconds_max) AS import_seconds_max
        FROM blobs b
        JOIN models m ON m.id = b.model_id
        LEFT JOIN (
            SELECT blob_id, count(*) AS imports, count(import_seconds) AS timed_imports,
                   sum(import_seconds) AS import_seconds_sum,
                   max(import_seconds) AS import_seconds_max
            FROM pulls
            WHERE ok
            GROUP BY blob_id
        ) p ON p.blob_id = b.id
        GROUP BY m.id, m.name, m.digest, b.target
    """
    views["worker_status"] = f"""
        SELECT w.name, w.host, w.pid, w.openvino_version, w.memory_bytes, w.queues,
               w.started_at, w.heartbeat_at, w.stopped_at,
               CASE WHEN w.stopped_at IS NULL THEN 'running' ELSE 'stopped' END AS status,
               {_seconds(dialect, "w.heartbeat_at", "now()" if pg else "'now'")}
                   AS seconds_since_heartbeat,
               (SELECT count(*) FROM jobs j WHERE j.worker = w.name AND j.state = 'running')
                   AS running_jobs,
               (SELECT count(*) FROM jobs j WHERE j.worker = w.name AND j.state = 'succeeded')
                   AS succeeded_jobs
        FROM workers w
    """
    return views


VIEW_COMMENTS = {
    "blob_inventory": "Blobs and bytes by target and toolchain.",
    "job_outcomes": "Jobs by target, state and failure reason (first 200 characters of error).",
    "job_durations": "Per job: queue wait (created → last claim) and run time (claim → end), "
    "seconds.",
    "job_time_percentiles": "Per target, succeeded jobs: p50/p90/max of queue wait and run "
    "time, seconds (linear interpolation).",
    "blob_usage": "Per blob: pulls, failed pulls, last pull, and idle_days since the last pull "
    "(or since it was recorded, if never pulled).",
    "compile_vs_import": "Per model and target: compile time on the farm versus import time "
    "reported by edges (successful pulls), seconds.",
    "worker_status": "Workers with seconds since their last heartbeat and their running jobs.",
}
# job_time_percentiles reads job_durations: create in this order, drop in reverse.
VIEW_ORDER = list(VIEW_COMMENTS)


def upgrade() -> None:
    dialect = op.get_bind().dialect.name
    op.create_table(
        "blob_deletions",
        sa.Column("id", sa.Integer(), nullable=False, comment="Row id."),
        sa.Column(
            "cache_key",
            sa.String(length=64),
            nullable=False,
            comment="Cache key of the deleted blob.",
        ),
        sa.Column("storage_key", sa.Text(), nullable=False, comment="Its object key in storage."),
        sa.Column("target", sa.String(length=16), nullable=False, comment="Its target."),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False, comment="Its size, bytes."),
        sa.Column(
            "sha256", sa.String(length=64), nullable=False, comment="sha256 of the stored file."
        ),
        sa.Column(
            "blob_created_at",
            sa.DateTime(timezone=True),
            nullable=False,
            comment="When the blob was recorded, UTC.",
        ),
        sa.Column(
            "pulls",
            sa.Integer(),
            nullable=False,
            comment="Pull reports deleted with it (keeps pull counts monotonic).",
        ),
        sa.Column(
            "failed_pulls",
            sa.Integer(),
            nullable=False,
            comment="Of those, reports of a failed import.",
        ),
        sa.Column(
            "last_pulled_at",
            sa.DateTime(timezone=True),
            nullable=True,
            comment="Its last pull report, UTC; null if never pulled.",
        ),
        sa.Column("reason", sa.Text(), nullable=False, comment="Why: 'unpulled for 30 days'."),
        sa.Column(
            "deleted_at",
            sa.DateTime(timezone=True),
            nullable=False,
            comment="Blob row deleted, UTC.",
        ),
        sa.Column(
            "state",
            sa.String(length=16),
            nullable=False,
            comment="'pending': the object is still in storage and the next `farm gc` deletes "
            "it; 'deleted': gone from storage; 'kept': the cache key was in use again, object "
            "kept.",
        ),
        sa.Column(
            "object_deleted_at",
            sa.DateTime(timezone=True),
            nullable=True,
            comment="When the object was deleted from storage (or kept), UTC; null while pending.",
        ),
        sha256_check("cache_key", "ck_blob_deletions_cache_key_sha256"),
        sha256_check("sha256", "ck_blob_deletions_sha256_sha256"),
        sa.CheckConstraint(
            "state IN ('pending', 'deleted', 'kept')", name=op.f("ck_blob_deletions_state")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_blob_deletions")),
        comment="What `farm gc` removed: one row per blob row it deleted, kept as a record. "
        "Inserted in the transaction that deletes the blob row; state changes once, when "
        "its object is deleted from storage (or kept because the cache key is in use again).",
    )
    if dialect == "postgresql":  # SQLite keeps no comments
        for table, (comment, old) in TABLE_COMMENTS.items():
            op.create_table_comment(table, comment, existing_comment=old)
    views = _views(dialect)
    for name in VIEW_ORDER:
        op.execute(f"CREATE VIEW {name} AS {views[name]}")
        if dialect == "postgresql":
            quoted = VIEW_COMMENTS[name].replace("'", "''")
            op.execute(f"COMMENT ON VIEW {name} IS '{quoted}'")


def downgrade() -> None:
    for name in reversed(VIEW_ORDER):
        op.execute(f"DROP VIEW {name}")
    if op.get_bind().dialect.name == "postgresql":
        for table, (comment, old) in TABLE_COMMENTS.items():
            op.create_table_comment(table, old, existing_comment=comment)
    op.drop_table("blob_deletions")
