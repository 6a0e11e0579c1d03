"""Planner: what a worker may claim next, and on which GPU.

Budgets: each GPU's free MB (DESIGN.md "Claiming"), less the jobs running on it, less the memory
of jobs that ended but whose processes NVML still shows (a GPU is not offered again until its
memory is back, or `gpu_settle_timeout_s` passed). NVML's free figure is further lowered by the
part of the running jobs' needs it does not show yet (a model takes its memory seconds after its
claim); for `gpu_settle_timeout_s` from its model's start at most when NVML shows nothing of it.
Claims, in order, while a reservation holds:

    1. any job, on the GPUs that are not held
    2. on the held GPU: jobs that outrank the reserved one
    3. on the held GPU: backfill, jobs expected to end before the reserved one could start

The policy itself is in app/scheduler.py (pure, shared with the simulator).
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from app import errors, gpu, registry, scheduler, warmpool
from app.queue import manager as manager_
from app.queue.jobs import Claimed, Job

log = logging.getLogger("gpujobs.worker")


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    """Scheduling settings (see Settings for their meaning)."""

    vram_buffer_mb: int = 512
    max_jobs_per_gpu: int = 0
    reserve_after_s: float = 120.0
    backfill_min_samples: int = 5
    gpu_settle_timeout_s: float = 30.0
    refresh_s: float = 1.0  # how often the reservation is reconsidered
    warm_streak_max: int = 4  # claims in a row that may prefer models with a warm runner
    estimates_ttl_s: float = 30.0
    claim_batch: int = 16  # the most jobs one claim statement may take


@dataclass(frozen=True, slots=True)
class InHand:
    """A job this worker runs: where, how big, since when (monotonic seconds: its claim, and its
    model's start, None while a job claimed ahead waits for its slot), and how much GPU memory NVML
    last showed its model holding."""

    job: Job
    gpu: int
    started_s: float
    seen_mb: int = 0
    model_started_s: float | None = None


@dataclass(slots=True)
class _Settling:
    gpu: int
    vram_mb: int
    pids: frozenset[int]
    deadline_s: float
    job_id: object


class Planner:
    """Budgets, reservation and backfill for one worker's GPUs."""

    def __init__(
        self,
        manager: manager_.JobManager,
        inventory: gpu.GpuInventory,
        models: registry.Registry,
        config: PlannerConfig,
        pool: warmpool.WarmPool | None = None,
    ) -> None:
        self._manager = manager
        self._inventory = inventory
        self._models = models
        self._config = config
        self._pool = pool
        self._settling: list[_Settling] = []
        self.reservation: scheduler.Reservation | None = None
        self._reservation_at = -math.inf
        self._warm_streak = 0
        self.estimates: dict[str, scheduler.RunTime] = {}
        self._estimates_at = -math.inf
        self.unreadable = False  # the last reading of the GPUs failed (a claim's or a heartbeat's)

    # -- budgets --------------------------------------------------------------------------

    def settle(self, gpu_index: int, vram_mb: int, pids: set[int], job_id: object) -> None:
        """A job ended: keep its memory counted until its processes leave the GPU."""
        if pids:
            deadline = time.monotonic() + self._config.gpu_settle_timeout_s
            self._settling.append(_Settling(gpu_index, vram_mb, frozenset(pids), deadline, job_id))

    def _settling_mb(self) -> Counter[int]:
        """MB per GPU still held by ended jobs; entries whose memory came back are dropped."""
        if not self._settling:
            return Counter()
        alive = set(self._inventory.process_memory_mb())
        now = time.monotonic()
        kept = []
        for entry in self._settling:
            if not entry.pids & alive:
                continue
            if now > entry.deadline_s:
                log.warning(
                    "GPU memory of an ended job did not come back; offering the GPU anyway",
                    extra={"action": "gpu_settle_timeout", "gpu": entry.gpu, "job_id": str(entry.job_id)},
                )
                continue
            kept.append(entry)
        self._settling = kept
        held: Counter[int] = Counter()
        for entry in kept:
            held[entry.gpu] += entry.vram_mb
        return held

    def _taken_mb(self, running: Sequence[InHand]) -> tuple[Counter[int], Counter[int]]:
        """MB per GPU taken by the jobs in hand and the ended jobs still settling; and the part of
        the jobs in hand that NVML does not show yet. A model takes its memory a while after its
        claim (a process start, imports, a CUDA context): until then NVML's free figure still
        counts that memory as free, and must not be handed out again.

        Where NVML cannot tie memory to our processes (a container without the host's pid
        namespace), nothing is ever seen, and each running job would count twice for as long as it
        ran: a model NVML has shown nothing of counts so for `gpu_settle_timeout_s` from its start
        at most. One it has shown part of (still loading), or a job whose model has not started
        (claimed ahead), counts until it is seen whole, or ends."""
        reserved = self._settling_mb()
        unseen: Counter[int] = Counter()
        since = time.monotonic() - self._config.gpu_settle_timeout_s
        for r in running:
            reserved[r.gpu] += r.job.vram_mb
            if r.seen_mb > 0 or r.model_started_s is None or r.model_started_s > since:
                unseen[r.gpu] += max(0, r.job.vram_mb - r.seen_mb)
        return reserved, unseen

    def rooms(self, running: Sequence[InHand]) -> list[scheduler.GpuRoom]:
        """Each GPU's capacity and the memory it can hand out now. Memory only: a GPU at its job
        cap still shows its room (the claim leaves it out by its slots, `free_slots`), so that a
        reservation looked at then still sees what the GPU will have for its job.

        Idle warm runners count as free: a job that needs their memory evicts them (make_room).
        """
        reserved, unseen = self._taken_mb(running)
        buffer = self._config.vram_buffer_mb
        rooms = []
        for g in self._inventory.snapshot():
            available = max(0, self._room_mb(g, reserved[g.index], unseen[g.index]))
            rooms.append(scheduler.GpuRoom(g.index, max(0, g.total_mb - buffer), available))
        return rooms

    def _room_mb(self, g: gpu.Gpu, reserved_mb: int, unseen_mb: int) -> int:
        """gpu.room_mb (possibly below 0), with idle warm runners' memory as free."""
        held = self._pool.reserved_mb(g.index) if self._pool is not None else 0
        return gpu.room_mb(
            g,
            reserved_mb=reserved_mb,
            buffer_mb=self._config.vram_buffer_mb,
            unseen_mb=unseen_mb,
            evictable_mb=held,
        )

    def shortfall_mb(self, job: Job, running: Sequence[InHand]) -> int:
        """MB idle warm runners must give up so `job` (just claimed, on its GPU) fits for real
        (0 when the GPUs cannot be read: the claim that placed the job read them just before)."""
        if self._pool is None or job.gpu is None:
            return 0
        try:
            return self._shortfall_mb(job, running, self._pool)
        except errors.AppError as exc:
            log.warning("GPUs could not be read: %s", exc.message, extra={"action": "gpu_read_failed"})
            return 0

    def _shortfall_mb(self, job: Job, running: Sequence[InHand], pool: warmpool.WarmPool) -> int:
        reserved, unseen = self._taken_mb([r for r in running if r.job.id != job.id])
        need = job.vram_mb
        if self._models.get(job.model).persistent:  # its own idle runner's memory is its to use
            need -= pool.idle_hold_mb(warmpool.RunnerKey(job.model, job.gpu))
        for g in self._inventory.snapshot():
            if g.index == job.gpu:  # what it has with the runners kept, below 0 if they must pay a deficit
                free = self._room_mb(g, reserved[g.index], unseen[g.index]) - pool.reserved_mb(g.index)
                return max(0, need - free)
        return 0

    # -- claiming -------------------------------------------------------------------------

    def free_slots(
        self, running: Sequence[InHand], ahead: Mapping[int, int] | None = None
    ) -> dict[int, int] | None:
        """Jobs each GPU may still take under `max_jobs_per_gpu` (None: no cap). `ahead[gpu]` more
        may be claimed ahead, to wait for a slot: the worker allows one per short job it holds there.
        Their VRAM counts as taken from the claim on, so they fit beside the running jobs."""
        cap = self._config.max_jobs_per_gpu
        if not cap:
            return None
        count = Counter(r.gpu for r in running)
        more = ahead or {}
        return {
            g.index: max(0, cap + more.get(g.index, 0) - count[g.index]) for g in self._inventory.snapshot()
        }

    async def claim(
        self,
        running: Sequence[InHand],
        *,
        worker_id: str,
        host: str,
        lease_s: float,
        ahead: Mapping[int, int] | None = None,
    ) -> list[Claimed]:
        """Claim the jobs this worker should start next (at most `claim_batch`), best first;
        `ahead`: jobs per GPU it may claim beyond the cap (see `free_slots`). Nothing while the
        GPUs cannot be read (an NVML error): what they have free is unknown."""
        gpus = self._read_gpus(running, ahead)
        if gpus is None:
            return []
        rooms, slots = gpus
        budgets = {
            r.index: r.available_mb
            for r in rooms
            if r.available_mb > 0 and (slots is None or slots.get(r.index, 0) > 0)
        }
        await self._refresh(rooms, running)
        open_, held = scheduler.split_budgets(budgets, self.reservation)
        models = list(self._models.models)
        take = functools.partial(
            self._take, worker_id=worker_id, host=host, lease_s=lease_s, slots=slots, ahead=ahead,
            warm=self._warm(),
        )  # fmt: skip
        limit = self._config.claim_batch
        if slots is not None:
            limit = min(limit, sum(slots[g] for g in open_))
        jobs = await take(open_, models, limit=max(1, limit))
        if jobs or not held or self.reservation is None:
            return jobs
        return await self._claim_held(take, held, models, self.reservation)

    async def _take(
        self,
        budgets: dict[int, int],
        models: Sequence[str] | dict[str, float],
        min_priority: int = -(2**31),
        limit: int = 1,
        *,
        worker_id: str,
        host: str,
        lease_s: float,
        slots: Mapping[int, int] | None,
        ahead: Mapping[int, int] | None,
        warm: AbstractSet[tuple[str, int | None]],
    ) -> list[Claimed]:
        """One claim statement on these GPUs' budgets, for `claim` and `_claim_held`."""
        jobs = await self._manager.claim(
            worker_id=worker_id, host=host, models=models, budgets=budgets, lease_s=lease_s,
            limit=limit, slots=slots, ahead=ahead, min_priority=min_priority, warm=warm,
        )  # fmt: skip
        if jobs:  # a claim that took nothing (no room, nothing queued) is no turn
            self._warm_streak = self._warm_streak + 1 if warm else 0
            self._release_if_taken(jobs)
        return jobs

    async def _claim_held(
        self, take: Callable[..., Awaitable[list[Claimed]]], held: dict[int, int], models: list[str],
        reservation: scheduler.Reservation,
    ) -> list[Claimed]:  # fmt: skip
        """On the GPU held for the reservation, one job at a time (each sees the reservation as it
        stands): one that outranks it, else one short enough to end before its start (backfill)."""
        jobs = await take(held, models, min_priority=reservation.effective_priority + 1)
        if jobs:
            return jobs
        window = reservation.start_s - time.monotonic()
        limits = scheduler.backfill_limits(
            self.estimates, models, window, min_samples=self._config.backfill_min_samples
        )
        return await take(held, limits) if limits else []

    def _read_gpus(
        self, running: Sequence[InHand], ahead: Mapping[int, int] | None
    ) -> tuple[list[scheduler.GpuRoom], dict[int, int] | None] | None:
        """(`rooms`, `free_slots`) now; None while NVML raises (the next claim reads again)."""
        try:
            rooms = self.rooms(running)
            slots = self.free_slots(running, ahead)
        except errors.AppError as exc:  # the inventory's NVML errors
            self.gpus_unreadable(exc)
            return None
        self.gpus_readable()
        return rooms, slots

    def gpus_unreadable(self, exc: errors.AppError) -> None:
        """A reading of the GPUs failed, here or in the worker's heartbeat: claims pause. Said
        once per outage, however many claims and heartbeats meet it."""
        if not self.unreadable:
            log.warning(
                "GPUs could not be read; claiming paused: %s",
                exc.message,
                extra={"action": "gpu_read_failed"},
            )
        self.unreadable = True

    def gpus_readable(self) -> None:
        """A reading of the GPUs succeeded: claims resume (said once, after an outage)."""
        if self.unreadable:
            log.info("GPUs read again; claiming resumed", extra={"action": "gpu_read_again"})
            self.unreadable = False

    def _release_if_taken(self, jobs: Sequence[Claimed]) -> None:
        """The reserved job is claimed: the GPU is held no longer, and the next claim looks again
        (another job may have waited as long), rather than keeping the memory beside the big job
        for backfill alone until the next refresh."""
        if self.reservation is not None and any(c.job.id == self.reservation.job_id for c in jobs):
            self.reservation = None
            self._reservation_at = -math.inf

    def _warm(self) -> set[tuple[str, int | None]]:
        """(model, GPU) pairs with a live warm runner, preferred among equals by the next claim;
        none once warm_streak_max claims in a row took jobs with that preference, so the next claim
        that takes any is plain (oldest first among equals) and other models get their turn."""
        if self._pool is None or self._warm_streak >= self._config.warm_streak_max:
            return set()
        return {(k.model, k.gpu) for k in self._pool.warm_keys()}

    async def _refresh(self, rooms: list[scheduler.GpuRoom], running: Sequence[InHand]) -> None:
        """Reconsider the reservation (at most every `refresh_s`) and the run-time estimates."""
        now = time.monotonic()
        if now - self._estimates_at > self._config.estimates_ttl_s:
            self.estimates = runtime_estimates(await self._manager.reports.run_times())
            self._estimates_at = now
        if now - self._reservation_at < self._config.refresh_s:
            return
        self._reservation_at = now
        ends = [scheduler.Running(r.gpu, r.job.vram_mb, self._expected_end(r)) for r in running]
        # Ended jobs whose memory NVML still shows (rooms() counted it taken) give it back any
        # moment: without them a GPU drained for the job looked as if it never would fit.
        ends += [scheduler.Running(e.gpu, e.vram_mb, now) for e in self._settling]
        budget = max((r.available_mb for r in rooms), default=0)
        # The most a GPU would have once this worker's jobs there end: memory another program holds
        # stays taken, so a job larger than that is passed over (no GPU is held for it: it would
        # hold one for nothing, and none for the jobs behind it).
        drained = Counter({r.index: r.available_mb for r in rooms})
        for end in ends:
            drained[end.gpu] += end.vram_mb
        capacity = max((min(r.capacity_mb, drained[r.index]) for r in rooms), default=0)
        head = await self._manager.reports.waiting_head(
            models=list(self._models.models), budget=budget, capacity=capacity
        )
        previous, self.reservation = self.reservation, None
        if head is not None:
            job_id, vram_mb, effective, waited_s = head
            waiting = scheduler.Waiting(job_id, vram_mb, effective, waited_s)
            self.reservation = scheduler.reserve(
                waiting, rooms, ends, now, after_s=self._config.reserve_after_s
            )
        if self.reservation is not None and (previous is None or previous.job_id != self.reservation.job_id):
            log.info(
                "GPU held for a waiting job",
                extra={
                    "action": "gpu_reserved",
                    "gpu": self.reservation.gpu,
                    "job_id": str(self.reservation.job_id),
                },
            )

    def _expected_end(self, running: InHand) -> float:
        """When a running job should end: its model's estimate, or its timeout when unknown."""
        estimate = self.estimates.get(running.job.model)
        if estimate is not None and estimate.samples >= self._config.backfill_min_samples:
            return running.started_s + estimate.expected_s(running.job.megapixels)
        return running.started_s + self._models.get(running.job.model).timeout_s


def runtime_estimates(
    rows: dict[str, tuple[int, float, float | None, float | None]],
) -> dict[str, scheduler.RunTime]:
    """Run-time lines from the database's statistics (a flat line when sizes never varied)."""
    estimates = {}
    for model, (samples, mean_s, intercept_s, slope_s) in rows.items():
        if intercept_s is None or slope_s is None:
            estimates[model] = scheduler.RunTime(mean_s, 0.0, samples)
        else:
            estimates[model] = scheduler.RunTime(float(intercept_s), max(0.0, float(slope_s)), samples)
    return estimates
