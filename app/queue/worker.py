"""Worker: owns this host's GPUs, claims jobs that fit, runs them, keeps their leases alive.

Side tasks, each named: the heartbeat (renews leases of the jobs in hand, learns of cancels and
lost leases), the reaper (takes back jobs whose worker stopped heartbeating), and the listener
(LISTEN for new jobs and cancels; a slow poll covers a lost connection). If a side task dies, the
worker stops. On `stop()` it claims nothing more, lets running jobs finish for the grace period,
then hands the rest back to the queue without spending an attempt.

Worker keeps the lifecycle and the claim loop; its parts are modules beside it, each given what it
reads of the worker: heartbeat, reaper, listener, shutdown, handback (jobs given back unspent),
gpubook (GPU accounting), gpuslots (claims ahead), storagegate and warmkeeper.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any

from app import childprocess, db, errors, gpu, logs, registry, storage, subreaper, warmpool
from app.queue import attempt as attempt_
from app.queue import (
    gpubook,
    gpuslots,
    handback,
    leftovers,
    listener,
    reaper,
    shutdown,
    site,
    storagegate,
    warmkeeper,
    workerconfig,
)
from app.queue import heartbeat as heartbeat_
from app.queue import manager as manager_
from app.queue import planner as planner_
from app.queue.jobs import Job

log = logging.getLogger("gpujobs.worker")

# How much longer than the claim gather a success waits for the claim to carry it (the claim may
# be behind another statement); past that it is written on its own.
CARRY_MARGIN_S = 0.005


class Worker:
    """One per host. `await run()` until `stop()` (or, in burst mode, until the queue is drained)."""

    def __init__(
        self,
        *,
        manager: manager_.JobManager,
        store: storage.ResultStore,
        models: registry.Registry,
        inventory: gpu.GpuInventory,
        config: workerconfig.WorkerConfig,
        listen_dsn: str | None = None,
        side_tasks: Mapping[str, Callable[[], Coroutine[Any, Any, None]]] | None = None,
    ) -> None:
        self._manager = manager
        self._side_tasks = dict(side_tasks or {})  # more named side tasks (retention), watched alike
        self._store = store
        self._models = models
        self._inventory = inventory
        self._config = config
        self.host = socket.gethostname()
        self.pool = warmpool.WarmPool(
            kill_grace_s=config.kill_grace_s, paced=config.warm_paced, max_log_bytes=config.max_log_bytes
        )
        self.planner = planner_.Planner(manager, inventory, models, config.scheduling, self.pool)
        self._running: dict[uuid.UUID, tuple[attempt_.Attempt, asyncio.Task[None]]] = {}
        self._free_lanes: list[Path] = []
        self._lanes_made = 0
        self._wake = asyncio.Event()
        self._stopping = asyncio.Event()
        self._left: list[str] | None = None  # the jobs in hand when stop_now() was called, if it was
        self._serving: asyncio.Task[None] | None = None  # run()'s work, which stop_now() cancels
        self.claimed = 0
        self._started = False
        self._identity: socket.socket | None = None  # holds this worker's id on the host (leftovers)
        self._compose(listen_dsn)
        self._site = site.Site(  # what each of its attempts is given
            manager, store, config.attempt_config(), inventory, self.pool, self._model_ended,
            self._storage.failed, self.reaper.live_runs,
        )  # fmt: skip

    def _compose(self, listen_dsn: str | None) -> None:
        """The worker's parts, each given what it reads of the worker (its attempts in hand, its
        wake-up, its stopping flag), not the worker itself."""
        config, manager, store, running = self._config, self._manager, self._store, self._running
        self._gpus = gpubook.GpuBook(
            self._inventory, self.planner, self.pool, config.scheduling.vram_buffer_mb
        )
        self._slots = gpuslots.GpuSlots(config.scheduling.max_jobs_per_gpu, config.claim_ahead_s)
        self._warm = warmkeeper.WarmKeeper(self.pool, self.planner, self._models, config.warm_idle_s)
        self._storage = storagegate.StorageGate(
            store, config.worker_id, config.poll_interval_s, running, changed=lambda: self._heartbeat.soon()
        )
        self._hand_back = handback.HandBack(manager, store, config.worker_id, running)
        self._listener = listener.Listener(listen_dsn, config, wake=self._wake.set, running=running)
        self._clock = heartbeat_.BeatClock(config.lease_s)
        self._heartbeat = heartbeat_.Heartbeat(
            manager,
            config,
            running=running,
            report=lambda: self._gpus.report(self.in_hand()),
            paused=lambda: self._storage.trouble,
            stopping=self._stopping,
            clock=self._clock,
        )
        self.reaper = reaper.Reaper(
            manager,
            store,
            self.pool,
            config,
            host=self.host,
            running=running,
            free_lanes=self._free_lanes,
            wake=self._wake.set,
            release_lost=self._hand_back.release_lost_claim,
            clock=self._clock,
        )
        self._shutdown = shutdown.Shutdown(
            manager, store, self.pool, self._hand_back, config, running=running
        )

    @property
    def id(self) -> str:
        """This worker's stable identity (host and name)."""
        return self._config.worker_id

    def stop(self) -> None:
        """Stop claiming; `run()` then winds down running jobs and returns."""
        self._stopping.set()
        self._wake.set()

    @property
    def stopped_now(self) -> bool:
        """Whether stop_now() was called: nothing more is written but its jobs' hand-back."""
        return self._left is not None

    def stop_now(self) -> None:
        """Stop at once (an operator who asks again while the worker stops): every model and warm
        runner is killed now (SIGKILL to its process group), and the attempts write nothing more
        (their outcomes, a final write under way included, are dropped). Once the models are dead,
        the jobs running under this worker's name go back to the queue in one statement, no attempt
        spent, if the database answers within handback.STOP_NOW_HAND_BACK_S; else they are left
        running under its name: its restart takes them back at once, another worker's reaper once
        their leases run out (an attempt spent, as for a crashed worker). `run()` returns within
        moments, whatever the database does (the graceful stop waits for it to write what each job
        became)."""
        if self._left is not None:
            return
        self._left = left = sorted(str(job_id) for job_id in self._running)
        self.stop()
        for run, _ in self._running.values():
            run.abandon()
        runners = self.pool.kill_all()
        log.warning(
            "stopped at once, its models and warm runners (%d) killed; its %d jobs go back to the queue, "
            "no attempt spent, if the database answers within %g s: %s",
            runners,
            len(left),
            handback.STOP_NOW_HAND_BACK_S,
            ", ".join(left) or "none",
            extra={"action": "worker_stopped_now", "worker": self.id},
        )
        if self._serving is not None:
            self._serving.cancel()

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Hold this worker's id on the host, check its GPUs, register, and take back what a
        previous life left. ConfigError if it cannot run here: another live worker has its id, or
        no GPU can run any model. `run()` calls it when it was not called before."""
        childprocess.prefer_pidfd_watcher()
        subreaper.become()  # what escapes a run comes to the worker as the run ends
        logs.bind(worker=self.id)
        self._identity = leftovers.hold_identity(self.id)  # before _start takes what the id left
        try:
            await self._start()
        except BaseException:
            self._let_go_of_identity()
            raise
        self._started = True

    async def run(self) -> None:
        """Start up (unless `start()` did), claim and run jobs until stopped, then shut down (at
        once after `stop_now()`)."""
        if not self._started:
            await self.start()
        self._serving = serving = asyncio.create_task(self._serve(), name=f"serve:{self.id}")
        try:
            await asyncio.wait([serving])
        except asyncio.CancelledError:  # run() itself was cancelled: so is its work
            serving.cancel()
            await asyncio.wait([serving])
            raise
        finally:
            self._let_go_of_identity()
        if not (serving.cancelled() and self.stopped_now):
            serving.result()  # what it raised

    def _let_go_of_identity(self) -> None:
        if self._identity is not None:
            self._identity.close()
            self._identity = None

    async def _serve(self) -> None:
        """Claim and run until stopped, then shut down."""
        heartbeat = asyncio.create_task(self._heartbeat.run(), name=f"heartbeat:{self.id}")
        side = [
            heartbeat,
            asyncio.create_task(self.reaper.run(), name=f"reaper:{self.id}"),
            asyncio.create_task(self._listener.run(), name=f"listener:{self.id}"),
            asyncio.create_task(self._warm.run(), name=f"warm:{self.id}"),
            *(asyncio.create_task(go(), name=f"{name}:{self.id}") for name, go in self._side_tasks.items()),
        ]
        main = asyncio.create_task(self._claim_loop(), name=f"claim:{self.id}")
        try:
            done, _ = await asyncio.wait([main, *side], return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task is not main and task.exception() is not None:
                    log.error("side task %s died; stopping", task.get_name(), exc_info=task.exception())
            self.stop()
            await main
        finally:
            try:
                if not self.stopped_now:
                    await self._shutdown.graceful(side, renewing=not heartbeat.done())
            finally:  # stop_now() came before the shutdown, or cancelled it midway
                if self.stopped_now:
                    await self._shutdown.at_once([main, *side], self._left or [])

    async def _start(self) -> None:
        """Check the GPUs can run something, register, take back what a previous life left."""
        await self._hold_lanes()  # first: with another live worker of this id, nothing is touched
        gpus = self._gpus.first_reading()
        self._gpus.check_fit(gpus, self._models, worker_id=self.id)
        registered = time.monotonic()
        await self._manager.fleet.register_worker(
            worker_id=self.id,
            host=self.host,
            pid=os.getpid(),
            models=list(self._models.models),
            gpus=self._gpus.report(self.in_hand(), gpus),
        )
        self._clock.registered(registered)
        database = await self._manager.fleet.database_id()  # marked on its runs (leftovers.QUEUE)
        self.reaper.database = database
        marked = dataclasses.replace(self._site.config, database=database)
        self._site = dataclasses.replace(self._site, config=marked)
        await self.reaper.take_back_own()
        self._store.lanes.reset(self.id)  # files a previous life of this worker left
        self._store.drop_runner_temps(self.id)  # and its runners' temporary folders
        log.info("worker started", extra={"action": "worker_started", "worker": self.id, "gpus": len(gpus)})

    async def _hold_lanes(self) -> None:
        """Lock this worker's lanes for its life, so that other workers' sweeps leave them alone
        until it is gone (app/presence.py). ConfigError if a live process holds the lock: a worker
        of this id on another host sharing the storage folder (the id's socket is held per host),
        whose running jobs and lanes this start would take for a crashed past life's."""
        held = await asyncio.to_thread(self._store.lanes.hold, self.id)
        if held is False:
            lock = self._store.lanes.lock_file(self.id)
            raise errors.ConfigError(
                f"another worker with the id {self.id!r} is running on a host that shares this storage "
                f"folder (it holds {lock}): give each worker its own GPUJOBS_WORKER_NAME, or hostname"
            )
        if held is None:
            folder = self._store.lanes.folder(self.id)
            log.warning(
                "could not lock this worker's lanes: if it is killed, what it leaves there stays until "
                "it starts again",
                extra={"action": "lanes_unlocked", "worker": self.id, "folder": str(folder)},
            )

    # -- claiming -------------------------------------------------------------------------

    async def _claim_loop(self) -> None:
        delay = self._config.poll_interval_s
        while not self._stopping.is_set():
            self._wake.clear()
            try:
                claimed = await self._fill()
                delay = self._config.poll_interval_s
            except Exception as exc:
                if not db.is_unavailable(exc):
                    raise
                log.warning("database unavailable; claiming paused", extra={"action": "db_down"})
                claimed, delay = 0, min(delay * 2, 30.0)
                self._hand_back.claim_unsure = True
            # Burst mode ends when a claim found nothing and nothing finished meanwhile (a finish
            # during the claim sets the wake flag: there may be room now), and no job is left
            # running here unknown to it (a lost claim's, handed back and claimed again).
            if self._config.burst and not claimed and not self._running and not self._wake.is_set():
                if not (self._hand_back.claim_unsure and await self._hand_back.try_release_unknown()):
                    return
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=delay)
            if self._running and self._config.claim_gather_s > 0:
                # Jobs that end close together free their slots for one claim statement, not one
                # each (a statement costs PostgreSQL about 1 ms). An idle worker claims at once.
                await asyncio.sleep(self._config.claim_gather_s)

    def in_hand(self) -> list[planner_.InHand]:
        """The jobs running on the GPUs now (or claimed ahead, about to), as the planner needs them:
        the attempts whose model still runs. Those whose outcome is being written hold no GPU slot
        (they stay in `_running` for the heartbeat, the reaper and shutdown)."""
        return [
            planner_.InHand(a.job, a.gpu, a.started_s, a.seen_mb, a.model_started_s)
            for a, _ in self._running.values()
            if not a.model_ended
        ]

    async def _fill(self) -> int:
        """Claim jobs while some fit; returns how many were started."""
        async with self._hand_back.claiming:
            return await self._claim_and_start()

    async def _claim_and_start(self) -> int:
        if self._hand_back.claim_unsure:
            await self._hand_back.release_unknown()
        started = 0
        while not self._stopping.is_set() and await self._storage.usable():
            in_hand = self.in_hand()
            batch = await self.planner.claim(
                in_hand,
                worker_id=self.id,
                host=self.host,
                lease_s=self._config.lease_s,
                ahead=self._slots.ahead(in_hand),
            )
            if not batch:
                return started
            # In hand first, so the heartbeat renews their leases while idle runners are evicted
            # for them (a runner slow to close takes two kill graces, which may pass a lease).
            room = asyncio.Event()
            for claimed in batch:
                self._start_attempt(claimed.job, claimed.input, room)
                if self._storage.trouble is not None:  # it began while the claim ran: claims pause
                    self._running[claimed.job.id][0].stop(attempt_.PAUSED)
            try:
                for claimed in batch:
                    await self._warm.make_room(claimed.job, self.in_hand())
            finally:
                room.set()
            started += len(batch)
        return started

    def _start_attempt(
        self, job: Job, image: tuple[str, bytes] | None = None, room: asyncio.Event | None = None
    ) -> None:
        self.claimed += 1
        if self._free_lanes:  # scratch folders are reused: one per job running at once
            lane = self._free_lanes.pop()
        else:
            lane = self._store.lanes.path(self.id, self._lanes_made)
            self._lanes_made += 1
        run = attempt_.Attempt(
            job,
            self._site,
            spec=self._models.get(job.model),
            capacity_mb=self._gpus.capacity_mb(),
            image=image,
            lane=lane,
            slot=self._slots.slot(job.gpu),
            room=room,
        )
        task = asyncio.create_task(run.run(), name=f"job:{job.id}:{job.attempt}")
        older = self._running.get(job.id)
        if older is not None:
            # This worker lost the job (paused past its lease) and has just claimed it again: the
            # old attempt leaves the books here, so no heartbeat would ever tell it; it stops now.
            older[0].stop(attempt_.LEASE_LOST)
        self._running[job.id] = (run, task)
        task.add_done_callback(functools.partial(self._finished, run))

    def _model_ended(self, run: attempt_.Attempt) -> None:
        """The model of `run` is done with the GPU: its slot may take the next job while the
        outcome is written (a write of a few ms that would otherwise leave the GPU idle)."""
        if run.model_started_s is not None:
            self._slots.ran(run.job.model, time.monotonic() - run.model_started_s)
        self.planner.settle(run.gpu, run.job.vram_mb, run.gpu_pids, run.job.id)  # a replaced run's too
        if self._owns(run):
            self._wake.set()
            if self._config.claim_gather_s > 0 and not self._stopping.is_set():
                # The claim that fills this slot comes after the gather: the success, written
                # meanwhile, goes out in its statement (one round trip, one commit, not two).
                self._manager.hold_successes(self._config.claim_gather_s + CARRY_MARGIN_S)

    def _owns(self, run: attempt_.Attempt) -> bool:
        """Whether `run` is still this worker's attempt of its job (a newer one may have replaced it)."""
        entry = self._running.get(run.job.id)
        return entry is not None and entry[0] is run

    def _finished(self, run: attempt_.Attempt, task: asyncio.Task[None]) -> None:
        job_id = run.job.id
        if run.model_started_s is not None and run.storage_trouble is None:
            self._storage.written()
        if run.lane_clean:
            self._free_lanes.append(run.lane)
        if self._owns(run):  # else a newer attempt of its job (claimed again) holds its place
            del self._running[job_id]
        if not run.model_ended:  # else settled when the model ended
            self.planner.settle(run.gpu, run.job.vram_mb, run.gpu_pids, job_id)
        if not task.cancelled() and task.exception() is not None:
            log.error("attempt task failed", exc_info=task.exception(), extra={"job_id": str(job_id)})
        self._wake.set()  # room on a GPU: look for work
