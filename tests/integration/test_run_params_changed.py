"""A job queued under an older registry whose params the model's entry no longer takes (a param
removed, a range narrowed, a required one added) fails at once, saying which param, without
running its model: no retry can mend it."""

from __future__ import annotations

import pytest

from app.queue.jobs import JobState
from tests.integration.test_worker import enqueue


@pytest.mark.asyncio
@pytest.mark.parametrize("model", ["toy", "warm_a"])
async def test_params_the_registry_no_longer_takes_fail_the_job_at_once(
    manager, make_worker, store, tmp_path, model
) -> None:
    traced = {"trace": str(tmp_path / "trace.jsonl")} if model == "toy" else {}
    job_id = await enqueue(manager, model=model, max_attempts=3, bogus=1, **traced)  # bogus: neither's
    await make_worker().run()
    job = await manager.get(job_id)
    assert job.state is JobState.failed and job.attempt == 1, (job.state, job.attempt, job.error)
    assert "params.bogus: unknown parameter" in (job.error or "")
    # The model never ran: the one-shot model writes a trace line per run, a warm runner its load.
    assert not (tmp_path / ("trace.jsonl" if model == "toy" else f"loads-{model}.txt")).exists()
    # Its log says so: a failed job's log link answered an empty log, as for a model that said nothing.
    said = store.log_path(job.id, job.attempt).read_text()
    assert "the model no longer takes the job's params" in said and "params.bogus" in said, said
