"""Claims whose answer never came back: the jobs they took are handed back at once, unspent."""

from __future__ import annotations

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
