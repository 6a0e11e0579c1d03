"""Uploads: images stored uncompressed; an index of each owner's waiting jobs.

`inputs.data` holds PNG, JPEG and WebP files, already compressed: PostgreSQL's default storage
tried to compress each one again (pglz), which took a third of the machine's CPU during the upload
benchmark and saved nothing. EXTERNAL keeps them out of line, uncompressed. Rows written before
this migration stay as they are.

The per-owner queue limit counts the owner's queued and scheduled jobs on every upload; the
index keeps that count off the owner's finished jobs.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-21 10:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.execute("ALTER TABLE inputs ALTER COLUMN data SET STORAGE EXTERNAL")
    op.create_index(
        "ix_jobs_owner_waiting",
        "jobs",
        ["owner", "state"],
        postgresql_where=sa.text("state IN ('queued', 'scheduled')"),
    )


def downgrade() -> None:
    op.drop_index("ix_jobs_owner_waiting", table_name="jobs")
    op.execute("ALTER TABLE inputs ALTER COLUMN data SET STORAGE EXTENDED")
