"""Each job with an idempotency key records its request as the client sent it.

A repeat of a request with its Idempotency-Key was compared with the job by its params with the
model's defaults filled in, so after a restart that changed a default the very same request was
409, and after the model was removed, or its params checked more strictly, 422. `request_sha256`
is the SHA-256 of the request as sent (intake.fingerprint); jobs queued before it have NULL and
are compared as before.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-27 08:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("request_sha256", sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column("jobs", "request_sha256")
