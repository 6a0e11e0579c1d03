"""/metrics from a new API process over a history longer than one scrape reads."""

from __future__ import annotations

from sqlalchemy import text

from tests.conftest import api_client
from tests.integration.test_observability import scrape
from tests.integration.test_stream import submit_toy

MANY_EVENTS = text(
    "INSERT INTO job_events (job_id, kind, attempt, detail)"
    " SELECT (SELECT id FROM jobs LIMIT 1), 'submitted', 0, '{}'::jsonb FROM generate_series(1, :n)"
)


async def test_a_new_process_reports_no_job_counter_lower_than_the_truth(settings, engine):
    """A scrape reads 2 s of history at most, so a new API process (a restart, a deploy) reported
    a part of it (205,000 of 400,001 submitted here), then more, then all: Prometheus took the
    drop from the last process's value for a counter reset and the climb for jobs submitted, a
    false rate of the whole history. Until it has read it all, the counters are left out."""
    async with api_client(settings, metrics_cache_s=0) as http:
        await submit_toy(http)
    async with engine.begin() as conn:
        await conn.execute(MANY_EVENTS, {"n": 400_000})
    series = ("gpujobs_jobs_submitted_total", frozenset({("model", "toy")}))
    async with api_client(settings, metrics_cache_s=0) as fresh:
        seen = []
        for _ in range(10):
            samples = await scrape(fresh)
            assert samples[("gpujobs_metrics_database_up", frozenset())] == 1
            seen.append(samples.get(series))
            if seen[-1] is not None:
                break
    assert seen[-1] == 400_001 and set(seen[:-1]) <= {None}, seen
