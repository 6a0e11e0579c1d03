"""Scheduling simulator: the service's policy against the classic ones, on a simulated clock.

    .venv/bin/python -m tests.bench.simulate [--seed 1] [--seeds 1] [--jobs 3000] [--gpus 4]
        [--gpu-gb 80] [--hosts 1] [--workload all|light|mixed|bursty|flood] [--markdown]

A discrete-event simulation: an event heap of arrivals, job ends and worker polls; the clock jumps
from one to the next and nothing sleeps. It prints tables and asserts nothing (docs/scheduling.md
explains the method and shows the numbers). The policies:

- fifo-slots: the classic design. One FIFO queue; a job takes a slot of its model's declared
  maximum VRAM (so a GPU holds floor(usable MB / figure) jobs of one model, and models share a GPU
  by figure); the head waits for a slot on any GPU (lowest index first), everything behind it too.
- fit-priority: plain fit-filtered claiming, the service without its scheduler: the best job
  (priority, then oldest) that fits a GPU now, on the GPU that fits it most tightly.
- built: the service's policy. The in-memory queue orders like sql.CLAIM (priority + age boost,
  then oldest, among jobs that fit the largest budget), placement is app.gpu.place, and each claim
  runs the three steps of app/queue/planner.py with app/scheduler.py's functions, run-time
  estimates learned from the simulated finished jobs (planner.runtime_estimates), the service's
  default settings, and a poll every poll_interval_s like the worker's claim loop.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import math
import random
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from app import gpu, scheduler, settings
from app.queue import jobs as jobs_
from app.queue import planner as planner_

GB = 1024  # MB per GB; GPU memory is binary everywhere (app/gpu.py)
END, ARRIVE, POLL = 0, 1, 2  # at equal times, ends come first
HIGH = 10  # the high priority class (the other is 0)
NOISE_SIGMA = 0.3  # run time = the model's line x lognormal noise: estimates are never exact
LOWEST = -(2**31)


def _default(name: str) -> float:
    """The service's default for a setting, so the simulation follows its configuration."""
    return float(settings.Settings.model_fields[name].default)


AGE_STEP_S = _default("age_step_s")
AGE_MAX_BOOST = int(_default("age_max_boost"))
POLL_S = _default("poll_interval_s")
VRAM_BUFFER_MB = int(_default("vram_buffer_mb"))
PLANNER = planner_.PlannerConfig(
    vram_buffer_mb=VRAM_BUFFER_MB,
    reserve_after_s=_default("reserve_after_s"),
    backfill_min_samples=int(_default("backfill_min_samples")),
)


@dataclass(frozen=True, slots=True)
class Model:
    """A model as the registry declares it (VRAM formula, timeout), and how long it really runs."""

    name: str
    base_mb: int
    mb_per_megapixel: int
    max_mb: int
    megapixels: tuple[float, float]
    run_base_s: float
    run_per_megapixel_s: float
    timeout_s: float

    def vram_mb(self, megapixels: float) -> int:
        """The declared estimate for an input of this size (registry formula, capped)."""
        return min(self.max_mb, math.ceil(self.base_mb + self.mb_per_megapixel * megapixels))

    def run_s(self, megapixels: float) -> float:
        """The mean run time for an input of this size."""
        return self.run_base_s + self.run_per_megapixel_s * megapixels


