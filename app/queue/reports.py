"""Reports: the reads of many jobs and workers that metrics, pages, scheduling and learning use."""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from app.queue import records, sql
from app.queue.jobs import classes_up_to, vram_class


class Reports:
    """Counts, histories and snapshots: one statement each (the metrics' event groups: one timed
    transaction)."""

    def __init__(self, engine: AsyncEngine, auto: AsyncEngine) -> None:
        self._engine = engine
        self._auto = auto

    async def events_for_metrics(self, *, after: int, limit: int) -> list[Any]:
        """Events after id `after`, oldest first, with what the metrics need (sql.EVENTS_FOR_METRICS)."""
        values = {"after": after, "limit": limit, "kinds": list(sql.LIFECYCLE_KINDS)}
        async with self._auto.connect() as conn:
            return list((await conn.execute(sql.EVENTS_FOR_METRICS, values)).all())

    async def event_groups_for_metrics(
        self, *, older_than_s: float, final: Iterable[str], bucket_starts: Sequence[float], timeout_s: float
    ) -> tuple[int, list[Any]]:
        """The cut-off id (sql.EVENTS_CUTOFF_FOR_METRICS; 0: no event that old) and the lifecycle
        events up to it counted in groups (sql.EVENT_GROUPS_FOR_METRICS), each within `timeout_s`."""
        async with self._engine.begin() as conn:
            await conn.execute(sql.STATEMENT_TIMEOUT_LOCAL, {"ms": str(round(timeout_s * 1000))})
            cutoff = await conn.scalar(sql.EVENTS_CUTOFF_FOR_METRICS, {"older_than_s": older_than_s})
            if cutoff is None:
                return 0, []
            await conn.execute(sql.SCAN_WHOLE_TABLES)
            values = {
                "upto": cutoff,
                "kinds": list(sql.LIFECYCLE_KINDS),
                "final": sorted(final),
                "bucket_starts": list(bucket_starts),
            }
            return cutoff, list((await conn.execute(sql.EVENT_GROUPS_FOR_METRICS, values)).all())

    async def queue_depth(self) -> list[tuple[str, str, int, int]]:
        """Unfinished jobs counted by (state, model, priority)."""
        async with self._auto.connect() as conn:
            rows = (await conn.execute(sql.QUEUE_DEPTH)).all()
        return [(r.state, r.model, r.priority, r.jobs) for r in rows]

    async def workers(self, *, recent_s: float = 86_400) -> list[records.WorkerInfo]:
        """Workers alive or seen within `recent_s`, with their last GPU snapshot and running jobs."""
        async with self._auto.connect() as conn:
            rows = (await conn.execute(sql.WORKERS, {"recent_s": recent_s})).all()
        return [records.WorkerInfo.from_row(r) for r in rows]

    async def finished_stats(self, *, window_s: float, recent_s: float) -> records.FinishedStats:
        """Counts and wait / run percentiles of the jobs that finished within `window_s`."""
        async with self._auto.connect() as conn:
            row = (await conn.execute(sql.FINISHED_STATS, {"window_s": window_s, "recent_s": recent_s})).one()
        return records.FinishedStats.from_row(row)

    async def waiting_head(
        self, *, models: Sequence[str], budget: int, capacity: int
    ) -> tuple[uuid.UUID, int, int, float] | None:
        """The best queued job over `budget` but within `capacity`: (id, MB, priority, waited s)."""
        if capacity <= budget or not models:
            return None
        classes = [c for c in classes_up_to(capacity) if c >= vram_class(budget + 1)]
        values = {"models": list(models), "classes": classes, "budget": budget, "capacity": capacity}
        async with self._auto.connect() as conn:
            row = (await conn.execute(sql.WAITING_HEAD, values)).first()
        return None if row is None else (row.id, row.vram_mb, row.effective, float(row.waited_s))

    async def run_times(self) -> dict[str, tuple[int, float, float | None, float | None]]:
        """Per model: (samples, mean s, intercept s, s per megapixel) of recent successes."""
        async with self._auto.connect() as conn:
            rows = (await conn.execute(sql.RUN_TIMES)).all()
        return {r.model: (r.samples, float(r.mean_s), r.intercept_s, r.slope_s) for r in rows}

    async def largest_gpus(self, *, buffer_mb: int, recent_s: float = 86_400) -> dict[str, int]:
        """Per model: the most one job may be given on a GPU of the workers that serve it, alive or
        seen within `recent_s` (a model no such worker serves is left out): what each worker's
        heartbeat says its GPU offers (its size less that worker's buffer), or for a worker of an
        earlier version, its size less `buffer_mb`."""
        values = {"recent_s": recent_s, "buffer_mb": buffer_mb}
        async with self._auto.connect() as conn:
            rows = (await conn.execute(sql.LARGEST_GPUS, values)).all()
        return {r.model: max(0, int(r.offered_mb)) for r in rows if r.offered_mb is not None}

    async def vram_ratios(self) -> dict[str, tuple[list[float], int]]:
        """Per model: observed peak ÷ declared estimate of recent successes, and the largest peak."""
        async with self._auto.connect() as conn:
            rows = (await conn.execute(sql.VRAM_RATIOS)).all()
        return {r.model: (list(r.ratios), int(r.max_peak_mb)) for r in rows}
