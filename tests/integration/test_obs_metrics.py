"""/metrics against a real PostgreSQL: what a new API process reports over a history with holes."""

from __future__ import annotations

from sqlalchemy import text

from tests.conftest import api_client
from tests.integration.test_observability import scrape, value
from tests.integration.test_stream import submit_toy

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