MODELS = {
    m.name: m
    for m in (
        Model("upscale", 1 * GB, GB // 2, 8 * GB, (0.5, 14.0), 10.0, 8.0, 600),  # 1-8 GB, 15 s-2 min
        Model("depth", 6 * GB, 3 * GB // 2, 30 * GB, (2.0, 16.0), 20.0, 15.0, 900),  # 9-30 GB, 1-4 min
        Model("video", 36 * GB, 2 * GB, 70 * GB, (2.0, 17.0), 60.0, 30.0, 1800),  # 40-70 GB, 2-10 min
    )
}
SIZES = ("small", "medium", "big")
GROUPS = (*SIZES, "prio 0", f"prio {HIGH}")


@dataclass(slots=True)
class SimJob:
    """One job: what it needs, and (once simulated) where and when it ran."""

    id: int
    model: str
    megapixels: float
    vram_mb: int
    run_s: float
    priority: int
    arrival_s: float
    start_s: float = math.nan
    gpu: int = -1
    host: int = -1
    charge_mb: int = 0  # MB taken from its GPU's budget (fifo-slots: the model's figure)

    @property
    def size(self) -> str:
        """small (< 10 GB), medium (< 40 GB) or big."""
        return SIZES[(self.vram_mb >= 10 * GB) + (self.vram_mb >= 40 * GB)]


# -- workloads --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Stream:
    """Jobs of one kind: models (weights), the share of all GPU memory they keep busy on average,
    the share of high-priority ones, and arrival in bursts (mean jobs, spread over burst_s)."""

    mix: tuple[tuple[str, float], ...]
    load: float
    high_share: float
    burst_jobs: float = 1.0
    burst_s: float = 0.0


MIX = (("upscale", 0.75), ("depth", 0.20), ("video", 0.05))
WORKLOADS: dict[str, tuple[Stream, ...]] = {
    "light": (Stream(MIX, 0.55, 0.25),),
    "mixed": (Stream(MIX, 0.80, 0.25),),
    "bursty": (Stream(MIX, 0.40, 0.0), Stream(MIX, 0.35, 1.0, burst_jobs=40, burst_s=30)),
    "flood": (
        Stream((("upscale", 1.0),), 1.05, 0.0),
        Stream((("depth", 1.0),), 0.10, 0.3),
        Stream((("video", 1.0),), 0.20, 0.5),
    ),
}


def memory_s(mix: Sequence[tuple[str, float]]) -> float:
    """Mean VRAM x run time (MB·s) of one job drawn from `mix`."""
    total = sum(weight for _, weight in mix)
    mean = 0.0
    for name, weight in mix:
        model = MODELS[name]
        low, high = model.megapixels
        grid = [low + (high - low) * (i + 0.5) / 200 for i in range(200)]
        mean += weight / total * statistics.fmean(model.vram_mb(mp) * model.run_s(mp) for mp in grid)
    return mean * math.exp(NOISE_SIGMA**2 / 2)


def workload(name: str, *, seed: int, jobs: int, capacity_mb: int) -> tuple[list[SimJob], float]:
    """About `jobs` jobs of workload `name`, by arrival, and the arrival horizon (s); reproducible."""
    return generate(WORKLOADS[name], random.Random(f"{name}:{seed}"), jobs=jobs, capacity_mb=capacity_mb)


def generate(
    streams: Sequence[Stream], rng: random.Random, *, jobs: int, capacity_mb: int
) -> tuple[list[SimJob], float]:
    """About `jobs` jobs from `streams`, by arrival (ids in that order), and the arrival horizon (s)."""
    rates = [s.load * capacity_mb / memory_s(s.mix) for s in streams]
    horizon_s = jobs / sum(rates)
    drawn = [
        _draw(rng, stream, at)
        for stream, rate in zip(streams, rates, strict=True)
        for at in _arrivals(rng, stream, rate, horizon_s)
    ]
    drawn.sort(key=lambda job: job.arrival_s)
    for index, job in enumerate(drawn):
        job.id = index
    return drawn, horizon_s


def _arrivals(rng: random.Random, stream: Stream, rate: float, horizon_s: float) -> list[float]:
    """Poisson arrivals of bursts (geometric sizes) at `rate` jobs/s until `horizon_s`."""
    times: list[float] = []
    t = rng.expovariate(rate / stream.burst_jobs)
    while t < horizon_s:
        extra = (
            0
            if stream.burst_jobs <= 1
            else int(math.log(1 - rng.random()) / math.log(1 - 1 / stream.burst_jobs))
        )
        times += [t + rng.uniform(0, stream.burst_s) for _ in range(1 + extra)]
        t += rng.expovariate(rate / stream.burst_jobs)
    return times


def _draw(rng: random.Random, stream: Stream, at: float) -> SimJob:
    name = rng.choices([m for m, _ in stream.mix], weights=[w for _, w in stream.mix])[0]
    model = MODELS[name]
    mp = rng.uniform(*model.megapixels)
    run_s = model.run_s(mp) * rng.lognormvariate(0, NOISE_SIGMA)
    priority = HIGH if rng.random() < stream.high_share else 0
    return SimJob(-1, name, mp, model.vram_mb(mp), run_s, priority, at)


# -- the queue and the hosts ------------------------------------------------------------------


class Queue:
    """Queued jobs, claimed in sql.CLAIM's order: the highest effective priority (priority + age
    boost), then the oldest, among jobs that fit the largest budget.

    Jobs are kept per (priority, model, VRAM class) in arrival order, like the claim index. Within
    one priority an older job never has a smaller age boost, so the first job of a bucket that passes
    the filters is the bucket's best, the row the SQL's `LIMIT 1` per (model, class) finds.
    """

    def __init__(self, *, aging: bool) -> None:
        self._buckets: dict[tuple[int, str, int], dict[int, SimJob]] = {}
        self._where: dict[object, tuple[int, str, int]] = {}
        self._aging = aging

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._where

    def add(self, job: SimJob) -> None:
        """Queue a job (jobs arrive in time order, so buckets stay in arrival order)."""
        key = (job.priority, job.model, jobs_.vram_class(job.vram_mb))
        self._buckets.setdefault(key, {})[job.id] = job
        self._where[job.id] = key

    def remove(self, job: SimJob) -> None:
        """Take a claimed job out."""
        key = self._where.pop(job.id)
        del self._buckets[key][job.id]
        if not self._buckets[key]:
            del self._buckets[key]

    def effective(self, job: SimJob, now_s: float) -> int:
        """priority + scheduler.age_boost, as AGE_QUEUED keeps it (continuously here)."""
        if not self._aging:
            return job.priority
        waited = now_s - job.arrival_s
        return job.priority + scheduler.age_boost(waited, step_s=AGE_STEP_S, max_boost=AGE_MAX_BOOST)

    def claim(
        self, now_s: float, budget_mb: int, limits: dict[str, float] | None = None, min_priority: int = LOWEST
    ) -> SimJob | None:
        """sql.CLAIM's candidate; `limits` caps megapixels per model (backfill), None = any job."""
        top = jobs_.vram_class(max(budget_mb, 1))

        def fits(job: SimJob) -> bool:
            return job.vram_mb <= budget_mb and (limits is None or job.megapixels <= limits[job.model])

        return self._best(
            now_s, lambda k: k[2] <= top and (limits is None or k[1] in limits), fits, min_priority
        )

    def waiting_head(self, now_s: float, budget_mb: int, capacity_mb: int) -> SimJob | None:
        """sql.WAITING_HEAD: the best job over `budget_mb` but within `capacity_mb`."""
        if capacity_mb <= budget_mb:
            return None
        low = jobs_.vram_class(budget_mb + 1)
        return self._best(now_s, lambda k: k[2] >= low, lambda j: budget_mb < j.vram_mb <= capacity_mb)

    def _best(
        self,
        now_s: float,
        bucket_ok: Callable[[tuple[int, str, int]], bool],
        job_ok: Callable[[SimJob], bool],
        min_priority: int = LOWEST,
    ) -> SimJob | None:
        best: SimJob | None = None
        best_rank = (math.inf, math.inf, math.inf)
        for key, bucket in self._buckets.items():
            if not bucket_ok(key):
                continue
            job = next((j for j in bucket.values() if job_ok(j)), None)
            if job is None or (effective := self.effective(job, now_s)) < min_priority:
                continue
            rank = (-effective, job.arrival_s, job.id)
            if rank < best_rank:
                best, best_rank = job, rank
        return best


@dataclass(slots=True)
class Host:
    """One worker and its GPUs (global indexes), with the planner's state for the built policy."""

    index: int
    gpus: tuple[int, ...]
    total_mb: int
    charged: dict[int, int]
    running: dict[int, SimJob] = field(default_factory=dict)
    reservation: scheduler.Reservation | None = None
    reservation_at: float = -math.inf
    estimates: dict[str, scheduler.RunTime] = field(default_factory=dict)
    estimates_at: float = -math.inf
    poll_at: float | None = None

    def rooms(self) -> list[scheduler.GpuRoom]:
        """Planner.rooms: capacity less the buffer, and what each GPU may still hand out."""
        rooms = []
        for index in self.gpus:
            used = self.charged[index]
            snapshot = gpu.Gpu(
                index, f"sim-{index}", f"sim-{index}", self.total_mb, self.total_mb - used, True
            )
            available = gpu.available_mb(snapshot, reserved_mb=used, buffer_mb=VRAM_BUFFER_MB)
            rooms.append(scheduler.GpuRoom(index, max(0, self.total_mb - VRAM_BUFFER_MB), available))
        return rooms

    def budgets(self) -> dict[int, int]:
        """GPU index -> MB it may hand out, for the GPUs with any room (Planner.claim)."""
        return {r.index: r.available_mb for r in self.rooms() if r.available_mb > 0}

    def start(self, job: SimJob, index: int, charge_mb: int, now_s: float) -> None:
        """Run `job` on GPU `index`, taking `charge_mb` of its budget."""
        job.start_s, job.gpu, job.host, job.charge_mb = now_s, index, self.index, charge_mb
        self.charged[index] += charge_mb
        self.running[job.id] = job

    def finish(self, job: SimJob) -> None:
        """The job ended: its memory is free again at once (no NVML settling here)."""
        self.charged[job.gpu] -= job.charge_mb
        del self.running[job.id]


# -- policies ---------------------------------------------------------------------------------


class Policy(Protocol):
    """What the event loop drives."""

    name: str
    timed: bool  # decisions change with time alone (aging, reservations): the worker's poll matters

    def arrive(self, job: SimJob, now_s: float) -> None: ...
    def ended(self, job: SimJob) -> None: ...
    def queued(self) -> int: ...
    def fill(self, host: Host, now_s: float) -> list[SimJob]: ...
    def notes(self) -> str: ...


class FifoSlots:
    """The classic design: one FIFO queue and per-model VRAM slots; head-of-line blocking."""

    name = "fifo-slots"
    timed = False

    def __init__(self) -> None:
        self._queue: deque[SimJob] = deque()

    def arrive(self, job: SimJob, now_s: float) -> None:
        self._queue.append(job)

    def ended(self, job: SimJob) -> None:
        pass

    def queued(self) -> int:
        return len(self._queue)

    def fill(self, host: Host, now_s: float) -> list[SimJob]:
        """Start the head while a GPU has a free slot of its model's figure; then stop."""
        started: list[SimJob] = []
        usable = host.total_mb - VRAM_BUFFER_MB
        while self._queue:
            figure = MODELS[self._queue[0].model].max_mb
            index = next((g for g in host.gpus if usable - host.charged[g] >= figure), None)
            if index is None:
                break
            job = self._queue.popleft()
            host.start(job, index, figure, now_s)
            started.append(job)
        return started

    def notes(self) -> str:
        return ""


def _take(queue: Queue, host: Host, job: SimJob, budgets: dict[int, int], now_s: float) -> SimJob:
    """Place a claimed job on the GPU of `budgets` that fits it most tightly (app.gpu.place)."""
    index = gpu.place(job.vram_mb, budgets)
    if index is None:
        raise AssertionError(f"claimed job {job.id} fits none of {budgets}")
    queue.remove(job)
    host.start(job, index, job.vram_mb, now_s)
    return job


class FitPriority:
    """Plain fit-filtered priority claiming: no aging, no reservation, no backfill rule."""

    name = "fit-priority"
    timed = False

    def __init__(self) -> None:
        self._queue = Queue(aging=False)

    def arrive(self, job: SimJob, now_s: float) -> None:
        self._queue.add(job)

    def ended(self, job: SimJob) -> None:
        pass

    def queued(self) -> int:
        return len(self._queue)

    def fill(self, host: Host, now_s: float) -> list[SimJob]:
        """Claim the best fitting job while one fits."""
        started = []
        while budgets := host.budgets():
            job = self._queue.claim(now_s, max(budgets.values()))
            if job is None:
                break
            started.append(_take(self._queue, host, job, budgets, now_s))
        return started

    def notes(self) -> str:
        return ""


class RunTimes:
    """sql.RUN_TIMES over the simulated successes: per model, count, mean and least-squares line."""

    def __init__(self) -> None:
        self._sums: dict[str, list[float]] = {}

    def add(self, job: SimJob) -> None:
        """Count a finished job."""
        s = self._sums.setdefault(job.model, [0.0] * 5)
        x, y = job.megapixels, job.run_s
        s[0], s[1], s[2], s[3], s[4] = s[0] + 1, s[1] + x, s[2] + y, s[3] + x * x, s[4] + x * y

    def rows(self) -> dict[str, tuple[int, float, float | None, float | None]]:
        """(samples, mean s, regr_intercept, regr_slope) per model; NULL line as PostgreSQL gives it."""
        rows: dict[str, tuple[int, float, float | None, float | None]] = {}
        for model, (n, sx, sy, sxx, sxy) in self._sums.items():
            spread = n * sxx - sx * sx
            if n < 2 or spread <= 0:
                rows[model] = (int(n), sy / n, None, None)
            else:
                slope = (n * sxy - sx * sy) / spread
                rows[model] = (int(n), sy / n, (sy - slope * sx) / n, slope)
        return rows


class Built:
    """The service's policy: aging, a reservation for the starved head, backfill, tightest fit."""

    name = "built"
    timed = True

    def __init__(self) -> None:
        self._queue = Queue(aging=True)
        self._runs = RunTimes()
        self.reserved: set[object] = set()  # jobs a GPU was held for
        self.backfilled = 0  # jobs started on a held GPU by step 3
        self.outranked = 0  # jobs started on a held GPU by step 2
        self.dropped = 0  # a hold let go while its job still waited and did not fit (the head changed)
        self.shared = 0  # a hold for a job another host already holds a GPU for
        self._holds: dict[int, object] = {}  # host index -> the job it holds a GPU for

    def arrive(self, job: SimJob, now_s: float) -> None:
        self._queue.add(job)

    def ended(self, job: SimJob) -> None:
        self._runs.add(job)

    def queued(self) -> int:
        return len(self._queue)

    def fill(self, host: Host, now_s: float) -> list[SimJob]:
        """Worker._fill: claim until the planner finds nothing."""
        started = []
        while (job := self._claim(host, now_s)) is not None:
            started.append(job)
        return started

    def _claim(self, host: Host, now_s: float) -> SimJob | None:
        """Planner.claim: open GPUs; the held GPU for jobs that outrank; the held GPU for backfill."""
        rooms = host.rooms()
        budgets = {r.index: r.available_mb for r in rooms if r.available_mb > 0}
        self._refresh(host, rooms, now_s)
        open_, held = scheduler.split_budgets(budgets, host.reservation)
        job = self._take(host, open_, None, now_s)
        if job is not None or not held or host.reservation is None:
            return job
        job = self._take(host, held, None, now_s, min_priority=host.reservation.effective_priority + 1)
        if job is not None:
            self.outranked += 1
            return job
        window = host.reservation.start_s - now_s
        limits = scheduler.backfill_limits(
            host.estimates, list(MODELS), window, min_samples=PLANNER.backfill_min_samples
        )
        job = self._take(host, held, limits, now_s) if limits else None
        self.backfilled += job is not None
        return job

    def _take(
        self, host: Host, budgets: dict[int, int], limits: dict[str, float] | None, now_s: float, **kw: int
    ) -> SimJob | None:
        """JobManager.claim: the best job fitting the largest budget, placed most tightly."""
        if not budgets:
            return None
        job = self._queue.claim(now_s, max(budgets.values()), limits, **kw)
        return None if job is None else _take(self._queue, host, job, budgets, now_s)

    def _refresh(self, host: Host, rooms: list[scheduler.GpuRoom], now_s: float) -> None:
        """Planner._refresh: estimates every estimates_ttl_s, the reservation every refresh_s."""
        if now_s - host.estimates_at > PLANNER.estimates_ttl_s:
            host.estimates = planner_.runtime_estimates(self._runs.rows())
            host.estimates_at = now_s
        if now_s - host.reservation_at < PLANNER.refresh_s:
            return
        host.reservation_at = now_s
        budget = max((r.available_mb for r in rooms), default=0)
        capacity = max((r.capacity_mb for r in rooms), default=0)
        head = self._queue.waiting_head(now_s, budget, capacity)
        previous, host.reservation = host.reservation, None
        if head is not None:
            effective = self._queue.effective(head, now_s)
            waiting = scheduler.Waiting(head.id, head.vram_mb, effective, now_s - head.arrival_s)
            ends = [
                scheduler.Running(j.gpu, j.vram_mb, self._expected_end(host, j))
                for j in host.running.values()
            ]
            host.reservation = scheduler.reserve(waiting, rooms, ends, now_s, after_s=PLANNER.reserve_after_s)
        self._count(host, previous, budget)

    def _count(self, host: Host, previous: scheduler.Reservation | None, budget_mb: int) -> None:
        """Tally holds: new ones, ones let go while their job still cannot start, shared ones."""
        now = host.reservation
        if previous is not None and (now is None or now.job_id != previous.job_id):
            self.dropped += previous.job_id in self._queue and previous.vram_mb > budget_mb
        if now is not None and (previous is None or previous.job_id != now.job_id):
            self.reserved.add(now.job_id)
            self.shared += any(h != host.index and j == now.job_id for h, j in self._holds.items())
        self._holds[host.index] = None if now is None else now.job_id

    def _expected_end(self, host: Host, job: SimJob) -> float:
        """Planner._expected_end: the model's estimate once it has enough samples, else its timeout."""
        estimate = host.estimates.get(job.model)
        if estimate is not None and estimate.samples >= PLANNER.backfill_min_samples:
            return job.start_s + estimate.expected_s(job.megapixels)
        return job.start_s + MODELS[job.model].timeout_s

    def notes(self) -> str:
        text = (
            f"GPU held for {len(self.reserved)} jobs; {self.backfilled} jobs backfilled and"
            f" {self.outranked} outranking jobs started on a held GPU; {self.dropped} holds let go"
            " before their job started"
        )
        return text + (f"; {self.shared} holds duplicated another host's" if len(self._holds) > 1 else "")


POLICIES: tuple[Callable[[], Policy], ...] = (FifoSlots, FitPriority, Built)


# -- the event loop ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Shape:
    """The cluster: hosts (one worker each), GPUs per host, MB per GPU."""

    hosts: int = 1
    gpus: int = 4
    gpu_mb: int = 80 * GB

    @property
    def capacity_mb(self) -> int:
        """All GPU memory, buffers included."""
        return self.hosts * self.gpus * self.gpu_mb


def simulate(jobs: Sequence[SimJob], policy: Policy, shape: Shape) -> list[SimJob]:
    """Run copies of `jobs` (ids 0..n-1, by arrival) under `policy`; returns them, start times set."""
    runs = [dataclasses.replace(job) for job in jobs]
    hosts = []
    for h in range(shape.hosts):
        gpus = tuple(range(h * shape.gpus, (h + 1) * shape.gpus))
        hosts.append(Host(h, gpus, shape.gpu_mb, dict.fromkeys(gpus, 0)))
    events = [(job.arrival_s, ARRIVE, job.id) for job in runs]
    heapq.heapify(events)
    while events:
        now_s, kind, key = heapq.heappop(events)
        for host in _woken(policy, hosts, runs, now_s, kind, key):
            for job in policy.fill(host, now_s):
                heapq.heappush(events, (now_s + job.run_s, END, job.id))
            # Worker._claim_loop polls while nothing wakes it; only time-driven choices need it,
            # and only while something runs here (else every job that can start already did).
            if policy.timed and host.poll_at is None and host.running and policy.queued():
                host.poll_at = now_s + POLL_S
                heapq.heappush(events, (host.poll_at, POLL, host.index))
    return runs


def _woken(
    policy: Policy, hosts: list[Host], runs: list[SimJob], now_s: float, kind: int, key: int
) -> list[Host]:
    """Apply one event; returns the workers it wakes (NOTIFY wakes all, a job end its own)."""
    if kind == ARRIVE:
        policy.arrive(runs[key], now_s)
        return hosts
    if kind == END:
        job = runs[key]
        hosts[job.host].finish(job)
        policy.ended(job)
        return [hosts[job.host]]
    hosts[key].poll_at = None
    return [hosts[key]]


# -- measures ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Outcome:
    """One policy on one workload."""

    policy: str
    utilization: float
    makespan_s: float
    finished: int
    jobs: int
    waits: dict[str, tuple[int, float, float, float]]  # group -> (jobs, mean, p99, max) s
    notes: str


def lower_bound(jobs: Sequence[SimJob], shape: Shape) -> tuple[float, float, float]:
    """(VRAM·time / all memory, the longest job, the latest arrival + run): makespan >= each."""
    memory_time = sum(j.vram_mb * j.run_s for j in jobs) / shape.capacity_mb
    return memory_time, max(j.run_s for j in jobs), max(j.arrival_s + j.run_s for j in jobs)


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of non-empty `values`."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def measure(policy: Policy, runs: Sequence[SimJob], shape: Shape) -> Outcome:
    """Utilization, makespan and waits of a finished simulation."""
    done = [j for j in runs if not math.isnan(j.start_s)]
    makespan = max((j.start_s + j.run_s for j in done), default=0.0)
    work = sum(j.vram_mb * j.run_s for j in done)
    utilization = work / (shape.capacity_mb * makespan) if makespan > 0 else 0.0
    groups: dict[str, list[float]] = {}
    for job in done:
        for group in (job.size, f"prio {job.priority}"):
            groups.setdefault(group, []).append(job.start_s - job.arrival_s)
    waits = {g: (len(w), statistics.fmean(w), percentile(w, 99), max(w)) for g, w in groups.items()}
    return Outcome(policy.name, utilization, makespan, len(done), len(runs), waits, policy.notes())


def run_all(jobs: Sequence[SimJob], shape: Shape) -> list[Outcome]:
    """Every policy on the same jobs."""
    outcomes = []
    for make in POLICIES:
        policy = make()
        outcomes.append(measure(policy, simulate(jobs, policy, shape), shape))
    return outcomes


# -- report -----------------------------------------------------------------------------------


def render(headers: Sequence[str], rows: Sequence[Sequence[str]], *, markdown: bool) -> str:
    """An aligned text table (first column left, the rest right), or a Markdown one."""
    if markdown:
        lines = [
            "| " + " | ".join(headers) + " |",
            "|" + "|".join([":---"] + ["---:"] * (len(headers) - 1)) + "|",
        ]
        return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])
    widths = [max(len(row[i]) for row in [headers, *rows]) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    return "\n".join([line(headers), "  ".join("-" * w for w in widths), *(line(row) for row in rows)])


def _wait_cell(wait: tuple[int, float, float, float] | None) -> str:
    return "-" if wait is None else f"{wait[1]:,.0f} / {wait[2]:,.0f} / {wait[3]:,.0f}"


def outcome_table(outcomes: Sequence[Outcome], bound_s: float, *, markdown: bool) -> str:
    """One workload: a row per policy."""
    headers = ["policy", "util", "makespan s", "x LB", "done", *(f"{g} wait s mean/p99/max" for g in GROUPS)]
    rows = [
        [
            o.policy,
            f"{o.utilization:.3f}",
            f"{o.makespan_s:,.0f}",
            f"{o.makespan_s / bound_s:.3f}",
            f"{o.finished}/{o.jobs}",
            *(_wait_cell(o.waits.get(g)) for g in GROUPS),
        ]
        for o in outcomes
    ]
    return render(headers, rows, markdown=markdown)


def describe(name: str, jobs: Sequence[SimJob], horizon_s: float, shape: Shape) -> str:
    """What one workload's table is about: the jobs, the load, the lower bound."""
    memory_time, longest, latest = lower_bound(jobs, shape)
    counts = ", ".join(f"{sum(j.size == size for j in jobs)} {size}" for size in SIZES)
    high = sum(j.priority == HIGH for j in jobs)
    offered = sum(j.vram_mb * j.run_s for j in jobs) / (shape.capacity_mb * horizon_s)
    slots = sum(MODELS[j.model].max_mb * j.run_s for j in jobs) / (shape.capacity_mb * horizon_s)
    return (
        f"{len(jobs)} jobs ({counts}; {high} at priority {HIGH}) arriving over"
        f" {horizon_s:,.0f} s on {shape.hosts} x {shape.gpus} GPUs of {shape.gpu_mb // GB} GB;"
        f" offered load {offered:.2f} of all GPU memory ({slots:.2f} counted in fifo-slots' figures)."
        f" Lower bound {max(memory_time, longest, latest):,.0f} s = max(VRAM·time / capacity"
        f" {memory_time:,.0f}, longest job {longest:,.0f}, latest arrival + run {latest:,.0f})."
    )


def summary_table(results: dict[str, list[tuple[float, list[Outcome]]]], *, markdown: bool) -> str:
    """Across seeds, per workload and policy: utilization, makespan / LB, small p99 and big max waits."""
    headers = [
        "workload",
        "policy",
        "util mean [min, max]",
        "x LB mean",
        "small p99 wait s, median",
        "big max wait s, median [worst]",
        "big max wait / fifo's, worst",
    ]
    rows = []
    for name, runs in results.items():
        for i, policy in enumerate(o.policy for o in runs[0][1]):
            mine = [(bound, outcomes[i], outcomes[0]) for bound, outcomes in runs]
            utils = [o.utilization for _, o, _ in mine]
            big = [_wait(o, "big", 3) for _, o, _ in mine]
            rows.append(
                [
                    name,
                    policy,
                    f"{statistics.fmean(utils):.3f} [{min(utils):.3f}, {max(utils):.3f}]",
                    f"{statistics.fmean(o.makespan_s / bound for bound, o, _ in mine):.3f}",
                    f"{statistics.median(_wait(o, 'small', 2) for _, o, _ in mine):,.0f}",
                    f"{statistics.median(big):,.0f} [{max(big):,.0f}]",
                    f"{max(_wait(o, 'big', 3) / max(_wait(f, 'big', 3), 1.0) for _, o, f in mine):.2f}",
                ]
            )
    return render(headers, rows, markdown=markdown)


def _wait(outcome: Outcome, group: str, field: int) -> float:
    """One wait figure (1 mean, 2 p99, 3 max) of a group; 0 when the group is empty."""
    wait = outcome.waits.get(group)
    return 0.0 if wait is None else wait[field]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(
        prog="python -m tests.bench.simulate", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--seed", type=int, default=1, help="first seed (default 1)")
    parser.add_argument("--seeds", type=int, default=1, help="how many seeds; >1 prints a summary")
    parser.add_argument("--jobs", type=int, default=3000, help="about how many jobs per workload")
    parser.add_argument("--gpus", type=int, default=4, help="GPUs per host")
    parser.add_argument("--gpu-gb", type=int, default=80, help="memory of each GPU (GB = GiB)")
    parser.add_argument("--hosts", type=int, default=1, help="hosts, one worker each")
    parser.add_argument("--workload", choices=["all", *WORKLOADS], default="all")
    parser.add_argument("--markdown", action="store_true", help="print Markdown tables")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    """Simulate every chosen workload under every policy and print the tables."""
    args = parse_args(argv)
    shape = Shape(args.hosts, args.gpus, args.gpu_gb * GB)
    names = list(WORKLOADS) if args.workload == "all" else [args.workload]
    began = time.perf_counter()
    results: dict[str, list[tuple[float, list[Outcome]]]] = {name: [] for name in names}
    for seed in range(args.seed, args.seed + args.seeds):
        for name in names:
            jobs, horizon_s = workload(name, seed=seed, jobs=args.jobs, capacity_mb=shape.capacity_mb)
            jobs = _fitting(jobs, shape)
            outcomes = run_all(jobs, shape)
            bound = max(lower_bound(jobs, shape))
            results[name].append((bound, outcomes))
            if args.seeds == 1:
                _print_workload(name, seed, jobs, horizon_s, shape, outcomes, markdown=args.markdown)
    if args.seeds > 1:
        print(summary_table(results, markdown=args.markdown))
    print(f"simulated in {time.perf_counter() - began:.1f} s", file=sys.stderr)


def _fitting(jobs: list[SimJob], shape: Shape) -> list[SimJob]:
    """Drop jobs no GPU could ever hold (they would wait forever under every policy), renumbered."""
    kept = [j for j in jobs if j.vram_mb <= shape.gpu_mb - VRAM_BUFFER_MB]
    if len(kept) < len(jobs):
        print(f"{len(jobs) - len(kept)} jobs fit no GPU of this size; left out", file=sys.stderr)
    return [dataclasses.replace(j, id=i) for i, j in enumerate(kept)]


def _print_workload(
    name: str,
    seed: int,
    jobs: list[SimJob],
    horizon_s: float,
    shape: Shape,
    outcomes: list[Outcome],
    *,
    markdown: bool,
) -> None:
    title = f"{name}, seed {seed}"
    print(
        (f"#### {title}" if markdown else f"== {title} ==")
        + "\n\n"
        + describe(name, jobs, horizon_s, shape)
        + "\n"
    )
    print(outcome_table(outcomes, max(lower_bound(jobs, shape)), markdown=markdown))
    notes = [f"{o.policy}: {o.notes}" for o in outcomes if o.notes]
    print("\n" + "\n".join(notes) + "\n")


if __name__ == "__main__":
    main()
