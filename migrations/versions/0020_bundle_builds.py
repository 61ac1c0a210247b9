"""Pipeline bundles in the served farm (docs/architecture.md §17): bundle_builds (one row per
bundle key), bundle_parts (one row per part key: a part shared by two bundles compiles once,
single flight with a lease), bundle_build_parts (which parts make which bundle), and the view
bundle_progress (each bundle's parts by state) for the admin queries.

Revision ID: 0020
Revises: 0019
Create Date: 2026-11-24 23:10:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from farm.migrations.checks import sha256_check

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None

STATES = "state IN ('queued', 'running', 'done', 'failed')"
TIME = sa.DateTime(timezone=True)

PROGRESS = """
    SELECT b.bundle_key, b.pipeline, b.target, b.state, count(p.id) AS parts,
           sum(CASE WHEN p.state = 'done' THEN 1 ELSE 0 END) AS parts_done,
           sum(CASE WHEN p.state = 'running' THEN 1 ELSE 0 END) AS parts_running,
           sum(CASE WHEN p.state = 'failed' THEN 1 ELSE 0 END) AS parts_failed,
           b.created_at, b.finished_at
    FROM bundle_builds b
    JOIN bundle_build_parts l ON l.bundle_build_id = b.id
    JOIN bundle_parts p ON p.id = l.part_id
    GROUP BY b.id, b.bundle_key, b.pipeline, b.target, b.state, b.created_at, b.finished_at
