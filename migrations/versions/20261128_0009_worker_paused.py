"""Each worker reports, with every heartbeat, why it claims nothing now.

A worker whose storage folder took no file (a full disk, a folder gone read-only) paused its claims
until a probe passed, but its row said only `running`: `GET /admin/workers`, the admin page and
`live_workers` counted it as serving its models, and only its log said otherwise. `paused` is
why it claims nothing now (storagegate.StorageGate.trouble), NULL while it claims; rows of
workers from before it have NULL.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-28 08:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("workers", sa.Column("paused", sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column("workers", "paused")
