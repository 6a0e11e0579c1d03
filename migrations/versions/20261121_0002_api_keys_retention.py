"""API keys (hashed), and what retention needs: jobs.expired_at, nullable input_id, an index.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-21 06:55:39.113847
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "api_keys",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("principal", sa.Text(), nullable=False),
        sa.Column("prefix", sa.Text(), nullable=False),
        sa.Column("key_hash", sa.Text(), nullable=False),
        sa.Column("role", sa.Text(), server_default="user", nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint("role IN ('user', 'admin')", name=op.f("ck_api_keys_role")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_keys")),
        sa.UniqueConstraint("key_hash", name=op.f("uq_api_keys_key_hash")),
    )
    op.add_column("jobs", sa.Column("expired_at", sa.DateTime(timezone=True), nullable=True))
    op.alter_column("jobs", "input_id", existing_type=sa.BIGINT(), nullable=True)
    op.create_index(
        "ix_jobs_retention",
        "jobs",
        ["finished_at"],
        unique=False,
        postgresql_where=sa.text("expired_at IS NULL AND state IN ('succeeded', 'failed', 'canceled')"),
    )


def downgrade() -> None:
    op.drop_index(
        "ix_jobs_retention",
        table_name="jobs",
        postgresql_where=sa.text("expired_at IS NULL AND state IN ('succeeded', 'failed', 'canceled')"),
    )
    # The schema before has no job without its image, and retention left expired jobs so (their
    # image and files deleted): those jobs go, with their events (ON DELETE CASCADE).
    op.execute("DELETE FROM jobs WHERE input_id IS NULL")
    op.alter_column("jobs", "input_id", existing_type=sa.BIGINT(), nullable=False)
    op.drop_column("jobs", "expired_at")
    op.drop_table("api_keys")