"""


def upgrade() -> None:
    op.create_table(
        "bundle_builds",
        sa.Column("id", sa.Integer(), primary_key=True, comment="Row id."),
        sa.Column(
            "bundle_key",
            sa.String(64),
            nullable=False,
            unique=True,
            comment="sha256 of the bundle key document (§17).",
        ),
        sa.Column(
            "pipeline",
            sa.String(16),
            nullable=False,
            comment="'llm', 'vlm', 'whisper' or 'text2image'.",
        ),
        sa.Column(
            "files",
            sa.JSON(),
            nullable=False,
            comment="The folder: sha256 of each file by relative path. Stored at models/<sha256>.",
        ),
        sa.Column(
            "convert_task",
            sa.String(64),
            nullable=True,
            comment="A Hugging Face folder's optimum task (exported by the part first); null: "
            "an OpenVINO pipeline folder.",
        ),
        sa.Column("target", sa.String(64), nullable=False, comment="'CPU' or an NPU platform."),
        sa.Column(
            "options",
            sa.JSON(),
            nullable=False,
            comment="Canonical GenAI options of the key (with 'convert' for a Hugging Face "
            "folder).",
        ),
        sa.Column(
            "toolchain",
            sa.JSON(),
            nullable=False,
            comment="The key's toolchain part: OpenVINO, GenAI and tokenizers releases (CPU: "
            "also the runtime requirements).",
        ),
        sa.Column(
            "memory_bytes",
            sa.BigInteger(),
            nullable=False,
            comment="Estimated compile memory of its largest part, bytes.",
        ),
        sa.Column(
            "state",
            sa.String(16),
            nullable=False,
            comment="'queued', 'running', 'done' or 'failed'.",
        ),
        sa.Column(
            "error",
            sa.Text(),
            nullable=True,
            comment="Why it failed (the failed part's reason); null otherwise.",
        ),
        sa.Column(
            "submitter",
            sa.String(255),
            nullable=True,
            comment="Token name of the last submit that queued it.",
        ),
        sa.Column("created_at", TIME, nullable=False, comment="First submitted, UTC."),
        sa.Column("updated_at", TIME, nullable=False, comment="Last change of state, UTC."),
        sa.Column("finished_at", TIME, nullable=True, comment="Done or failed, UTC."),
        sa.Column(
            "pulled_at",
            TIME,
            nullable=True,
            comment="Last fetch of its signed manifest through the API, UTC (recorded at most "
            "once an hour); what farm gc reads. Null: never fetched.",
        ),
        sha256_check("bundle_key", "ck_bundle_builds_bundle_key_sha256"),
        sa.CheckConstraint(STATES, name=op.f("ck_bundle_builds_state")),
        sa.CheckConstraint(
            "pipeline IN ('llm', 'vlm', 'whisper', 'text2image')",
            name=op.f("ck_bundle_builds_pipeline"),
        ),
        comment="A GenAI pipeline bundle asked of the served farm (docs §17), one row per "
        "bundle key. Inserted 'queued' by the first submit of the key (its folder's files "
        "uploaded as model files); 'running' once a part is claimed; 'done' when the last "
        "of its parts (bundle_build_parts) finished and the signed manifest is published at "
        "bundles/<bundle_key>.json; 'failed' with the failed part's reason, or with farm gc's "
        "when gc removed its manifest. A failed row is queued again by the next submit of "
        "the key. Never deleted.",
    )
    op.create_table(
        "bundle_parts",
        sa.Column("id", sa.Integer(), primary_key=True, comment="Row id."),
        sa.Column(
            "part_key",
            sa.String(64),
            nullable=False,
            unique=True,
            comment="sha256 of the part key document (§17).",
        ),
        sa.Column(
            "name",
            sa.String(64),
            nullable=False,
            comment="'pipeline' (the whole pipeline) or a sub-model's name.",
        ),
        sa.Column(
            "bundle_build_id",
            sa.Integer(),
            sa.ForeignKey("bundle_builds.id"),
            nullable=False,
            comment="The build whose folder, target and options it compiles (the first to "
            "need it).",
        ),
        sa.Column(
            "queue",
            sa.String(255),
            nullable=False,
            comment="The Celery queue it is sent to (toolchain, .large, .with-genai).",
        ),
        sa.Column(
            "memory_bytes",
            sa.BigInteger(),
            nullable=False,
            comment="Estimated compile memory, bytes (what chose its queue).",
        ),
        sa.Column(
            "state",
            sa.String(16),
            nullable=False,
            comment="'queued', 'running', 'done' or 'failed'.",
        ),
        sa.Column(
            "worker",
            sa.String(255),
            nullable=True,
            comment="The worker that runs it (last claimed it).",
        ),
        sa.Column("attempts", sa.Integer(), nullable=False, comment="Claims so far (each counts)."),
        sa.Column(
            "lease_expires_at",
            TIME,
            nullable=True,
            comment="While running: past this, the reconciler queues it again (its worker died).",
        ),
        sa.Column(
            "sent_at",
            TIME,
            nullable=True,
            comment="Its message last handed to the broker, UTC; null: not sent yet.",
        ),
        sa.Column(
            "output_files",
            sa.JSON(),
            nullable=True,
            comment="What it compiled, by path in the bundle: {sha256, size}; stored at "
            "bundle-files/<sha256>. Null until done.",
        ),
        sa.Column(
            "metrics",
            sa.JSON(),
            nullable=True,
            comment="What the compile measured (seconds; the reference run's output).",
        ),
        sa.Column("error", sa.Text(), nullable=True, comment="Why it failed; null otherwise."),
        sa.Column("created_at", TIME, nullable=False, comment="First needed, UTC."),
        sa.Column("started_at", TIME, nullable=True, comment="Last claimed, UTC."),
        sa.Column("finished_at", TIME, nullable=True, comment="Done or failed, UTC."),
        sa.Column("seconds", sa.Float(), nullable=True, comment="Time the compile ran, s."),
        sha256_check("part_key", "ck_bundle_parts_part_key_sha256"),
        sa.CheckConstraint(STATES, name=op.f("ck_bundle_parts_state")),
        sa.CheckConstraint(
            "state <> 'done' OR output_files IS NOT NULL",
            name=op.f("ck_bundle_parts_done_output"),
        ),
        comment="One part of pipeline bundles (the whole pipeline, or one sub-model), "
        "compiled once per part key (docs §17): a part shared by two bundles compiles "
        "once. Inserted 'queued' by the first submit that needs it; 'running' with a worker "
        "and a lease (single flight: a claim is a conditional UPDATE); 'done' with its "
        "output files, or 'failed' with the reason. A running part whose lease expired is "
        "queued again by the reconciler; a failed one by the next submit. Never deleted.",
    )
    op.create_index("ix_bundle_parts_state", "bundle_parts", ["state"])
    op.create_table(
        "bundle_build_parts",
        sa.Column(
            "bundle_build_id",
            sa.Integer(),
            sa.ForeignKey("bundle_builds.id"),
            primary_key=True,
            comment="The bundle.",
        ),
        sa.Column(
            "part_id",
            sa.Integer(),
            sa.ForeignKey("bundle_parts.id"),
            primary_key=True,
            comment="One of its parts.",
        ),
        comment="Which parts make up which bundle (a part may be in several). Inserted "
        "with the build's parts at its first submit; never updated or deleted.",
    )
    op.create_index("ix_bundle_build_parts_part_id", "bundle_build_parts", ["part_id"])
    op.execute(f"CREATE VIEW bundle_progress AS {PROGRESS}")
    if op.get_bind().dialect.name == "postgresql":
        op.execute(
            "COMMENT ON VIEW bundle_progress IS 'Per pipeline bundle: its state and how many of "
            "its parts are done, running and failed.'"
        )


def downgrade() -> None:
    op.execute("DROP VIEW bundle_progress")
    op.drop_index("ix_bundle_build_parts_part_id", table_name="bundle_build_parts")
    op.drop_table("bundle_build_parts")
    op.drop_index("ix_bundle_parts_state", table_name="bundle_parts")
    op.drop_table("bundle_parts")
    op.drop_table("bundle_builds")
