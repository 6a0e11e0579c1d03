"""A worker's upkeep of its warm runners: those idle too long are stopped, idle ones are evicted for
a job that needs their memory, and what closed runners held stays counted until NVML shows it back."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from app import registry, warmpool
from app.queue import planner as planner_
from app.queue.jobs import Job


class WarmKeeper:
    """The upkeep of one worker's warm pool."""

    def __init__(
        self, pool: warmpool.WarmPool, planner: planner_.Planner, models: registry.Registry, idle_s: float
    ) -> None:
        self._pool = pool
        self._planner = planner
        self._models = models
        self._idle_s = idle_s  # a warm runner with no job for this long is stopped

    async def run(self) -> None:
        """Stop warm runners that had no job for warm_idle_s."""
        idle_s = self._idle_s
        while True:
            await asyncio.sleep(max(0.1, min(30.0, idle_s / 2)))
            self.settle(await self._pool.idle_close(idle_s))

    async def make_room(self, job: Job, in_hand: Sequence[planner_.InHand]) -> None:
        """Evict idle warm runners (least recently used first; not the one `job` reuses) if `job`
        needs their memory beside the jobs `in_hand`."""
        need = self._planner.shortfall_mb(job, in_hand)
        if need > 0:
            keep = warmpool.RunnerKey(job.model, job.gpu) if self._models.get(job.model).persistent else None
            self.settle(await self._pool.evict_lru(job.gpu, need, keep=keep))

    def settle(self, closed: list[warmpool.Closed]) -> None:
        """Keep closed runners' memory counted until NVML shows it back."""
        for entry in closed:
            if entry.key.gpu is not None and entry.pid is not None:
                self._planner.settle(entry.key.gpu, entry.hold_mb, {entry.pid}, None)
