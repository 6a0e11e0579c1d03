"""A worker's heartbeat: renews the leases of the jobs in hand and stores its GPUs' snapshot and
why it claims nothing (`paused`, its storage gate's trouble); its answer tells which of those jobs
were canceled or taken from the worker, whose runs then stop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from app import db
from app.queue import attempt as attempt_
from app.queue import manager as manager_
from app.queue import workerconfig

log = logging.getLogger("gpujobs.worker")


class BeatClock:
    """When this worker's row last took a beat (registered, or renewed its leases), by this
    process's steady clock; and whether the database's clock was seen to step forward lately.

    The database's clock times leases (docs/operations.md, "Clocks"). Stepped forward (NTP after
    its host resumed), every lease looked run out at once: reapers took live workers' jobs back
    and their heartbeats refused to renew them. The database's count of the time since a beat,
    beside this count, shows such a step: the heartbeat then renews the leases it alone made run
    out, and this worker's reaper takes nothing back for a lease (`held`). A hold is not taken
    again for a lease after it ends: a clock stepping back and forth for good (two time sources
    fighting over the host) held every reaper for good, and a dead worker's jobs were never taken
    back; now they are, within three leases."""

    def __init__(self, lease_s: float) -> None:
        self._lease_s = lease_s
        self._beat_at: float | None = None
        self._held_until = 0.0
        self._new_until = 0.0  # registered lately: a step before it cannot be seen (registered)

    @property
    def last_beat(self) -> float | None:
        """When the row took its last beat (time.monotonic()), None before its registration."""
        return self._beat_at

    def beat(self, at: float) -> None:
        """The row took a beat in a statement sent at `at` (time.monotonic())."""
        self._beat_at = at

    def registered(self, at: float) -> None:
        """The row was registered in a statement sent at `at`. A step of the database's clock just
        before has no beat of this worker's before it to be seen by, while the leases it made run
        out wait for their workers' next beats to be renewed: a worker that started then took
        them back (killing their runs) as a lost worker's. No lease is judged run out for one lease."""
        self.beat(at)
        self._new_until = time.monotonic() + self._lease_s

    def stepped(self, seconds: float) -> None:
        """The database's clock was seen to step `seconds` forward: hold for a lease from now."""
        now = time.monotonic()
        if seconds <= 0 or self._held_until <= now < self._held_until + self._lease_s:
            return  # none, or a hold ended less than a lease ago
        if now >= self._held_until:  # one warning for a step, not one for each beat
            log.warning(
                "the database's clock stepped forward by %.1f s: leases it shows as run out within "
                "the step are renewed, and no job is taken back for a lease",
                seconds, extra={"action": "db_clock_stepped", "seconds": round(seconds, 1)},
            )  # fmt: skip
            self._held_until = now + self._lease_s

    def held(self) -> bool:
        """Whether a step was seen within the last lease, or the row was registered within it: no
        lease can be judged run out yet."""
        return time.monotonic() < max(self._held_until, self._new_until)


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
        clock: BeatClock,
    ) -> None:
        self._manager = manager
        self._config = config
        self._running = running  # the worker's attempts in hand, by job
        self._report = report  # the GPU snapshot to store (GpuBook.report)
        self._paused = paused  # why the worker claims nothing now, None while it claims
        self._stopping = stopping  # set once the worker stops: its state says so
        self._clock = clock  # when the row took its last beat (shared with the reaper)
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
        answer = await self._manager.heartbeat(
            worker_id=self._config.worker_id,
            job_ids=list(in_hand),
            lease_s=self._config.lease_s,
            gpus=gpus,
            state="stopping" if self._stopping.is_set() else "running",
            paused=self._paused(),
            last_beat=self._clock.last_beat,
        )
        self._clock.beat(answer.sent)
        self._clock.stepped(answer.stepped_s)
        for job_id, (run, _) in in_hand.items():
            mine = answer.owned.get(job_id)
            if mine is None or mine[0] != run.job.attempt:
                run.stop(attempt_.LEASE_LOST)
            elif mine[1]:
                run.stop(attempt_.CANCELED)
