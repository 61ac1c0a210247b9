"""Indexes for the catalog at production scale, and `compile_vs_import` counting imports.

Measured on a catalog of 1M blobs, 5M pulls and 1.1M jobs (bench/catalog.py; the plans, before
and after, are in bench/README.md): `pulls` had only its primary key, so every per-blob question
(a blob's pull count and last pull for gc, `blob_usage` and the dashboard; the foreign-key check
when gc deletes a blob) read all five million pulls; `worker_status` counted all jobs once per
worker; the job filters by model, submitter and cache key, and the blob list newest first, read
all history to answer one page. Each index below turns one of those into a walk of the rows
the answer needs:

- pulls(blob_id, created_at, ok): a blob's count, last pull and failures from the index alone;
- pulls(created_at) WHERE NOT ok: the README's failed imports, newest first;
- jobs(worker, state): `worker_status`'s counts per worker;
- jobs(cache_key, id), jobs(model_id, id), jobs(submitter, id): `GET /v1/jobs` filters,
  newest first (the cache-key one also serves `farm status KEY` and gc's in-use check);
- models(name): `--model NAME`;
- blobs(created_at, id), blobs(target, created_at, id): pages of the blob list.

`compile_vs_import.imports` counted every successful pull report, including downloads without
an import (`farm pull`, fleet prefetch: ok with no import time). An import is a report with an
import time (`pulls.import_seconds`), so the view now counts those.

Plain CREATE INDEX, in the migration's transaction: on PostgreSQL it blocks writes to the table
while it builds (at the benchmark's scale about a minute for `pulls`; run `farm db upgrade`
in a quiet moment).

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-26 09:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

INDEXES: list[tuple[str, str, list[str], str | None]] = [
    ("ix_pulls_blob_id_created_at_ok", "pulls", ["blob_id", "created_at", "ok"], None),
    ("ix_pulls_failed_created_at", "pulls", ["created_at"], "NOT ok"),
    ("ix_jobs_worker_state", "jobs", ["worker", "state"], None),
    ("ix_jobs_cache_key_id", "jobs", ["cache_key", "id"], None),
    ("ix_jobs_model_id_id", "jobs", ["model_id", "id"], None),
    ("ix_jobs_submitter_id", "jobs", ["submitter", "id"], None),
    ("ix_models_name", "models", ["name"], None),
    ("ix_blobs_created_at_id", "blobs", ["created_at", "id"], None),
    ("ix_blobs_target_created_at_id", "blobs", ["target", "created_at", "id"], None),
]

_COMPILE_VS_IMPORT = """
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
        SELECT blob_id, count({imports}) AS imports, count(import_seconds) AS timed_imports,
               sum(import_seconds) AS import_seconds_sum,
               max(import_seconds) AS import_seconds_max
        FROM pulls
        WHERE ok
        GROUP BY blob_id
    ) p ON p.blob_id = b.id
    GROUP BY m.id, m.name, m.digest, b.target
"""
NEW_VIEW = _COMPILE_VS_IMPORT.format(imports="import_seconds")
OLD_VIEW = _COMPILE_VS_IMPORT.format(imports="*")
NEW_COMMENT = (
    "Per model and target: compile time on the farm versus import time reported by edges "
    "(successful pulls that imported the blob), seconds."
)
OLD_COMMENT = (
    "Per model and target: compile time on the farm versus import time reported by edges "
    "(successful pulls), seconds."
)


def _replace_view(definition: str, comment: str) -> None:
    op.execute("DROP VIEW compile_vs_import")
    op.execute(f"CREATE VIEW compile_vs_import AS {definition}")
    if op.get_bind().dialect.name == "postgresql":
        quoted = comment.replace("'", "''")
        op.execute(f"COMMENT ON VIEW compile_vs_import IS '{quoted}'")


def upgrade() -> None:
    for name, table, columns, where in INDEXES:
        condition = {} if where is None else {"sqlite_where": sa.text(where)}
        if where is not None:
            condition["postgresql_where"] = sa.text(where)
        op.create_index(name, table, columns, **condition)
    _replace_view(NEW_VIEW, NEW_COMMENT)


def downgrade() -> None:
    _replace_view(OLD_VIEW, OLD_COMMENT)
    for name, table, _, _ in reversed(INDEXES):
        op.drop_index(name, table_name=table)
