"""Claiming ahead: jobs of a model whose runs are short are claimed while it runs, and wait for a
GPU slot (WorkerConfig.claim_ahead_s, with max_jobs_per_gpu)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any

import pytest

from app.queue import planner as planner_
from app.queue.jobs import JobState
from app.queue.manager import JobManager
from app.queue.worker import Worker
from tests.integration.test_durability import until
from tests.integration.test_worker import enqueue, overlaps, trace


async def most_in_hand(worker: Worker) -> int:
    """Run `worker` to the end; the most jobs it held for its GPU slots at once (polled every 5 ms).

    Held: claimed and not yet done with the model, so waiting for a slot or running. (The jobs
    table cannot say: a job whose model ended stays `running` while its success is written, and
    its slot has already gone to the next job.)"""
    seen = 0

    async def poll() -> None:
        nonlocal seen
        while True:
            seen = max(seen, len(worker.in_hand()))
            await asyncio.sleep(0.005)

    task = asyncio.create_task(poll())
    try:
        await worker.run()
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    return seen


async def drain(manager: JobManager, make_worker: Any, log: Path, ahead_s: float) -> int:
    """Eight toy jobs of about 0.3 s through a worker with 2 slots; the most held at once."""
    ids = [await enqueue(manager, sleep=0.2, steps=1, trace=str(log)) for _ in range(8)]
    held = await most_in_hand(make_worker(max_jobs_per_gpu=2, claim_ahead_s=ahead_s))
    assert [(await manager.get(i)).state for i in ids] == [JobState.succeeded] * len(ids)
    assert overlaps(trace(log)) <= 2  # never more models at once than slots
    return held


async def test_short_jobs_are_claimed_ahead_and_wait_for_a_slot(manager, make_worker, tmp_path):
    # Runs of about 0.3 s count as short under a 10 s bound: once the first one ended, each job
    # running has the next one claimed beside it, waiting for its slot.
    assert await drain(manager, make_worker, tmp_path / "ahead.jsonl", ahead_s=10.0) > 2


async def test_without_claim_ahead_a_worker_holds_only_its_slots(manager, make_worker, tmp_path):
    assert await drain(manager, make_worker, tmp_path / "slots.jsonl", ahead_s=0.0) <= 2


async def test_long_runs_are_not_claimed_ahead(manager, make_worker, tmp_path):
    # The same jobs, but their runs are longer than the bound: nothing is claimed ahead.
    assert await drain(manager, make_worker, tmp_path / "long.jsonl", ahead_s=0.01) <= 2


async def test_a_job_claimed_ahead_needs_its_vram_free_already(manager, make_worker, tmp_path):
    # 24 GB and 10 GB jobs: two fit beside each other, whatever the slots and the bound say.
    log = tmp_path / "vram.jsonl"
    ids = [await enqueue(manager, vram_mb=10_000, sleep=0.2, steps=1, trace=str(log)) for _ in range(6)]
    held = await most_in_hand(make_worker(max_jobs_per_gpu=4, claim_ahead_s=10.0))
    assert [(await manager.get(i)).state for i in ids] == [JobState.succeeded] * len(ids)
    assert held <= 2 and overlaps(trace(log)) <= 2


async def test_a_job_canceled_while_it_waits_runs_no_model(manager, make_worker, tmp_path):
    log = tmp_path / "cancel.jsonl"
    first = await enqueue(manager, priority=10, steps=0, trace=str(log))  # its run sets the model's length
    long = await enqueue(manager, priority=5, sleep=3.0, steps=1, trace=str(log))
    waiting = await enqueue(manager, priority=0, steps=0, trace=str(log))
    worker = asyncio.create_task(make_worker(max_jobs_per_gpu=1, claim_ahead_s=30.0).run())
    # Claimed ahead while `long` holds the one slot.
    await until(manager, waiting, lambda job: job.state is JobState.running, timeout_s=5)
    assert not worker.done()
    assert (await manager.get(long)).state is JobState.running
    await manager.cancel(waiting, owner=None, by="tester")
    await worker
    states = {i: (await manager.get(i)).state for i in (first, long, waiting)}
    assert states == {first: JobState.succeeded, long: JobState.succeeded, waiting: JobState.canceled}
    ran = {r["job"].split(":")[0] for r in trace(log)}
    assert ran == {str(first), str(long)}  # the canceled job's model never ran


@pytest.mark.parametrize(
    ("cap", "batch", "placed_on"),
    [(1, 16, 1), (2, 1, 0)],
    ids=[
        "an idle GPU's free slot before a busy GPU's slot ahead",
        "a busy GPU's free slot in a claim of one",
    ],
)
async def test_a_job_goes_to_a_slot_free_now_before_a_slot_ahead(manager, make_worker, cap, batch, placed_on):
    """A slot to claim ahead on a busy GPU and a free slot on an idle one were alike to the claim,
    which placed the job on the GPU with the least room: the busy one. It then waited there for
    the running job to end (its whole timeout, if that one hung) while the other GPU stood idle.
    And a GPU holding one job of two it may run, with one more slot ahead, has a slot free now: a
    claim of one job (claim_batch) counted its slots as one, all ahead, and placed the job on the
    idle GPU instead of the tighter fit beside the running job."""
    worker = make_worker([24_576, 24_576], max_jobs_per_gpu=cap, claim_ahead_s=60, claim_batch=batch)
    planner, claim = worker.planner, {"worker_id": "test:w1", "host": "h", "lease_s": 10}
    await enqueue(manager, vram_mb=1_000)
    [running] = await planner.claim([], **claim)
    assert running.job.gpu == 0
    await enqueue(manager, vram_mb=1_000)
    in_hand = [planner_.InHand(running.job, 0, time.monotonic(), model_started_s=time.monotonic())]
    [second] = await planner.claim(in_hand, **claim, ahead={0: 1})
    assert second.job.gpu == placed_on


async def test_a_job_claimed_ahead_is_canceled_at_once_not_when_its_slot_frees(manager, make_worker):
    """A canceled job waiting for its GPU slot kept waiting until the running job ended (its
    timeout at worst), and stayed `running`; now the cancel ends the wait within a heartbeat."""
    from tests.integration.test_durability import running

    async with running(make_worker(burst=False, max_jobs_per_gpu=1, claim_ahead_s=10.0)) as worker:
        for _ in range(2):  # short runs: the model's jobs are claimed ahead from now on
            quick = await enqueue(manager)
            await until(manager, quick, lambda j: j.state is JobState.succeeded)
        slow = await enqueue(manager, sleep=20.0, steps=1)
        await until(manager, slow, lambda j: j.pid is not None)
        ahead = await enqueue(manager)
        await until(manager, ahead, lambda j: j.state is JobState.running)  # claimed, waiting
        assert len(worker.in_hand()) == 2
        await manager.cancel(ahead, owner=None, by="test")
        started = time.monotonic()
        job = await until(manager, ahead, lambda j: j.state.final, timeout_s=10)
        assert job.state is JobState.canceled and time.monotonic() - started < 5
        assert (await manager.get(slow)).state is JobState.running  # it still holds the slot
        await manager.cancel(slow, owner=None, by="test")
