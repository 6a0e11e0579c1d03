"""Claims whose answer never came back: the jobs they took are handed back at once, unspent."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from app.queue.jobs import JobState
from tests.integration.test_durability import kinds, running, until
from tests.integration.test_worker import enqueue


@pytest.mark.parametrize("burst", [True, False])
async def test_jobs_of_a_claim_whose_answer_was_lost_are_handed_back_unspent(manager, make_worker, burst):
    """The connection can drop after a claim committed and before its rows came back: the jobs are
    running under the worker's name, and the worker knows nothing of them. They waited out their
    lease and came back as a lost worker's ("lease expired"): an attempt spent and an abnormal
    death counted towards quarantine, for a run that never started. Now the worker's next claim
    first hands back what it holds unknowingly, with no attempt spent, and runs it (in burst mode,
    before it would end: the job was left running under its name until the lease ran out)."""
    job_id = await enqueue(manager, max_attempts=2)
    claim = manager.claim
    lost: list[Any] = []

    async def answer_lost(**values: Any) -> Any:
        claimed = await claim(**values)
        if claimed and not lost:
            lost.extend(claimed)
            raise ConnectionResetError("the connection closed before the answer came")
        return claimed

    manager.claim = answer_lost
    worker = make_worker(burst=burst, lease_s=30, heartbeat_interval_s=5)
    if burst:
        await worker.run()
    else:
        async with running(worker):
            await until(manager, job_id, lambda j: j.state.final, timeout_s=15)  # the lease is 30 s
    assert [c.job.id for c in lost] == [job_id]
    job = await manager.get(job_id)
    assert (job.state, job.abnormal_runs, job.max_attempts) == (JobState.succeeded, 0, 3), job.error
    lifecycle = [k for k in await kinds(manager, job_id) if k not in ("started", "progress")]
    assert lifecycle == ["submitted", "claimed", "released", "claimed", "succeeded"]


def losing_the_first_answer(manager: Any, then: Callable[[], None] = lambda: None) -> list[Any]:
    """Make the manager's first claim that takes jobs commit and then lose its answer, as a
    connection that drops at that moment does (`then` is called first); returns the jobs it took,
    once it has."""
    claim, lost = manager.claim, []

    async def answer_lost(**values: Any) -> Any:
        claimed = await claim(**values)
        if claimed and not lost:
            lost.extend(claimed)
            then()
            raise ConnectionResetError("the connection closed before the answer came")
        return claimed

    manager.claim = answer_lost
    return lost


async def test_a_worker_stopped_after_a_lost_answer_hands_those_jobs_back(manager, make_worker):
    """Stopped before its next claim (the one that hands them back), a worker left the jobs of a
    claim whose answer was lost running under its name, to come back after their lease as a lost
    worker's, an attempt spent. Its shutdown hands them back now."""
    job_id = await enqueue(manager, max_attempts=2)
    worker = make_worker(burst=False, lease_s=30, heartbeat_interval_s=5)
    lost = losing_the_first_answer(manager, then=worker.stop)
    await asyncio.wait_for(worker.run(), 10)
    assert [c.job.id for c in lost] == [job_id]
    job = await manager.get(job_id)
    assert (job.state, job.abnormal_runs, job.max_attempts) == (JobState.queued, 0, 3), job.error
    assert await kinds(manager, job_id) == ["submitted", "claimed", "released"]


async def test_jobs_of_a_lost_answer_are_handed_back_before_their_lease_runs_out(manager, make_worker):
    """After a lost answer the claim loop waits before it claims again (twice the poll interval,
    doubling while the database fails, up to 30 s), and only that claim handed the jobs back: a
    lease shorter than the wait ran out first, and the worker's own reaper took them back as a
    lost worker's. The reaper now hands them back first."""
    lost = losing_the_first_answer(manager)
    fast = {"lease_s": 2.0, "heartbeat_interval_s": 0.5, "reap_interval_s": 0.2}
    async with running(make_worker(burst=False, poll_interval_s=10.0, **fast)):
        # Listening by then, so the enqueue's NOTIFY wakes the claim whose answer is lost, and
        # nothing wakes the claim loop again; leases run out only once the server is up longer than one.
        await asyncio.sleep(2.5)
        job_id = await enqueue(manager, max_attempts=2)
        job = await until(manager, job_id, lambda j: j.state.final, timeout_s=15)
    assert [c.job.id for c in lost] == [job_id]
    assert (job.state, job.abnormal_runs, job.max_attempts) == (JobState.succeeded, 0, 3), job.error
    lifecycle = [k for k in await kinds(manager, job_id) if k not in ("started", "progress")]
    assert lifecycle == ["submitted", "claimed", "released", "claimed", "succeeded"]
