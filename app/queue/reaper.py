"""The reaper of lost jobs and stray processes: a worker's round, on a timer, that takes back the
jobs whose lease expired (first killing what of them still runs on this host), marks silent workers
dead, and kills the processes this worker's runs and runners left behind; and, at the worker's start,
the take-back of what its previous life left."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path

from app import db, storage, subreaper, warm, warmpool
from app.queue import attempt as attempt_
from app.queue import heartbeat, leftovers, records, warmrun, workerconfig
from app.queue import manager as manager_

log = logging.getLogger("gpujobs.worker")


class Reaper:
    """One worker's reaper; it reads the worker's attempts and free lanes, never changes them."""

    def __init__(
        self,
        manager: manager_.JobManager,
        store: storage.ResultStore,
        pool: warmpool.WarmPool,
        config: workerconfig.WorkerConfig,
        *,
        host: str,
        running: Mapping[uuid.UUID, tuple[attempt_.Attempt, asyncio.Task[None]]],
        free_lanes: Sequence[Path],
        wake: Callable[[], None],
        release_lost: Callable[[], Awaitable[None]],
        clock: heartbeat.BeatClock,
    ) -> None:
        self._manager = manager
        self._clock = clock  # when this worker's row took its last beat; a step of the database's clock
        self.database = ""  # the database's identity, set at the worker's start (leftovers.QUEUE)
        self._store = store
        self._pool = pool
        self._config = config
        self._host = host
        self._running = running  # the worker's attempts in hand, by job
        self._free_lanes = free_lanes  # the worker's scratch lanes no job holds
        self._wake = wake  # jobs may be claimable: look for work
        self._release_lost = release_lost  # hands back what a claim that failed may have taken
        self._zombies: set[int] = set()  # this process's zombie children at the last reap round
        self._strays_seen = leftovers.LastLook()  # a reap round looks through /proc only after a change

    async def take_back_own(self) -> None:
        """At the worker's start: kill what its previous life left running on this host, and queue
        again the jobs still running under its name."""
        await self._kill_leftovers(worker_id=self._config.worker_id)
        # Runs of a previous life whose jobs were meanwhile taken back, maybe by another host.
        await leftovers.kill_worker_models(self._config.worker_id, grace_s=self._config.kill_grace_s)
        taken_back = await self._manager.fleet.requeue_own(worker_id=self._config.worker_id)
        for taken in taken_back:
            log.warning(
                "took back a job from this worker's previous run",
                extra={"action": "job_recovered", "job_id": str(taken.id), "state": taken.state},
            )
        await drop_dead_attempts(self._store, taken_back)

    async def run(self) -> None:
        """Reap on a timer (a round the database failed is left for the next)."""
        while True:
            try:
                await self.reap()
            except Exception as exc:
                if not db.is_unavailable(exc):
                    raise
            await asyncio.sleep(self._config.reap_interval_s)

    async def reap(self) -> int:
        """Take back jobs whose lease expired; mark silent workers dead. Returns jobs taken back.

        First, what a lost claim took is handed back: the claim loop, which does so before its next
        claim, may wait longer than a lease (its backoff while the database failed, with nothing
        to wake it), and those jobs' leases are not renewed meanwhile."""
        await self._release_lost()
        if await self._manager.promote_due():
            self._wake()
        await self._age_queued()
        for lane in self._free_lanes:  # at most one round on disk after its job, however idle
            self._store.lanes.drop_input(lane)
        await self._kill_strays()
        # What a worker that is gone left, its processes first (`_left_by`): before its jobs are
        # taken back, so none of them runs again beside what it left running.
        for gone in await asyncio.to_thread(self._store.lanes.sweep, self._left_by):
            log.info(
                "removed the lanes of a worker that is gone",
                extra={"action": "lanes_swept", "worker": self._config.worker_id, "lost_worker": gone},
            )
        if await self._clock_stepped():  # every lease and heartbeat looks older than it is
            return 0
        cleared = await self._kill_leftovers()
        taken = await self._manager.fleet.recover_expired(
            by_worker=self._config.worker_id,
            in_hand=list(self._running),
            host=self._host,
            cleared=cleared,
            lease_s=self._config.lease_s,
        )
        for t in taken:
            log.warning(
                "took back a job whose lease expired",
                extra={
                    "action": "job_recovered",
                    "job_id": str(t.id),
                    "lost_worker": t.worker_id,
                    "state": t.state,
                },
            )
        await drop_dead_attempts(self._store, taken)
        dead_after = max(self._config.lease_s, 3 * self._config.heartbeat_interval_s)
        for worker_id in await self._manager.fleet.mark_dead_workers(dead_after_s=dead_after):
            log.warning("worker stopped heartbeating", extra={"action": "worker_dead", "worker": worker_id})
        return len(taken)

    async def _clock_stepped(self) -> bool:
        """Whether the database's clock stepped forward within the last lease (heartbeat.BeatClock):
        seen by a beat, or now, by this worker's own row looking older than its last beat is."""
        if self._clock.held():
            return True
        beat = self._clock.last_beat
        age_s = await self._manager.fleet.heartbeat_age_s(self._config.worker_id)
        # Counted once the age is read (never less than the database counted), and only if no beat
        # came meanwhile: the age would be the new beat's, the count the old one's.
        if beat is not None and age_s is not None and self._clock.last_beat == beat:
            self._clock.stepped(age_s - (time.monotonic() - beat) - manager_.CLOCK_TOLERANCE_S)
        return self._clock.held()

    def _left_by(self, gone: str) -> None:
        """Remove what a worker that is gone left (in the sweep's thread, holding its lock): its
        processes first, then its runners' temporary folders (their HOME and TMPDIR). A runner
        it started for a job whose pid was not recorded yet (its first half second, or a runner
        still loading) has nothing of the job's to be found by, and ran (or loaded) on beside the
        job's next attempt."""
        leftovers.kill_marked_now(gone)
        self._store.drop_runner_temps(gone)

    async def _age_queued(self) -> None:
        """Raise the age boost of waiting jobs whose next boost is due (a boost lands at most one
        reap round late). Only the jobs due are read (ix_jobs_boost_due): with none due the pass is
        one index probe, however long the queue."""
        config = self._config
        if config.age_max_boost > 0:
            await self._manager.age_queued(step_s=config.age_step_s, max_boost=config.age_max_boost)

    async def _kill_strays(self) -> None:
        """Kill processes this worker's runs and runners started that outlived them (a run's own
        end kills those of a run that failed, or that kept its output pipes open: a daemon a
        run that succeeded left is found here)."""

        def live() -> set[str]:  # asked after the scan: a run that started meanwhile is live
            runs = {f"run {a.job.id}:{a.job.attempt}" for a, _ in self._running.values()}
            runners = (r for r in self._pool.runners() if r.state is not warm.RunnerState.DEAD)
            return runs | {warmrun.origin(r, self._config.worker_id) for r in runners}

        await leftovers.kill_strays(self._config.worker_id, live, last=self._strays_seen)
        # Those that came to the worker after their run's own look (a subreaper: app/subreaper.py),
        # and the zombies of those that ended by themselves (a zombie for a round: asyncio's own last
        # milliseconds).
        await leftovers.kill_adopted(self._config.worker_id, self.live_runs)
        self._zombies = subreaper.reap_zombies(self._zombies)

    def live_runs(self) -> set[str]:
        """The one-shot runs of this worker whose model still runs, named as the reap round names
        runs (`run <job id>:<attempt>`: leftovers.find_marked)."""
        return {f"run {a.job.id}:{a.job.attempt}" for a, _ in self._running.values() if not a.model_ended}

    async def _kill_leftovers(self, *, worker_id: str | None = None) -> list[uuid.UUID]:
        """Kill model processes on this host of jobs about to be taken back, before they are;
        returns the jobs so cleared (only those may be taken back from this host)."""
        cleared = []
        found = await self._manager.fleet.leftovers_on_host(
            host=self._host, worker_id=worker_id, lease_s=self._config.lease_s
        )
        for leftover in found:
            if leftover.worker_id != worker_id and self._clock.held():
                continue  # another worker's lease that may have run out only by a step of the clock
            if leftover.id not in self._running:
                await leftovers.kill_leftover(
                    leftover, host=self._host, grace_s=self._config.kill_grace_s, database=self.database
                )
                cleared.append(leftover.id)
        return cleared


async def drop_dead_attempts(store: storage.ResultStore, taken: list[records.TakenBack]) -> None:
    """Remove the result folders that jobs taken back into a final state (failed, quarantined,
    canceled) have from their lost attempts: a worker killed while storing them left them. A
    job queued again keeps them until it ends."""
    for job in taken:
        if job.state.final:
            await asyncio.to_thread(store.drop_attempts, job.id, upto=job.attempt)
