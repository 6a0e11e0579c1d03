"""Aging by due time: a queued job is read by the aging pass only when its next boost is due.

The pass read every queued job before: 53-68 ms beside 100,000 of them with nothing to raise
(PostgreSQL 15 on the 2-core VM), paid by every worker every quarter step; when a bulk of jobs
crossed a step together it rewrote them all in one statement, 2.7 s for 100,000, holding their
row locks until the end. `boost_base_at` is the time the job's current boost counts from (NULL:
its creation; 'infinity' once it has the most), and the index orders queued jobs by it, so the pass
reads only the jobs due and can take them a chunk at a time.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-21 20:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("boost_base_at", sa.TIMESTAMP(timezone=True), nullable=True))
    op.create_index(
        "ix_jobs_boost_due",
        "jobs",
        [sa.text("COALESCE(boost_base_at, created_at)")],
        postgresql_where=sa.text("state = 'queued'"),
    )


def downgrade() -> None:
    op.drop_index("ix_jobs_boost_due", table_name="jobs")
    op.drop_column("jobs", "boost_base_at")
