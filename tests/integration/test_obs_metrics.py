"""/metrics against a real PostgreSQL: what a new API process reports over a history with holes."""

from __future__ import annotations

import pytest
from sqlalchemy import text

from tests.conftest import api_client, free_port
from tests.integration.test_observability import lose_then_finish, scrape, value
from tests.integration.test_stream import submit_toy
from tests.integration.test_worker import enqueue

ROLLED_BACK_EVENT = text(
    "INSERT INTO job_events (job_id, kind, attempt, detail)"
    " SELECT id, 'progress', 0, '{}'::jsonb FROM jobs LIMIT 1"
)


async def test_a_new_api_process_counts_a_history_with_holes_at_once(settings, engine):
    """Every rolled-back event (and a sequence's jump after a crash) leaves a hole in the event ids.
    A new API process (a restart, a deploy, a second replica) waited 10 s at each hole of the whole
    history before counting past it: with three holes its first scrapes said 1 job submitted, not 4,
    and a long history took hours to count, its counters climbing as a false rate all along."""
    async with api_client(settings, metrics_cache_s=0) as http:
        for _ in range(4):
            await submit_toy(http)
            async with engine.connect() as conn:  # a statement that wrote an event, then failed
                await conn.execute(ROLLED_BACK_EVENT)
                await conn.rollback()
    async with api_client(settings, metrics_cache_s=0) as fresh:
        samples = await scrape(fresh)
    assert value(samples, "gpujobs_jobs_submitted_total", model="toy") == 4


# The whole history an hour earlier (every moment of it: the differences between them are kept).
AN_HOUR_EARLIER = text(
    """
    UPDATE jobs SET created_at = created_at - interval '1 hour';
    UPDATE job_events SET at = at - interval '1 hour',
        detail = CASE WHEN detail ? 'run_after' THEN detail || jsonb_build_object(
            'run_after', CAST(detail ->> 'run_after' AS timestamptz) - interval '1 hour') ELSE detail END
    """
)


async def test_a_new_api_process_counts_an_old_history_as_the_running_one_did(
    settings, engine, manager, make_worker
):
    """A process that started after the history (a restart) has PostgreSQL count it at its first
    scrape, and reports every job series as the process that read each event as it came."""
    async with api_client(settings, metrics_cache_s=0) as running:
        lost = await enqueue(manager)
        await enqueue(manager, fail_attempts=1)  # fails once, waits for its retry, then succeeds
        await enqueue(manager, exit_code=65)  # bad input: fails for good
        canceled = await submit_toy(running)
        assert (await running.post(f"/jobs/{canceled}/cancel")).status_code == 200
        await lose_then_finish(manager, make_worker, lost)
        seen = await scrape(running)
    async with engine.begin() as conn:
        for statement in AN_HOUR_EARLIER.text.split(";\n"):
            await conn.execute(text(statement))
        last = await conn.scalar(text("SELECT max(id) FROM job_events"))
    async with api_client(settings, metrics_cache_s=0) as fresh:
        found = await scrape(fresh)
        assert fresh.app.state.metrics.database.tally.floor == last  # all of it counted in SQL
    jobs = {k: v for k, v in seen.items() if k[0].startswith(("gpujobs_job_", "gpujobs_jobs_"))}
    assert value(jobs, "gpujobs_job_recoveries_total", model="toy") == 1
    assert value(jobs, "gpujobs_jobs_finished_total", model="toy", state="canceled") == 1
    assert value(jobs, "gpujobs_job_queue_wait_seconds_count", model="toy") == 5
    assert {k: found[k] for k in jobs} == pytest.approx(jobs, rel=1e-9)


async def test_a_read_the_server_cancels_reads_as_the_database_down(settings, engine):
    """A statement the server cancelled (its lock_timeout or statement_timeout; here a read of
    `jobs` behind a lock) is no connection error, so the refresh raised it: GET /metrics answered
    500 and Prometheus lost every series, though a failed read is to set
    gpujobs_metrics_database_up 0 and answer with the values read before."""
    async with engine.begin() as conn:
        name = await conn.scalar(text("SELECT current_database()"))
        await conn.execute(text(f'ALTER DATABASE "{name}" SET lock_timeout = 200'))
    async with api_client(settings, metrics_cache_s=0) as http:
        await submit_toy(http)
        assert value(await scrape(http), "gpujobs_jobs", state="queued", model="toy") == 1
        async with engine.connect() as locker:
            await locker.execute(text("LOCK TABLE jobs IN ACCESS EXCLUSIVE MODE"))
            during = await scrape(http)
            await locker.rollback()
        assert value(during, "gpujobs_metrics_database_up") == 0
        assert value(during, "gpujobs_jobs", state="queued", model="toy") == 1  # as read before
        assert value(await scrape(http), "gpujobs_metrics_database_up") == 1


async def test_a_process_that_never_read_the_database_reports_no_queue(settings):
    """A new API process whose database is away reported gpujobs_jobs 0 for every registered model
    and state, an empty queue it had never read: an alert on the queue's depth cleared itself the
    moment the database went away with a restart. The series come with the first read."""
    away = f"postgresql+asyncpg://nobody:secret@127.0.0.1:{free_port()}/nothing"
    async with api_client(settings, key=None, database_url=away) as http:
        samples = await scrape(http)
    assert value(samples, "gpujobs_metrics_database_up") == 0
    assert not [name for name, _ in samples if name == "gpujobs_jobs"], samples
