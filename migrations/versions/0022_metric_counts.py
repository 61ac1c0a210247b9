"""Counters kept by the database as rows are written (issue 30, item 6): metric_counts.

`/metrics` and the dashboard's cards used to aggregate whole tables (1.1M jobs, 1M blobs, 5M
pulls: 3.4 s for a cold scrape). Now triggers on jobs, blobs, pulls and verifications append
one delta row per statement and label set to metric_counts, in the transaction that writes the
rows they count, so every writer (API, worker, gc, admin SQL) keeps them right and a rollback
takes its delta with it. A reader sums the rows per label set (a few hundred rows).

Append-only on purpose: an UPDATE of one counter row per label set would make every
transaction that records a pull of the same target queue on that row's lock (and two of them
updating two rows in opposite orders deadlock). Inserts never wait on each other. The rows are
folded (summed into one per label set, in one statement with one snapshot, so a delta
committed meanwhile is neither lost nor counted twice) by `farm_fold_metric_counts()`: the
metrics reader calls it, and on PostgreSQL about one writing statement in 500 does, so the table
stays small when nobody scrapes. On SQLite (one writer at a time) triggers are per row and the
reader folds.

The upgrade fills the counters from the tables (pulls: the rows plus what `farm gc` recorded in
blob_deletions) in the transaction that creates the triggers: the triggers' table locks hold
writers off until both are committed.

Revision ID: 0022
Revises: 0021
Create Date: 2026-11-24 23:30:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0022"
down_revision = "0021"
branch_labels = None
depends_on = None

COMPILE_SECONDS_BUCKETS = (1, 5, 15, 60, 300, 900, 1800, 3600, 3 * 3600)
"""farm.server.api.metrics.COMPILE_SECONDS_BUCKETS when this migration was written: a job's
compile time is counted in the first bucket that holds it (the reader accumulates them)."""

BUCKET = (
    "CASE "
    + " ".join(f"WHEN compile_seconds <= {b} THEN '{float(b)}'" for b in COMPILE_SECONDS_BUCKETS)
    + " ELSE '+Inf' END"
)

ROWS = {
    "jobs": (
        ("state", "target", "queue", "compile_seconds"),
        [
            "SELECT 'jobs', state, target, queue, {s}, 0.0 FROM {t}",
            f"SELECT 'compile_seconds', target, {BUCKET}, '', {{s}}, {{s}} * compile_seconds "
            "FROM {t} WHERE state = 'succeeded' AND compile_seconds IS NOT NULL",
        ],
        ("INSERT", "UPDATE", "DELETE"),
    ),
    "blobs": (
        ("target", "size_bytes", "quarantined_at"),
        [
            "SELECT 'blobs', target, '', '', {s}, {s} * CAST(size_bytes AS DOUBLE PRECISION) "
            "FROM {t}",
            "SELECT 'quarantined', target, '', '', {s}, 0.0 FROM {t} "
            "WHERE quarantined_at IS NOT NULL",
        ],
        ("INSERT", "UPDATE", "DELETE"),
    ),
    "verifications": (
        ("target", "passed"),
        [
            "SELECT 'verifications', target, "
            "CASE WHEN passed THEN 'passed' ELSE 'failed' END, '', {s}, 0.0 FROM {t}"
        ],
        ("INSERT", "UPDATE"),  # never deleted: a counter
    ),
    "pulls": (
        ("blob_id", "ok"),
        [
            "SELECT 'pulls', b.target, CASE WHEN p.ok THEN 'true' ELSE 'false' END, '', {s}, "
            "0.0 FROM {t} p JOIN blobs b ON b.id = p.blob_id"
        ],
        ("INSERT",),  # a counter: gc's deletes of pulls do not take them back
    ),
}
"""Per table: the columns counted, the delta rows of a set of rows {t} with sign {s}, and the
statements that change the counts."""

INSERT = "INSERT INTO metric_counts (family, label1, label2, label3, n, total) "


def deltas(table: str, new: str | None, old: str | None) -> str:
    """One statement appending the net change from rows `old` to rows `new`, per label set."""
    _, templates, _ = ROWS[table]
    parts = [
        template.format(s=sign, t=source)
        for source, sign in ((new, "1"), (old, "-1"))
        if source
        for template in templates
    ]
    return (
        INSERT + "SELECT family, label1, label2, label3, sum(n), sum(total) FROM ("
        "SELECT '' AS family, '' AS label1, '' AS label2, '' AS label3, 0 AS n, 0.0 AS total "
        "WHERE 1 = 0 UNION ALL " + " UNION ALL ".join(parts) + ") d "
        "GROUP BY family, label1, label2, label3 HAVING sum(n) <> 0 OR sum(total) <> 0"
    )


FOLD = """
CREATE FUNCTION farm_fold_metric_counts() RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    -- One fold at a time (another is under way: it does the work); in one statement, so the
    -- rows summed are exactly the rows deleted.
    IF NOT pg_try_advisory_xact_lock(hashtext('farm_fold_metric_counts')) THEN
        RETURN;
    END IF;
    WITH moved AS (DELETE FROM metric_counts RETURNING *)
    INSERT INTO metric_counts (family, label1, label2, label3, n, total)
    SELECT family, label1, label2, label3, sum(n), sum(total) FROM moved
    GROUP BY family, label1, label2, label3 HAVING sum(n) <> 0 OR sum(total) <> 0;
