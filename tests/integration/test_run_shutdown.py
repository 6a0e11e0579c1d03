"""A worker's shutdown stops the runs still going after its grace; a run that had ended by itself
by then keeps its outcome, even while that outcome waits on a slow database."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import text

from app.queue.jobs import JobState
from tests.integration.test_durability import until
from tests.integration.test_worker import enqueue


@pytest.mark.asyncio
async def test_a_run_that_ended_before_the_shutdown_stop_keeps_its_success(
    manager, make_worker, engine, tmp_path
) -> None:
    trace = tmp_path / "trace.jsonl"
    job_id = await enqueue(manager, sleep=0.8, steps=1, trace=str(trace))
    worker = make_worker(burst=False, shutdown_grace_s=0.2)
    task = asyncio.create_task(worker.run())
    await until(manager, job_id, lambda j: j.state is JobState.running)
    async with engine.connect() as conn:
        # A slow database: the run's writes (its pid, its progress) wait on this lock.
        await conn.execute(text("SELECT 1 FROM jobs WHERE id = :id FOR UPDATE"), {"id": job_id})
        for _ in range(100):  # the model ends by itself
            if trace.exists():
                break
            await asyncio.sleep(0.05)
        assert trace.exists(), "the model did not end"
        await asyncio.sleep(0.2)
        worker.stop()  # its grace ends while the ended run's writes still wait
        await asyncio.sleep(0.6)
        await conn.rollback()
    await asyncio.wait_for(task, 30)
    job = await manager.get(job_id)
    assert job.state is JobState.succeeded, (job.state, job.error)
    assert len(trace.read_text().splitlines()) == 1
