"""Expiry: retention's statements, which mark finished jobs expired and delete inputs left unused."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime

from sqlalchemy.ext.asyncio import AsyncEngine

from app.queue import records, sql


class Expiry:
    """Which finished jobs retention may expire, and their expiry (the caller deletes their files)."""

    def __init__(self, engine: AsyncEngine, auto: AsyncEngine) -> None:
        self._engine = engine
        self._auto = auto

    async def expirable(self, *, cutoff: datetime, limit: int) -> list[uuid.UUID]:
        """Finished jobs whose files retention would delete (finished before `cutoff`), oldest first."""
        async with self._auto.connect() as conn:
            rows = (await conn.execute(sql.EXPIRABLE, {"cutoff": cutoff, "limit": limit})).all()
        return [r.id for r in rows]

    async def expire(self, *, cutoff: datetime, limit: int) -> records.Expired:
        """Mark up to `limit` jobs that finished before `cutoff` expired; delete inputs left unused."""
        async with self._engine.begin() as conn:
            rows = (await conn.execute(sql.EXPIRE, {"cutoff": cutoff, "limit": limit})).all()
            ids = [r.id for r in rows]
            if ids:  # first, so uploads of these images wait, or are waited for (sql.ENQUEUE)
                await conn.execute(sql.LOCK_INPUTS, {"ids": ids})
            detached = (await conn.execute(sql.DETACH_UNUSED_INPUTS, {"ids": ids})).all() if ids else []
            inputs = [r.input_id for r in detached]
            deleted = (await conn.execute(sql.DELETE_INPUTS, {"ids": inputs})).all() if inputs else []
        return records.Expired(ids, len(deleted), sum(int(r.bytes) for r in deleted))

    async def expired_among(self, job_ids: Sequence[uuid.UUID]) -> set[uuid.UUID]:
        """Which of `job_ids` are expired."""
        async with self._auto.connect() as conn:
            rows = (await conn.execute(sql.EXPIRED_AMONG, {"ids": list(job_ids)})).all()
        return {r.id for r in rows}