END $$
"""


def _postgresql(table: str) -> None:
    _, _, events = ROWS[table]
    statements = {
        "INSERT": deltas(table, "new_rows", None),
        "UPDATE": deltas(table, "new_rows", "old_rows"),
        "DELETE": deltas(table, None, "old_rows"),
    }
    for event in events:
        name = f"farm_count_{table}_{event.lower()}"
        op.execute(
            f"CREATE FUNCTION {name}() RETURNS trigger LANGUAGE plpgsql AS $$\n"
            f"BEGIN\n    {statements[event]};\n"
            "    IF random() < 0.002 THEN PERFORM farm_fold_metric_counts(); END IF;\n"
            "    RETURN NULL;\nEND $$"
        )
        referencing = {
            "INSERT": "NEW TABLE AS new_rows",
            "UPDATE": "OLD TABLE AS old_rows NEW TABLE AS new_rows",
            "DELETE": "OLD TABLE AS old_rows",
        }[event]
        op.execute(
            f"CREATE TRIGGER {name} AFTER {event} ON {table} REFERENCING {referencing} "
            f"FOR EACH STATEMENT EXECUTE FUNCTION {name}()"
        )


def _sqlite(table: str) -> None:
    columns, _, events = ROWS[table]

    def row(prefix: str) -> str:
        picked = ", ".join(f"{prefix}.{c} AS {c}" for c in columns)
        return f"(SELECT {picked})"

    for event in events:
        new = row("NEW") if event != "DELETE" else None
        old = row("OLD") if event != "INSERT" else None
        when = ""
        if event == "UPDATE":
            when = "WHEN " + " OR ".join(f"OLD.{c} IS NOT NEW.{c}" for c in columns) + " "
        op.execute(
            f"CREATE TRIGGER farm_count_{table}_{event.lower()} AFTER {event} ON {table} "
            f"FOR EACH ROW {when}BEGIN {deltas(table, new, old)}; END"
        )


def upgrade() -> None:
    op.create_table(
        "metric_counts",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            primary_key=True,
            comment="Row id.",
        ),
        sa.Column(
            "family",
            sa.String(32),
            nullable=False,
            comment="'jobs', 'compile_seconds', 'blobs', 'quarantined', 'pulls' or "
            "'verifications'.",
        ),
        sa.Column("label1", sa.Text(), nullable=False, comment="jobs: state; others: target."),
        sa.Column(
            "label2",
            sa.Text(),
            nullable=False,
            comment="jobs: target; compile_seconds: bucket bound ('+Inf' last); pulls: "
            "'true'/'false' (ok); verifications: 'passed'/'failed'; else ''.",
        ),
        sa.Column("label3", sa.Text(), nullable=False, comment="jobs: queue; else ''."),
        sa.Column("n", sa.BigInteger(), nullable=False, comment="Change of the count."),
        sa.Column(
            "total",
            sa.Float(),
            nullable=False,
            comment="Change of the sum: compile seconds, blob bytes; else 0.",
        ),
        comment="Counters behind /metrics and the dashboard's cards: per label set, the sum "
        "of its rows is the count. Appended by triggers on jobs, blobs, pulls and "
        "verifications in the writing transaction; folded (one row per label set) by "
        "farm_fold_metric_counts(). Never edited by hand.",
    )
    dialect = op.get_bind().dialect.name
    if dialect == "postgresql":
        op.execute(FOLD)
    for table in ROWS:
        (_postgresql if dialect == "postgresql" else _sqlite)(table)
    for table in ROWS:
        op.execute(deltas(table, table, None))
    op.execute(
        INSERT + "SELECT 'pulls', target, 'true', '', sum(pulls - failed_pulls), 0.0 "
        "FROM blob_deletions GROUP BY target HAVING sum(pulls - failed_pulls) <> 0"
    )
    op.execute(
        INSERT + "SELECT 'pulls', target, 'false', '', sum(failed_pulls), 0.0 "
        "FROM blob_deletions GROUP BY target HAVING sum(failed_pulls) <> 0"
    )


def downgrade() -> None:
    dialect = op.get_bind().dialect.name
    for table, (_, _, events) in ROWS.items():
        for event in events:
            name = f"farm_count_{table}_{event.lower()}"
            op.execute(f"DROP TRIGGER {name}" + (f" ON {table}" if dialect == "postgresql" else ""))
            if dialect == "postgresql":
                op.execute(f"DROP FUNCTION {name}()")
    if dialect == "postgresql":
        op.execute("DROP FUNCTION farm_fold_metric_counts()")
    op.drop_table("metric_counts")
