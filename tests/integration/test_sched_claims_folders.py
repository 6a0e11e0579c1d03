"""A job canceled as the jobs of a claim whose answer was lost are handed back (sql.RELEASE_UNKNOWN)
drops the folders of its dead attempts, as every other end of a job does."""

from __future__ import annotations

from typing import Any

from sqlalchemy import text

from app.queue.jobs import JobState
from tests.integration.test_durability import kinds
from tests.integration.test_worker import enqueue

LEASE_RAN_OUT = text("UPDATE jobs SET lease_expires_at = now() - interval '1 hour' WHERE id = :id")


async def test_a_job_canceled_as_a_lost_claims_jobs_are_handed_back_drops_dead_attempts(
    manager: Any, make_worker: Any, engine: Any, store: Any
) -> None:
    """Attempt 1's worker died while storing its results (its hidden folder left), and the job came
    back to the queue. Attempt 2's claim committed but its answer was lost, and a cancel came
    meanwhile: the hand-back ended the job canceled and left attempt 1's folder on disk until
    retention; a cancel by the API, or of a job taken back, removes it."""
    job_id = await enqueue(manager, max_attempts=3)
    [first] = await manager.claim(worker_id="t:gone", host="h", models=["toy"], budgets={0: 9000}, lease_s=60)
    dead = store.root / "results" / str(job_id) / ".1.partial"
    dead.mkdir(parents=True)
    (dead / "out.txt").write_text("half stored")
    async with engine.begin() as conn:  # its lease ran out long ago
        await conn.execute(LEASE_RAN_OUT, {"id": job_id})
    [back] = await manager.fleet.recover_expired(by_worker="t:reaper")
    assert (back.id, back.state, first.job.attempt) == (job_id, JobState.queued, 1)

    claim, lost = manager.claim, []

    async def answer_lost(**values: Any) -> Any:
        claimed = await claim(**values)
        if claimed and not lost:
            lost.extend(claimed)
            await manager.cancel(job_id, owner=None, by="test")  # asked while the answer was away
            raise ConnectionResetError("the connection closed before the answer came")
        return claimed

    manager.claim = answer_lost
    await make_worker().run()  # burst: it hands back what it holds unknowingly before it ends
    assert [c.job.id for c in lost] == [job_id]
    job = await manager.get(job_id)
    assert (job.state, job.attempt) == (JobState.canceled, 2)
    assert (await kinds(manager, job_id))[-1] == "canceled"
    assert [p.name for p in (store.root / "results" / str(job_id)).iterdir()] == []
