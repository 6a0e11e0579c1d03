"""A worker's heartbeat: renews the leases of the jobs in hand and stores its GPUs' snapshot and
why it claims nothing (`paused`, its storage gate's trouble); its answer tells which of those jobs
were canceled or taken from the worker, whose runs then stop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from app import db
from app.queue import attempt as attempt_
from app.queue import manager as manager_
from app.queue import workerconfig

log = logging.getLogger("gpujobs.worker")


class Heartbeat:
    """One worker's heartbeat; it stops the worker's attempts it learns about, never adds or drops one."""

    def __init__(
        self,
        manager: manager_.JobManager,
        config: workerconfig.WorkerConfig,
        *,
        running: Mapping[uuid.UUID, tuple[attempt_.Attempt, asyncio.Task[None]]],
        report: Callable[[], list[dict[str, Any]]],
        paused: Callable[[], str | None],
        stopping: asyncio.Event,
    ) -> None:
        self._manager = manager
        self._config = config
        self._running = running  # the worker's attempts in hand, by job
        self._report = report  # the GPU snapshot to store (GpuBook.report)
        self._paused = paused  # why the worker claims nothing now, None while it claims
        self._stopping = stopping  # set once the worker stops: its state says so
        self._soon = asyncio.Event()

    def soon(self) -> None:
        """Beat now rather than at the interval's end: what the row shows has changed (`paused`)."""
        self._soon.set()

    async def run(self) -> None:
        """Beat every heartbeat interval, or at once when told soon(); a beat the database failed is
        logged and left for the next."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._soon.wait(), self._config.heartbeat_interval_s)
            self._soon.clear()
            try:
                await self.beat()
            except Exception as exc:
                if not db.is_unavailable(exc):
                    raise
                log.warning("heartbeat failed: database unavailable", extra={"action": "db_down"})

    async def beat(self) -> None:
        """Renew leases; stop runs whose job was canceled or taken from us."""
        in_hand = dict(self._running)  # judged only if claimed before the statement ran
        gpus = self._report()
        owned = await self._manager.heartbeat(
            worker_id=self._config.worker_id,
            job_ids=list(in_hand),
            lease_s=self._config.lease_s,
            gpus=gpus,
            state="stopping" if self._stopping.is_set() else "running",
            paused=self._paused(),
        )
        for job_id, (run, _) in in_hand.items():
            mine = owned.get(job_id)
            if mine is None or mine[0] != run.job.attempt:
                run.stop(attempt_.LEASE_LOST)
            elif mine[1]:
                run.stop(attempt_.CANCELED)
