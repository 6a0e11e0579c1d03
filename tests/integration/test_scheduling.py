"""Scheduling with the real worker, claim SQL and processes: reservations, aging, backfill,
out-of-memory, GPU settling, quarantine and learned VRAM."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import text

from app import db, gpu, scheduler
from app.queue import planner as planner_
from app.queue import sql
from app.queue.jobs import JobState
from app.queue.manager import JobManager
from tests import plans
from tests.conftest import api_client, png_bytes
from tests.fakes import FakeInventory
from tests.integration.test_durability import kinds, running, until
from tests.integration.test_worker import enqueue, peak_overlap, trace
from tests.unit.test_gpu import GIB, fake_pynvml


async def _starved_for(
    manager, make_worker, *, reserve_after_s: float, watch_s: float, held_outside_mb: int = 0
) -> float | None:
    """A big job behind a stream of small ones on one 10 GB GPU (`held_outside_mb` of it taken by
    another program): seconds until it started (None: never)."""
    for sleep_s in (0.8, 0.95, 1.1):  # staggered like the feed: the GPU never frees all at once
        await enqueue(manager, vram_mb=3000, sleep=sleep_s, steps=1)
    big = await enqueue(manager, vram_mb=8192, sleep=0.1, steps=1)
    submitted = time.monotonic()
    inventory = FakeInventory([10_240])
    inventory.set_free(0, 10_240 - held_outside_mb)
    worker = make_worker(
        inventory=inventory, burst=False, reserve_after_s=reserve_after_s, backfill_min_samples=10_000
    )

    async def feed() -> None:
        while True:
            await enqueue(manager, vram_mb=3000, sleep=0.8, steps=1)
            await asyncio.sleep(0.15)

    feeder = asyncio.create_task(feed())
    try:
        async with running(worker):
            while time.monotonic() - submitted < watch_s:
                if (await manager.get(big)).started_at is not None:
                    return time.monotonic() - submitted
                await asyncio.sleep(0.05)
    finally:
        feeder.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await feeder
    return None


async def test_without_a_reservation_small_jobs_starve_a_big_one(manager, make_worker):
    assert await _starved_for(manager, make_worker, reserve_after_s=1e6, watch_s=4) is None


async def test_reservation_bounds_the_wait_of_a_big_job(manager, make_worker):
    waited = await _starved_for(manager, make_worker, reserve_after_s=0.5, watch_s=8)
    # Reservation time + one small run + slack for the toy model's Python start-up under load
    # (2.95 s and 3.53 s were seen with two to four test processes on 2 cores); without a
    # reservation it waits for as long as the small jobs keep coming (the test above).
    assert waited is not None and waited < 0.5 + 0.8 + 3.5


async def test_a_job_no_gpu_can_drain_enough_for_holds_no_gpu_back_from_the_others(manager, make_worker):
    """Another program holds 600 MB of the GPU for good. A 10,000 MB job fits the GPU's size but
    never its memory: it was the waiting job the reservation looked at, found no time it would fit,
    and held no GPU, for it or anyone, so the 8 GB job behind it starved as if reservations were
    off. The reservation now looks only at jobs the GPUs can drain enough for."""
    stuck = await enqueue(manager, vram_mb=10_000, priority=5)
    waited = await _starved_for(manager, make_worker, reserve_after_s=0.5, watch_s=8, held_outside_mb=600)
    assert waited is not None and waited < 0.5 + 0.8 + 3.5
    assert (await manager.get(stuck)).state is JobState.queued  # it waits for the memory, as documented


async def test_age_raises_effective_priority(manager, make_worker, engine, tmp_path):
    log = tmp_path / "trace.jsonl"
    old = await enqueue(manager, priority=0, trace=str(log))
    new = await enqueue(manager, priority=5, trace=str(log))
    # The old job waited 65 s, six and a half 10 s steps; the new one has not waited a step (a
    # 0.2 s step once aged it too, on a busy CI machine).
    await _waited(engine, 65, old)
    assert await manager.age_queued(step_s=10, max_boost=10) == 1  # only the old job aged
    assert (await manager.get(old)).age_boost == 6 and (await manager.get(new)).age_boost == 0
    await make_worker(max_jobs_per_gpu=1).run()
    order = [line.split('"job": "')[1].split(":")[0] for line in log.read_text().splitlines()]
    assert order == [str(old), str(new)]  # 0 + 6 outranks 5
    assert await manager.age_queued(step_s=10, max_boost=3) == 0  # the boost is bounded


async def _waited(engine, seconds: float, *jobs: uuid.UUID) -> None:
    """Make `jobs` look as if `seconds` more had passed: their creation and boost base move back."""
    async with engine.begin() as conn:
        await conn.execute(
            text(
                "UPDATE jobs SET created_at = created_at - make_interval(secs => :s),"
                " boost_base_at = boost_base_at - make_interval(secs => :s) WHERE id = ANY(:ids)"
            ),
            {"s": seconds, "ids": list(jobs)},
        )


async def test_a_worker_raises_a_due_boost_on_its_next_reap_round(manager, make_worker, engine):
    job = await enqueue(manager)
    worker = make_worker(burst=False, age_step_s=4.0, age_max_boost=10)
    await _waited(engine, 8.5, job)
    await worker.reaper.reap()
    assert (await manager.get(job)).age_boost == 2
    await _waited(engine, 3.0, job)  # 11.5 s: the third point is due at 12 s
    await worker.reaper.reap()
    assert (await manager.get(job)).age_boost == 2
    await _waited(engine, 9.0, job)  # 20.5 s
    await worker.reaper.reap()
    assert (await manager.get(job)).age_boost == 5


async def test_aging_reads_only_the_jobs_due(manager, engine):
    """The pass finds due jobs through ix_jobs_boost_due, with custom and generic plans: 20,000
    queued jobs not yet due are not read (before, every pass read every queued job)."""
    due = await enqueue(manager)
    async with engine.begin() as conn:
        await conn.execute(plans.QUEUED_BESIDE, {"count": 20_000})
        await conn.execute(text("ANALYZE jobs"))
    await _waited(engine, 130, due)
    values = {"step_s": 60, "max_boost": 10, "chunk": 1000}
    for mode in ("force_custom_plan", "force_generic_plan"):  # a prepared statement may go generic
        [plan] = await plans.prepared_plans(engine, sql.AGE_QUEUED, values, mode)
        assert "Seq Scan" not in plans.scans_of(plan, "jobs"), (mode, plan)
        assert plans.rows_read(plan, "jobs") <= 10, (mode, plan)
    assert await manager.age_queued(step_s=60, max_boost=10) == 1
    assert (await manager.get(due)).age_boost == 2


async def test_aging_goes_chunk_by_chunk_and_skips_jobs_a_claim_holds(manager, engine):
    """Each chunk is its own statement, and a row another transaction holds (a claim taking it) is
    skipped, not waited for; the next pass raises it."""
    jobs = [await enqueue(manager) for _ in range(5)]
    await _waited(engine, 125, *jobs)
    async with engine.connect() as holder:
        await holder.execute(text("SELECT 1 FROM jobs WHERE id = :id FOR UPDATE"), {"id": jobs[0]})
        raised = await asyncio.wait_for(manager.age_queued(step_s=60, max_boost=10, chunk=2), timeout=5)
        assert raised == 4
        await holder.rollback()
    assert [(await manager.get(j)).age_boost for j in jobs] == [0, 2, 2, 2, 2]
    assert await manager.age_queued(step_s=60, max_boost=10, chunk=2) == 1
    assert (await manager.get(jobs[0])).age_boost == 2


async def test_a_job_at_the_most_is_not_read_again(manager, engine):
    job = await enqueue(manager)
    await _waited(engine, 1000, job)
    assert await manager.age_queued(step_s=60, max_boost=3) == 1
    async with engine.connect() as conn:
        base = await conn.scalar(text("SELECT boost_base_at::text FROM jobs WHERE id = :id"), {"id": job})
    assert base == "infinity"
    row = await db.fetch_row(engine, sql.AGE_QUEUED, {"step_s": 60, "max_boost": 3, "chunk": 1000})
    assert (row["seen"], row["raised"]) == (0, 0)
    assert (await manager.get(job)).age_boost == 3


async def test_an_endless_age_step_ages_nothing_and_keeps_the_worker(manager, make_worker):
    """GPUJOBS_AGE_STEP_S=inf (or 1e12: longer than any wait) is accepted at start and means no job
    ever gains a point. Its interval was out of PostgreSQL's range: every reap round raised, and the
    dead reaper stopped the worker."""
    job = await enqueue(manager)
    worker = make_worker(burst=False, age_step_s=math.inf)
    assert await worker.reaper.reap() == 0
    assert await manager.age_queued(step_s=1e12, max_boost=10) == 0
    assert (await manager.get(job)).age_boost == 0


async def test_backfill_starts_a_short_job_and_refuses_a_long_one(manager, make_worker):
    inventory = FakeInventory([10_240])
    inventory.set_free(0, 6_000)  # memory held elsewhere: the reserved 8 GB job cannot start yet
    worker = make_worker(inventory=inventory, backfill_min_samples=5)
    planner, now = worker.planner, time.monotonic()
    planner.reservation = scheduler.Reservation("big", 0, 8_000, 100, now + 10.0)
    planner.estimates = {
        "toy": scheduler.RunTime(1.0, 0.0, 50),
        "toy_timeout": scheduler.RunTime(30.0, 0.0, 50),
    }
    planner._reservation_at = planner._estimates_at = now + 3600  # keep these for the test
    long = await enqueue(manager, model="toy_timeout", priority=50)
    short = await enqueue(manager, model="toy", priority=0)
    claim = dict(worker_id="test:w1", host="h", lease_s=10)
    first = await planner.claim([], **claim)
    assert [c.job.id for c in first] == [short]  # ends well before the reserved job starts
    assert await planner.claim([], **claim) == []  # 37.5 s expected: would delay the reserved job
    assert (await manager.get(long)).state is JobState.queued


async def test_a_reservation_ends_when_its_job_is_claimed(manager, make_worker):
    """The held GPU took its big job; the reservation stood until its next look (refresh_s later),
    and the memory left beside the big job was offered only to jobs that outrank it or backfill:
    a small job that fits waited for nothing."""
    worker = make_worker([10_240])
    planner, now = worker.planner, time.monotonic()
    big = await enqueue(manager, vram_mb=8_000)
    planner.reservation = scheduler.Reservation(big, 0, 8_000, 0, now)
    planner._reservation_at = now + 3600  # no look of its own within the test
    claim = dict(worker_id="test:w1", host="h", lease_s=10)
    [taken] = await planner.claim([], **claim)
    assert taken.job.id == big
    small = await enqueue(manager, vram_mb=2_000)
    in_hand = [planner_.InHand(taken.job, 0, time.monotonic())]
    assert [c.job.id for c in await planner.claim(in_hand, **claim)] == [small]
    assert planner.reservation is None


async def test_a_gpu_at_its_job_cap_is_still_held_for_a_big_job(manager, make_worker):
    """With max_jobs_per_gpu, a GPU at its cap offered 0 MB. The reservation, looked at then (a new
    job's NOTIFY wakes a worker at its cap), saw no memory and no running job's end that would make
    room: it was let go, and the next slot to free went to a small job again."""
    worker = make_worker([10_240], max_jobs_per_gpu=2, reserve_after_s=0)
    planner = worker.planner
    claim = dict(worker_id="test:w1", host="h", lease_s=10)
    first = [await enqueue(manager, vram_mb=3_000) for _ in range(2)]
    big = await enqueue(manager, vram_mb=8_000)
    await enqueue(manager, vram_mb=3_000)
    taken = await planner.claim([], **claim)
    assert [c.job.id for c in taken] == first  # the big job fits the whole GPU, but not beside them
    now = time.monotonic()
    in_hand = [planner_.InHand(c.job, 0, now) for c in taken]
    planner._reservation_at = -math.inf  # look now, with both slots taken
    assert await planner.claim(in_hand, **claim) == []
    assert planner.reservation is not None and planner.reservation.job_id == big
    assert await planner.claim(in_hand[1:], **claim) == []  # one ended: its slot waits for the big job


async def test_a_held_gpu_stays_held_while_an_ended_jobs_memory_comes_back(manager, make_worker):
    """A job on the held GPU ends; NVML still shows its memory for a moment, so it is counted as
    taken (settling). The reservation, looked at then, counted only running jobs as ever giving
    memory back: it found no time the big job would fit, let the GPU go, and a small job took the
    memory the GPU had been drained for."""
    inventory = FakeInventory([10_240])
    worker = make_worker(inventory=inventory, reserve_after_s=0)
    planner = worker.planner
    claim = dict(worker_id="test:w1", host="h", lease_s=10)
    await enqueue(manager, vram_mb=3_000)
    await enqueue(manager, vram_mb=3_000)
    still, ended = await planner.claim([], **claim)
    inventory.set_free(0, 10_240 - 6_000)
    inventory.set_process(111, 3_000)  # the ended job's process, not gone yet
    planner.settle(0, 3_000, {111}, ended.job.id)
    big = await enqueue(manager, vram_mb=8_000)
    await enqueue(manager, vram_mb=3_000)
    in_hand = [planner_.InHand(still.job, 0, time.monotonic(), seen_mb=3_000)]
    planner._reservation_at = -math.inf  # look now
    assert await planner.claim(in_hand, **claim) == []
    assert planner.reservation is not None and planner.reservation.job_id == big


@pytest.mark.parametrize(
    ("seen_mb", "model_started_ago_s", "b_claimed"),
    [(1_000, 31.0, False), (0, None, False), (0, 31.0, True)],
    ids=["loading for 31 s, partly seen", "claimed ahead 31 s ago, not started", "never seen (no pids)"],
)
async def test_memory_a_model_has_yet_to_take_counts_past_the_settle_timeout(
    manager, make_worker, seen_mb, model_started_ago_s, b_claimed
):
    """A job's memory that NVML does not show yet counted as taken only for gpu_settle_timeout_s
    from its claim: meant for a host where NVML never ties memory to our processes, it also let go
    of a model that loads for longer (NVML showing part of it), and of a job claimed ahead that
    waited longer for its slot. Both times the GPU was offered as free what the job was still to
    take, and the next job would run out of memory beside it. Here another program holds 20 GB of
    a 40 GB GPU, job A (15 GB) runs, and job B (12 GB) must wait."""
    inventory = FakeInventory([40_000])
    planner = make_worker(inventory=inventory).planner
    claim = dict(worker_id="test:w1", host="h", lease_s=10)
    await enqueue(manager, vram_mb=15_000)
    [a] = await planner.claim([], **claim)
    inventory.set_free(0, 40_000 - 20_000 - seen_mb)
    b = await enqueue(manager, vram_mb=12_000)
    now = time.monotonic()
    started = None if model_started_ago_s is None else now - model_started_ago_s
    in_hand = [planner_.InHand(a.job, 0, now - 31, seen_mb=seen_mb, model_started_s=started)]
    taken = await planner.claim(in_hand, **claim)
    assert [c.job.id for c in taken] == ([b] if b_claimed else [])


async def test_out_of_memory_requeues_bigger_without_spending_an_attempt(manager, make_worker):
    job_id = await enqueue(manager, vram_mb=4000, oom_attempts=1, max_attempts=1)
    async with running(make_worker(burst=False)):
        job = await until(manager, job_id, lambda j: j.state.final)
    assert job.state is JobState.succeeded and job.attempt == 2
    assert job.vram_mb == 6000 and job.oom_retries == 1 and job.max_attempts == 2
    [event] = [e for e in await manager.events(job_id) if e.kind == "out_of_memory"]
    assert event.detail["vram_mb"] == 4000 and event.detail["new_vram_mb"] == 6000


async def test_out_of_memory_gives_up_after_its_retries(manager, make_worker):
    job_id = await enqueue(manager, vram_mb=4000, oom_attempts=10, max_attempts=5)
    async with running(make_worker(burst=False, oom_max_retries=2)):
        job = await until(manager, job_id, lambda j: j.state.final)
    assert job.state is JobState.failed and job.attempt == 3 and job.vram_mb == 9000
    assert job.error is not None and "still out of memory with 2 larger retries" in job.error


async def test_out_of_memory_grows_past_a_small_gpu_to_a_larger_one(manager, make_worker):
    """GPUs of different sizes: the job is placed on the one it fits most tightly (24 GB). Its
    estimate, capped at that GPU's size, stopped growing there, and after a second out-of-memory
    run it failed ("the whole GPU") though the 80 GB GPU beside it could run it. The cap is the
    largest GPU the worker has."""
    job_id = await enqueue(manager, vram_mb=20_000, oom_attempts=2, max_attempts=1, trace="none")
    async with running(make_worker([24_576, 81_920], burst=False)):
        job = await until(manager, job_id, lambda j: j.state.final)
    assert job.state is JobState.succeeded, job.error
    assert job.oom_retries == 2 and job.vram_mb == 45_000 and job.gpu == 1


async def test_gpu_is_held_until_its_memory_returns(manager, make_worker):
    inventory = FakeInventory([10_240])
    first = await enqueue(manager, vram_mb=6000, sleep=2.0, steps=1)  # seen by the sampler
    second = await enqueue(manager, vram_mb=6000)
    async with running(make_worker(inventory=inventory, burst=False)):
        job = await until(manager, first, lambda j: j.pid is not None)
        inventory.set_process(job.pid, 5_000)  # NVML sees the model's memory...
        await until(manager, first, lambda j: j.state.final)
        await asyncio.sleep(1.0)
        assert (await manager.get(second)).state is JobState.queued  # ...still, after it ended
        inventory.set_process(job.pid, None)  # the memory comes back
        freed = time.monotonic()
        await until(manager, second, lambda j: j.state is JobState.succeeded)
        assert time.monotonic() - freed < 5
    assert (await manager.get(first)).vram_peak_mb == 5_000


async def test_memory_nvml_does_not_show_yet_is_not_handed_out_again(manager, make_worker, tmp_path):
    """NVML's free memory lags a job's start: its model takes its memory seconds after the claim (a
    Python start, torch's import, a CUDA context). Read meanwhile, the GPU looked as free as before
    and the worker claimed more jobs on the same memory; on a real GPU they ran out of memory (each
    re-queued as an out-of-memory run). Here NVML never sees the models: each job's whole need
    counts as taken until it does."""
    inventory = FakeInventory([40_000])
    inventory.set_free(0, 20_000)  # another program holds half the card
    log = tmp_path / "trace.jsonl"
    for _ in range(4):
        await enqueue(manager, vram_mb=9_000, sleep=0.6, steps=1, trace=str(log))
    await make_worker(inventory=inventory).run()
    assert peak_overlap(trace(log)) == 2  # 2 x 9 GB fit in the 20 GB free, 4 would not


async def test_memory_nvml_already_shows_is_not_counted_twice(manager, make_worker):
    """Once NVML shows a job's memory in use, its free memory says so: the job's need is not taken
    off it again."""
    inventory = FakeInventory([40_000])
    inventory.set_free(0, 20_000)
    first = await enqueue(manager, vram_mb=9_000, sleep=3.0, steps=1)
    async with running(make_worker(inventory=inventory, burst=False)):
        job = await until(manager, first, lambda j: j.pid is not None)
        inventory.set_process(job.pid, 9_000)  # the sampler reads the model's memory...
        inventory.set_free(0, 11_000)  # ...and NVML's free memory is down by as much
        await asyncio.sleep(1.0)  # two samples
        second = await enqueue(manager, vram_mb=9_000)
        done = await until(manager, second, lambda j: j.state.final, timeout_s=10)
        assert done.state is JobState.succeeded
        assert (await manager.get(first)).state is JobState.running  # they ran side by side


async def test_an_idle_runners_memory_first_pays_what_the_buffer_lacks(manager, make_worker):
    """An idle warm runner's memory counts as free (a job that needs it evicts the runner), but
    NVML's free figure below the buffer is a deficit that memory pays first. It was added to a
    figure already raised to 0, and the worker handed out the buffer: 6 GB here, where evicting
    the runner leaves 5 GB above the buffer."""
    inventory = FakeInventory([10_240])
    first = await enqueue(manager, model="warm_a", vram_mb=6000)
    async with running(make_worker(inventory=inventory, burst=False, vram_buffer_mb=2000)) as worker:
        await until(manager, first, lambda j: j.state is JobState.succeeded)
        assert worker.pool.reserved_mb(0) == 6000  # idle, its model in GPU memory...
        inventory.set_free(0, 1000)  # ...beside another program's 3,240 MB
        [room] = worker.planner.rooms(worker.in_hand())
        assert room.available_mb == 1000 - 2000 + 6000
        too_big = await enqueue(manager, vram_mb=5500)
        await asyncio.sleep(1.0)
        assert (await manager.get(too_big)).state is JobState.queued
        assert worker.pool.reserved_mb(0) == 6000  # and the runner was not evicted for it


async def test_memory_nvml_cannot_tie_to_a_job_is_trusted_once_the_settle_time_passed(manager, make_worker):
    """In a container NVML lists the host's pids, so no job's processes are ever seen holding
    memory. Counted as not taken yet for as long as it ran, every running job's need came off
    NVML's free figure a second time, and a GPU held half of what fits. After
    `gpu_settle_timeout_s` from a job's start, NVML's free figure is taken as it is."""
    inventory = FakeInventory([40_000])
    inventory.set_free(0, 20_000)
    first = await enqueue(manager, vram_mb=9_000, sleep=4.0, steps=1)
    async with running(make_worker(inventory=inventory, burst=False, gpu_settle_timeout_s=1.0)):
        await until(manager, first, lambda j: j.pid is not None)
        inventory.set_free(0, 11_000)  # NVML shows the memory taken, but not by whom
        second = await enqueue(manager, vram_mb=9_000)
        done = await until(manager, second, lambda j: j.state.final, timeout_s=10)
        assert done.state is JobState.succeeded
        assert (await manager.get(first)).state is JobState.running  # they ran side by side


async def test_quarantine_after_abnormal_deaths_and_release_by_admin(engine, make_worker, settings):
    strict = JobManager(engine, quarantine_after=2)
    job_id = await enqueue(strict, signal="SIGSEGV", max_attempts=5)
    async with running(make_worker(burst=False, manager_=strict)):
        job = await until(strict, job_id, lambda j: j.state.final)
    assert job.state is JobState.quarantined and job.attempt == 2 and job.abnormal_runs == 2
    assert (await kinds(strict, job_id))[-1] == "quarantined"
    async with api_client(settings) as http:
        released = await http.post(f"/admin/jobs/{job_id}/retry")
        assert released.status_code == 200, released.text
        assert released.json()["state"] == "queued"
    job = await strict.get(job_id)
    assert job.abnormal_runs == 0 and job.max_attempts == job.attempt + 3


class ModelMemory(FakeInventory):
    """Reports `per_model_mb` of GPU memory for every running model process of this test run."""

    def __init__(self, sizes_mb: list[int], per_model_mb: int, marker: str) -> None:
        super().__init__(sizes_mb)
        self.per_model_mb, self.marker = per_model_mb, marker.encode()

    def process_memory_mb(self) -> dict[int, int]:
        found = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                with contextlib.suppress(OSError):
                    if self.marker in (entry / "cmdline").read_bytes():
                        found[int(entry.name)] = self.per_model_mb
        return found


@pytest.mark.parametrize(
    ("seen_ago", "admitted"),
    [(timedelta(0), 24_576 - 512), (timedelta(days=2), "declared")],
    ids=["worker seen now", "worker seen 2 days ago"],
)
async def test_a_learned_estimate_above_the_declared_one_stays_within_the_largest_gpu(
    manager, make_worker, settings, engine, tmp_path, seen_ago, admitted
):
    """With GPUJOBS_LEARNED_VRAM_ABOVE_DECLARED, the percentile plus its margin could pass every
    GPU's size (a model seen at 23.8 GB on 24 GB cards, plus 1 GB): no worker could ever take the
    job, which stayed queued for good. Now it is capped at the largest GPU a worker of the model
    has reported in the last day, less that worker's buffer. With no such worker (the model's workers away
    for longer), there was no cap at all; the declared estimate stands then."""
    marker = str(tmp_path / f"trace-{uuid.uuid4().hex}")
    for _ in range(3):
        await enqueue(manager, vram_mb=1000, sleep=1.2, steps=1, trace=marker)
    await make_worker(inventory=ModelMemory([24_576], 23_800, marker), vram_buffer_mb=512).run()
    async with engine.begin() as conn:
        last_seen = text("UPDATE workers SET heartbeat_at = now() - CAST(:ago AS interval)")
        await conn.execute(last_seen, {"ago": seen_ago})
    overrides = {
        "learned_vram_min_samples": 3,
        "learned_vram_margin_mb": 1024,
        "learned_vram_above_declared": True,
        "vram_buffer_mb": 512,
    }
    async with api_client(settings, **overrides) as http:
        response = await http.post(
            "/jobs", files={"image": ("a.png", png_bytes(), "image/png")}, data={"model": "toy"}
        )
    assert response.status_code == 201, response.text
    job = response.json()
    assert job["vram_mb"] == (job["declared_vram_mb"] if admitted == "declared" else admitted)


async def test_learned_vram_replaces_the_declared_estimate(manager, make_worker, settings, tmp_path):
    marker = str(tmp_path / f"trace-{uuid.uuid4().hex}")
    for _ in range(3):
        await enqueue(manager, vram_mb=1000, sleep=1.2, steps=1, trace=marker)  # seen by a 0.5 s sampler
    await make_worker(inventory=ModelMemory([24_576], 700, marker)).run()
    overrides = {"learned_vram_min_samples": 3, "learned_vram_margin_mb": 50}
    async with api_client(settings, **overrides) as http:
        response = await http.post(
            "/jobs", files={"image": ("a.png", png_bytes(), "image/png")}, data={"model": "toy"}
        )
        job = response.json()
        assert job["vram_mb"] == 750  # 95th percentile of 700/1000, times 1000, plus 50
        models = {m["name"]: m for m in (await http.get("/models")).json()["models"]}
    learning = models["toy"]["vram_learning"]
    assert learning["observed"]["samples"] == 3 and learning["observed"]["max_peak_mb"] == 700
    assert learning["admits_on"] == "learned"
    assert models["relief"]["vram_learning"]["admits_on"] == "declared"


async def test_a_worker_given_one_gpu_of_two_runs_its_jobs_there(manager, make_worker, tmp_path):
    """CUDA_VISIBLE_DEVICES=1 for the worker: its job runs on GPU 1 and is told so."""
    nvml = fake_pynvml([("NVIDIA test", 24 * GIB, 24 * GIB)] * 2)
    inventory = gpu.detect_inventory(None, 24_576, nvml=nvml, visible="1")
    log = tmp_path / "trace.jsonl"
    job_id = await enqueue(manager, trace=str(log))
    await make_worker(inventory=inventory).run()
    job = await until(manager, job_id, lambda j: j.state.final)
    assert (job.state, job.gpu) == (JobState.succeeded, 1)
    assert json.loads(log.read_text().splitlines()[0])["gpu"] == "1"
