"""BulkActions: an admin's cancel and retry of every job matching a filter, in batches."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence, Set
from datetime import datetime
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from app.queue import records, sql
from app.queue.jobs import JobState

log = logging.getLogger("gpujobs.queue")


class BulkActions:
    """Cancels and retries of many jobs, each batch a short statement of its own."""

    def __init__(
        self, engine: AsyncEngine, auto: AsyncEngine, *, now: Callable[[], Awaitable[datetime]]
    ) -> None:
        self._engine = engine
        self._auto = auto
        self._now = now  # the database's clock (JobManager.now): "submitted / finished by now"

    async def cancel_matching(
        self,
        *,
        by: str,
        states: Set[JobState],
        model: str | None = None,
        owner: str | None = None,
        batch: int = 1000,
        patience_s: float = 5.0,
    ) -> records.Canceled:
        """Cancel, as JobManager.cancel does, every job in `states` (queued, scheduled, running) of
        `model` and `owner` (None: any) submitted by now, in batches of `batch` (sql.CANCEL_MATCHING)."""
        values = {"by": by, "model": model, "owner": owner, "before": await self._now(), "limit": batch}
        rows: list[Any] = []
        left = 0
        # In the order a job moves through them: one promoted or claimed meanwhile is met again
        # in its next state, when that is asked for too.
        for state in (JobState.scheduled, JobState.queued, JobState.running):
            if state in states:
                taken, held = await self._cancel_batches({**values, "state": state.value}, patience_s)
                rows += taken
                left += held
        stopping = sum(r.state == JobState.running for r in rows)
        waited = [(r.id, r.attempt) for r in rows if r.state == JobState.canceled and r.attempt > 0]
        return records.Canceled(
            canceled=len(rows) - stopping, stopping=stopping, ended_waiting=waited, left=left
        )

    async def _cancel_batches(self, values: Mapping[str, Any], patience_s: float) -> tuple[list[Any], int]:
        """Batches of sql.CANCEL_MATCHING until no job is left, or none could be taken (others held
        them: sql.CANCEL_MATCHING skips them) for `patience_s`; (the rows changed, the jobs left)."""
        rows: list[Any] = []
        deadline = time.monotonic() + patience_s
        while True:
            async with self._auto.connect() as conn:
                taken = (await conn.execute(sql.CANCEL_MATCHING, values)).all()
                full = len(taken) == values["limit"]
                left = full or (await conn.execute(sql.CANCELABLE_LEFT, values)).scalar_one()
            rows += taken
            if not left:
                return rows, 0
            if taken:
                deadline = time.monotonic() + patience_s
            elif time.monotonic() > deadline:
                async with self._auto.connect() as conn:
                    held = (await conn.execute(sql.CANCELABLE_COUNT, values)).scalar_one()
                log.warning(
                    "bulk cancel gave up on %d jobs held by other statements",
                    held,
                    extra={"action": "cancel_matching_held", "state": values["state"]},
                )
                return rows, held
            if not full:
                await asyncio.sleep(0.02)  # the holders are short statements

    async def retry_matching(
        self,
        *,
        by: str,
        attempts: int,
        queue_limit: int,
        model: str | None = None,
        error_contains: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        batch: int = 1000,
    ) -> records.Retried:
        """Queue again, as JobManager.retry does, the failed and quarantined jobs matching the filter that
        finished by now: in batches of at most `batch` (sql.RETRY_BATCH), each at most the room left
        under `queue_limit` jobs waiting, until none is left or the queue is full. A batch counts and
        fills the room under a lock every bulk retry takes (sql.XACT_LOCK)."""
        values = {
            "by": by,
            "attempts": attempts,
            "model": model,
            "error_contains": error_contains,
            "since": since,
            "until": until,
            "before": await self._now(),
        }
        retried = 0
        while True:
            taken, limit, room = await self._retry_batch(values, queue_limit=queue_limit, batch=batch)
            if room <= 0:
                break
            retried += taken
            if taken < limit:  # none left that another statement does not hold
                break
        async with self._auto.connect() as conn:
            left = (await conn.execute(sql.RETRYABLE_LEFT, values)).scalar_one()
        return records.Retried(retried=retried, left=left, queue_full=left > 0 and room <= 0)

    async def _retry_batch(
        self, values: Mapping[str, Any], *, queue_limit: int, batch: int
    ) -> tuple[int, int, int]:
        """One batch of retry_matching: (jobs retried, the most it could take, the room under the limit)."""
        async with self._engine.begin() as conn:  # one batch: its count and its retry, locked
            await conn.execute(sql.XACT_LOCK, {"key": sql.BULK_RETRY_LOCK_KEY})
            waiting = (await conn.execute(sql.WAITING_UP_TO, {"queue_limit": queue_limit})).scalar_one()
            room = queue_limit - waiting
            if room <= 0:
                return 0, 0, room
            limit = min(batch, room)
            taken = len((await conn.execute(sql.RETRY_BATCH, {**values, "limit": limit})).all())
        return taken, limit, room

    async def count_unserved(
        self,
        *,
        known: Sequence[str],
        error_contains: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
    ) -> int:
        """How many failed and quarantined jobs matching the filter are of none of the `known`
        models (sql.RETRYABLE_UNSERVED), which a bulk retry over those models leaves."""
        values = {
            "known": list(known),
            "model": None,
            "error_contains": error_contains,
            "since": since,
            "until": until,
            "before": await self._now(),
        }
        async with self._auto.connect() as conn:
            return int((await conn.execute(sql.RETRYABLE_UNSERVED, values)).scalar_one())
