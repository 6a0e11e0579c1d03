"""Scheduling: scheduled and quarantined states, aging, finer size classes, OOM and death counters;
an index on jobs.input_id for retention.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-21 07:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OLD_STATES = ("queued", "running", "succeeded", "failed", "canceled")
QUEUED = sa.text("state = 'queued'")
RUNNING = sa.text("state = 'running'")
SCHEDULED = sa.text("state = 'scheduled'")
RETAINED = sa.text("expired_at IS NULL AND state IN ('succeeded', 'failed', 'canceled')")


def _vram_class(per_octave: int) -> str:
    return f"GREATEST(0, floor({per_octave} * log(2.0, GREATEST(vram_mb, 1)::numeric / 256)))::smallint"


def _claim_index(priority: str) -> None:
    op.create_index(
        "ix_jobs_claim",
        "jobs",
        ["model", "vram_class", sa.literal_column(priority), "created_at"],
        postgresql_where=QUEUED,
    )


def _state_indexes(create: bool) -> None:
    """The partial indexes whose predicates name states (they pin the enum type)."""
    specs = [
        ("ix_jobs_lease", ["lease_expires_at"], RUNNING),
        ("ix_jobs_worker", ["worker_id"], RUNNING),
        ("ix_jobs_retention", ["finished_at"], RETAINED),
    ]
    for name, columns, where in specs:
        if create:
            op.create_index(name, "jobs", columns, postgresql_where=where)
        else:
            op.drop_index(name, table_name="jobs", postgresql_where=where)


def _vram_class_column(per_octave: int) -> None:
    op.drop_column("jobs", "vram_class")
    op.add_column(
        "jobs",
        sa.Column(
            "vram_class",
            sa.SmallInteger(),
            sa.Computed(_vram_class(per_octave), persisted=True),
            nullable=False,
        ),
    )


def upgrade() -> None:
    # Committed on their own: PostgreSQL refuses a new enum value in the transaction that added it.
    with op.get_context().autocommit_block():
        op.execute("ALTER TYPE job_state ADD VALUE IF NOT EXISTS 'scheduled' AFTER 'queued'")
        op.execute("ALTER TYPE job_state ADD VALUE IF NOT EXISTS 'quarantined'")
    for column in ("declared_vram_mb", "age_boost", "abnormal_runs", "oom_retries"):
        kind = sa.SmallInteger() if column == "age_boost" else sa.Integer()
        op.add_column("jobs", sa.Column(column, kind, server_default="0", nullable=False))
    op.add_column("jobs", sa.Column("vram_peak_mb", sa.Integer(), nullable=True))
    op.execute("UPDATE jobs SET declared_vram_mb = vram_mb")
    op.drop_index("ix_jobs_claim", table_name="jobs", postgresql_where=QUEUED)
    _vram_class_column(8)
    _claim_index("(priority + age_boost) DESC")
    op.create_index("ix_jobs_scheduled", "jobs", ["run_after"], postgresql_where=SCHEDULED)
    op.create_index("ix_jobs_input", "jobs", ["input_id"])


def downgrade() -> None:
    op.drop_index("ix_jobs_input", table_name="jobs")
    op.drop_index("ix_jobs_scheduled", table_name="jobs", postgresql_where=SCHEDULED)
    op.drop_index("ix_jobs_claim", table_name="jobs", postgresql_where=QUEUED)
    _state_indexes(create=False)
    for column in ("oom_retries", "abnormal_runs", "age_boost", "vram_peak_mb", "declared_vram_mb"):
        op.drop_column("jobs", column)
    _vram_class_column(4)
    # PostgreSQL cannot drop enum values: such jobs take the nearest old state, the type is rebuilt.
    op.execute("UPDATE jobs SET state = 'failed' WHERE state = 'quarantined'")
    op.execute("UPDATE jobs SET state = 'queued' WHERE state = 'scheduled'")
    op.execute("ALTER TABLE jobs ALTER COLUMN state DROP DEFAULT")
    op.execute("ALTER TYPE job_state RENAME TO job_state_old")
    op.execute(f"CREATE TYPE job_state AS ENUM {OLD_STATES!r}")
    op.execute("ALTER TABLE jobs ALTER COLUMN state TYPE job_state USING state::text::job_state")
    op.execute("ALTER TABLE jobs ALTER COLUMN state SET DEFAULT 'queued'")
    op.execute("DROP TYPE job_state_old")
    _state_indexes(create=True)
    _claim_index("priority DESC")
