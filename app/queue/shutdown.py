"""A worker's shutdown, the two ways it ends: gracefully (running jobs get the grace period, then
their attempts stop and hand them back) and at once, after stop_now() (everything is cancelled, and
the jobs go back in one statement given a bounded time). Worker._serve says which."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Mapping

from app import storage, warmpool
from app.queue import attempt as attempt_
from app.queue import handback, leftovers, workerconfig
from app.queue import manager as manager_

log = logging.getLogger("gpujobs.worker")


class Shutdown:
    """How one worker winds down its attempts, runners, side tasks and lanes."""

    def __init__(
        self,
        manager: manager_.JobManager,
        store: storage.ResultStore,
        pool: warmpool.WarmPool,
        hand_back: handback.HandBack,
        config: workerconfig.WorkerConfig,
        *,
        running: Mapping[uuid.UUID, tuple[attempt_.Attempt, asyncio.Task[None]]],
    ) -> None:
        self._manager = manager
        self._store = store
        self._pool = pool
        self._hand_back = hand_back
        self._config = config
        self._running = running  # the worker's attempts in hand, by job

    async def graceful(self, side: list[asyncio.Task[None]], *, renewing: bool) -> None:
        """Let running jobs finish for the grace period, hand the rest back, say goodbye.

        No grace when the heartbeat died (not `renewing`): the leases would run out meanwhile, and
        another worker take the jobs back (an attempt spent) while their models still ran here."""
        with contextlib.suppress(Exception):
            await self._manager.fleet.set_worker_state(self._config.worker_id, "stopping")
        if self._running:
            tasks = [t for _, t in self._running.values()]
            await asyncio.wait(tasks, timeout=self._config.shutdown_grace_s if renewing else 0)
            for a, _ in self._running.values():
                a.stop(attempt_.SHUTDOWN)
            await asyncio.gather(*(t for _, t in self._running.values()), return_exceptions=True)
        await self._pool.close_all(attempt_.SHUTDOWN)
        # What the runners (and runs) started in sessions of their own outlives their groups' kill.
        await leftovers.kill_strays(self._config.worker_id, set)
        if self._hand_back.claim_unsure:  # what a lost claim took goes back now, not after its lease
            with contextlib.suppress(Exception):
                await self._hand_back.release_unknown()
        for task in side:
            task.cancel()
        await asyncio.gather(*side, return_exceptions=True)
        self._store.lanes.leave(self._config.worker_id)  # the last inputs are not left on disk
        with contextlib.suppress(Exception):
            await self._manager.fleet.set_worker_state(self._config.worker_id, "stopped")
        log.info("worker stopped", extra={"action": "worker_stopped", "worker": self._config.worker_id})

    async def at_once(self, tasks: list[asyncio.Task[None]], left: list[str]) -> None:
        """After stop_now(): cancel what is left (the attempts' writes included), kill what escaped
        the killed groups, reap the runners, hand the jobs back (given a bounded time:
        HandBack.release_stopped; `left`: the jobs in hand at stop_now()) and empty the lanes."""
        attempts = [t for _, t in self._running.values()]
        for task in (*tasks, *attempts):
            task.cancel()
        # First: an escaped helper may hold a run's pipes.
        await leftovers.kill_strays(self._config.worker_id, set)
        await asyncio.gather(*tasks, *attempts, return_exceptions=True)
        await self._pool.close_all(attempt_.SHUTDOWN)
        # Only now: no old run may overlap a new attempt elsewhere.
        await self._hand_back.release_stopped(left)
        self._store.lanes.leave(self._config.worker_id)
        log.info("worker stopped", extra={"action": "worker_stopped", "worker": self._config.worker_id})
