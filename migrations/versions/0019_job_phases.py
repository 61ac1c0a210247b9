"""Where a job's time goes: job_phases, one row per phase of an attempt (fetch, convert,
compress, compile, reference, upload, record), and the view job_phase_summary (per target and
phase: attempts, total, mean and longest seconds) for the admin queries.

Revision ID: 0019
Revises: 0018
Create Date: 2026-11-24 21:45:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None

SUMMARY = """
    SELECT j.target, p.phase, count(*) AS attempts, sum(p.seconds) AS total_seconds,
           avg(p.seconds) AS mean_seconds, max(p.seconds) AS max_seconds
    FROM job_phases p JOIN jobs j ON j.id = p.job_id
    GROUP BY j.target, p.phase
"""


def upgrade() -> None:
    op.create_table(
        "job_phases",
        sa.Column("id", sa.Integer(), primary_key=True, comment="Row id."),
        sa.Column(
            "job_id", sa.Integer(), sa.ForeignKey("jobs.id"), nullable=False, comment="The job."
        ),
        sa.Column(
            "attempt", sa.Integer(), nullable=False, comment="Its attempt (jobs.attempts then)."
        ),
        sa.Column(
            "phase",
            sa.String(16),
            nullable=False,
            comment="'fetch', 'convert', 'compress', 'compile', 'reference', 'upload' or 'record'.",
        ),
        sa.Column(
            "started_at",
            sa.DateTime(timezone=True),
            nullable=False,
            comment="When the phase began, UTC.",
        ),
        sa.Column("seconds", sa.Float(), nullable=False, comment="How long it took, s."),
        sa.CheckConstraint("seconds >= 0", name=op.f("ck_job_phases_seconds_counted")),
        comment="Where a job's time went: one row per phase of an attempt (fetch, convert, "
        "compress, compile, reference, upload, record), timed by the worker. Inserted when the "
        "attempt ends; never updated or deleted.",
    )
    op.create_index("ix_job_phases_job_id_attempt", "job_phases", ["job_id", "attempt"])
    op.execute(f"CREATE VIEW job_phase_summary AS {SUMMARY}")
    if op.get_bind().dialect.name == "postgresql":
        op.execute(
            "COMMENT ON VIEW job_phase_summary IS 'Per target and phase: attempts timed, total, "
            "mean and longest seconds (where the farm spends its time).'"
        )


def downgrade() -> None:
    op.execute("DROP VIEW job_phase_summary")
    op.drop_index("ix_job_phases_job_id_attempt", table_name="job_phases")
    op.drop_table("job_phases")
