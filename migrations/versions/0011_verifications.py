"""The fleet as a test lab: reference outputs beside each blob, edges' verifications, quarantine.

- blobs: the reference file (digest, size, signature binding it to the blob, or why there is
  none) and the quarantine (when, why). A blob is quarantined by a failed verification or by an
  admin; edges refuse it until an admin releases it.
- blob_deletions.reference_storage_key: the reference object `farm gc` deletes with the blob's.
- jobs.reference_inputs: the sha256 of inputs the submitter gave (`farm submit --inputs`),
  stored with the model's files.
- verifications: one edge's run of a blob against its reference: errors, latency, device.
  Kept when the blob is deleted (blob_id set null), so the history outlives a rebuild.
- views blob_verifications, blob_device_verifications and device_latency, for the README's
  admin queries.

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-24 06:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from farm.migrations.checks import sha256_check

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

OLD_BLOBS_COMMENT = (
    "A compiled blob in storage. Inserted once, after its upload is verified; only its "
    "signature columns are updated, by `farm keys resign`; deleted only by `farm gc` "
    "(recorded in blob_deletions)."
)
NEW_BLOBS_COMMENT = (
    "A compiled blob in storage. Inserted once, after its upload is verified; only its "
    "signature columns are updated, by `farm keys resign`, and its quarantine, by a failed "
    "verification or an admin; deleted by `farm gc` or a rebuild (recorded in blob_deletions)."
)

VIEWS = {
    "blob_verifications": (
        "Per blob: how many verifications and devices, passed and failed, the worst errors, "
        "and its quarantine.",
        """
        SELECT b.cache_key, b.target, b.quarantined_at,
               count(v.id) AS verifications,
               count(DISTINCT v.device_name) AS devices,
               sum(CASE WHEN v.passed THEN 1 ELSE 0 END) AS passed,
               sum(CASE WHEN NOT v.passed THEN 1 ELSE 0 END) AS failed,
               max(v.max_abs_error) AS worst_max_abs_error,
               min(v.min_cosine) AS worst_cosine,
               max(v.created_at) AS last_verified_at
        FROM blobs b LEFT JOIN verifications v ON v.blob_id = b.id
        GROUP BY b.id, b.cache_key, b.target, b.quarantined_at
        """,
    ),
    "blob_device_verifications": (
        "Per blob and device (its full name): verifications, passed and failed, the worst "
        "error, and the mean and best p50 latency, milliseconds.",
        """
        SELECT cache_key, target, device_name,
               count(*) AS verifications,
               sum(CASE WHEN passed THEN 1 ELSE 0 END) AS passed,
               sum(CASE WHEN passed THEN 0 ELSE 1 END) AS failed,
               max(max_abs_error) AS worst_max_abs_error,
               avg(latency_p50_ms) AS mean_p50_ms,
               min(latency_p50_ms) AS best_p50_ms,
               max(created_at) AS last_verified_at
        FROM verifications
        GROUP BY cache_key, target, device_name
        """,
    ),
    "device_latency": (
        "Per target and device (its full name): blobs verified on it, and the mean, best "
        "and worst of their p50 latencies, milliseconds (passed verifications).",
        """
        SELECT target, device_name,
               count(DISTINCT cache_key) AS blobs,
               count(*) AS verifications,
               avg(latency_p50_ms) AS mean_p50_ms,
               min(latency_p50_ms) AS best_p50_ms,
               max(latency_p50_ms) AS worst_p50_ms
        FROM verifications
        WHERE passed
        GROUP BY target, device_name
        """,
    ),
}


def upgrade() -> None:
    dialect = op.get_bind().dialect.name
    # Plain ALTER TABLE ... ADD COLUMN: SQLite's batch mode would rebuild tables that views
    # read. The new CHECK constraints are PostgreSQL's only (SQLite adds none to a table).
    table = _Table("blobs")
    table.add_column(
        sa.Column(
            "reference_sha256",
            sa.String(64),
            nullable=True,
            comment="sha256 of the reference file (inputs and CPU f32 outputs, .npz); null: "
            "none (see reference_note).",
        )
    )
    table.add_column(
        sa.Column(
            "reference_size_bytes", sa.BigInteger(), nullable=True, comment="Its size, bytes."
        )
    )
    table.add_column(
        sa.Column(
            "reference_signature",
            sa.Text(),
            nullable=True,
            comment="Ed25519 signature (base64) by signing_key_id binding the reference file "
            "to the blob (farm/core/signing.py reference_message).",
        )
    )
    table.add_column(
        sa.Column(
            "reference_note",
            sa.Text(),
            nullable=True,
            comment="Why the blob has no reference outputs (too big for the worker's memory "
            "budget, dynamic shapes, ...).",
        )
    )
    table.add_column(
        sa.Column(
            "quarantined_at",
            sa.DateTime(timezone=True),
            nullable=True,
            comment="When it was quarantined (edges refuse it); null: not quarantined.",
        )
    )
    table.add_column(
        sa.Column(
            "quarantine_reason",
            sa.Text(),
            nullable=True,
            comment="Why: the failed verification (its id, device, errors) or the admin.",
        )
    )
    table.check(
        "ck_blobs_reference_recorded_whole",
        "(reference_sha256 IS NULL) = (reference_size_bytes IS NULL)",
    )
    table.check(
        "ck_blobs_quarantine_has_reason",
        "(quarantined_at IS NULL) = (quarantine_reason IS NULL)",
    )
    table.sha256("reference_sha256")
    op.add_column(
        "blob_deletions",
        sa.Column(
            "reference_storage_key",
            sa.Text(),
            nullable=True,
            comment="Object key of its reference outputs, deleted with it; null: none.",
        ),
    )
    table = _Table("jobs")
    table.add_column(
        sa.Column(
            "reference_inputs",
            sa.String(64),
            nullable=True,
            comment="sha256 of the submitter's reference inputs (.npz, stored with model "
            "files); null: inputs seeded from the cache key.",
        )
    )
    table.sha256("reference_inputs")
    op.create_table(
        "verifications",
        sa.Column("id", sa.Integer(), nullable=False, comment="Row id."),
        sa.Column(
            "blob_id",
            sa.Integer(),
            sa.ForeignKey("blobs.id", ondelete="SET NULL"),
            nullable=True,
            comment="The blob verified; null once it was deleted (history stays).",
        ),
        sa.Column("cache_key", sa.String(64), nullable=False, comment="Its cache key."),
        sa.Column(
            "blob_sha256", sa.String(64), nullable=False, comment="sha256 of the bytes verified."
        ),
        sa.Column("target", sa.String(16), nullable=False, comment="The blob's target."),
        sa.Column("agent_id", sa.Text(), nullable=False, comment="The edge agent that ran it."),
        sa.Column(
            "device_name",
            sa.Text(),
            nullable=False,
            comment="The device's full name (OpenVINO FULL_DEVICE_NAME).",
        ),
        sa.Column(
            "openvino_version", sa.String(64), nullable=False, comment="The edge's OpenVINO."
        ),
        sa.Column(
            "driver_version",
            sa.Text(),
            nullable=True,
            comment="The NPU driver version (NPU_DRIVER_VERSION); null on CPU.",
        ),
        sa.Column("passed", sa.Boolean(), nullable=False, comment="Every output within tolerance."),
        sa.Column(
            "max_abs_error", sa.Float(), nullable=True, comment="Worst absolute error, any output."
        ),
        sa.Column(
            "mean_abs_error", sa.Float(), nullable=True, comment="Worst mean absolute error."
        ),
        sa.Column("min_cosine", sa.Float(), nullable=True, comment="Lowest cosine similarity."),
        sa.Column(
            "tolerance", sa.JSON(), nullable=False, comment="{atol, rtol, min_cosine} applied."
        ),
        sa.Column("outputs", sa.JSON(), nullable=False, comment="Per output: name and figures."),
        sa.Column("runs", sa.Integer(), nullable=False, comment="Timed inferences."),
        sa.Column("latency_p50_ms", sa.Float(), nullable=True, comment="Median latency, ms."),
        sa.Column("latency_p90_ms", sa.Float(), nullable=True, comment="p90 latency, ms."),
        sa.Column("latency_min_ms", sa.Float(), nullable=True, comment="Best latency, ms."),
        sa.Column("import_seconds", sa.Float(), nullable=True, comment="import_model time, s."),
        sa.Column(
            "peak_rss_bytes",
            sa.BigInteger(),
            nullable=True,
            comment="The edge process's peak resident memory during the verification.",
        ),
        sa.Column(
            "error",
            sa.Text(),
            nullable=True,
            comment="Why it could not run (import or inference failed); null when it ran.",
        ),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, comment="Reported."),
        sa.PrimaryKeyConstraint("id"),
        sha256_check("cache_key", "ck_verifications_cache_key_sha256"),
        sha256_check("blob_sha256", "ck_verifications_blob_sha256_sha256"),
        sa.CheckConstraint("runs >= 0", name=op.f("ck_verifications_runs_counted")),
        sa.CheckConstraint(
            "error IS NULL OR NOT passed", name=op.f("ck_verifications_error_fails")
        ),
        comment="One edge's run of a blob against its reference outputs. Inserted per report; "
        "never updated; blob_id set null when the blob is deleted.",
    )
    op.create_index("ix_verifications_blob_id", "verifications", ["blob_id"])
    op.create_index("ix_verifications_cache_key_id", "verifications", ["cache_key", "id"])
    op.create_index("ix_verifications_target_device", "verifications", ["target", "device_name"])
    for name, (comment, sql) in VIEWS.items():
        op.execute(f"CREATE VIEW {name} AS {sql}")
        if dialect == "postgresql":
            op.execute(f"COMMENT ON VIEW {name} IS '{comment}'")
    if dialect == "postgresql":
        op.create_table_comment("blobs", NEW_BLOBS_COMMENT, existing_comment=OLD_BLOBS_COMMENT)


class _Table:
    """Columns added with plain ALTER TABLE; CHECK constraints on PostgreSQL only."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.postgresql = op.get_bind().dialect.name == "postgresql"

    def add_column(self, column: sa.Column) -> None:
        op.add_column(self.name, column)

    def check(self, name: str, condition: str) -> None:
        if self.postgresql:
            op.create_check_constraint(op.f(name), self.name, condition)

    def sha256(self, column: str) -> None:
        self.check(f"ck_{self.name}_{column}_sha256", f"{column} ~ '^[0-9a-f]{{64}}$'")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.create_table_comment("blobs", OLD_BLOBS_COMMENT, existing_comment=NEW_BLOBS_COMMENT)
    for name in reversed(VIEWS):
        op.execute(f"DROP VIEW {name}")
    op.drop_table("verifications")
    op.drop_column("jobs", "reference_inputs")  # drops its constraints with it
    op.drop_column("blob_deletions", "reference_storage_key")
    for column in (
        "quarantine_reason",
        "quarantined_at",
        "reference_note",
        "reference_signature",
        "reference_size_bytes",
        "reference_sha256",
    ):
        op.drop_column("blobs", column)
