"""A new process's job series: the history counted by PostgreSQL up to a cut-off, then read row by row.

Each test builds a history in SQL: jobs of three models, each living one of ten lives (a success,
a retry after a backoff, failures, cancels queued and running, a recovery, a final state taken
from a lost worker, an out-of-memory requeue and a release, an admin retry, a job still running),
with waits and runs that land on the histogram bounds and beside them, events that count nothing
(`started`, `progress`, `expired`), and a hole in the ids every seventh event.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import text

from app import metrics, tally
from app.queue.manager import JobManager
from tests.conftest import api_client

JOBS = text(
    """
    WITH input AS (
        INSERT INTO inputs (sha256, media_type, width, height, bytes, data)
        VALUES (repeat('a', 64), 'image/png', 1, 1, 1, '\\x00') RETURNING id
    )
    INSERT INTO jobs (owner, model, params, input_id, megapixels, vram_mb, declared_vram_mb,
                      max_attempts, created_at)
    SELECT 'owner', (ARRAY['alpha', 'beta', 'gamma'])[1 + g % 3], jsonb_build_object('g', g),
           input.id, 0.1, 1000, 1000, 3, now() - interval '3 days' + g * interval '0.5 seconds'
    FROM input, generate_series(1, :jobs) AS g
    """
)

# The events of every job, ids in time order with a hole every seventh. The n-th step of a life
# comes D[n] after the one before, D = (0, a, b, c, a, b, c), three of twelve durations picked by
# the job's number: bounds of the buckets, a microsecond either side of one, 0, past the last.
EVENTS = text(
    """
    INSERT INTO job_events (id, job_id, at, kind, attempt, detail)
    SELECT n + n / 7, job_id, at, kind, 1, detail
    FROM (
        SELECT row_number() OVER (ORDER BY e.at, e.job_id, e.step) AS n, e.*
        FROM (
            SELECT j.id AS job_id, s.step, s.kind,
                   j.created_at + make_interval(secs => (
                       SELECT sum(d) FROM unnest((ARRAY[0, t.a, t.b, t.c, t.a, t.b, t.c])[1:s.step]) AS d
                   )) AS at,
                   t.g, t.c
            FROM jobs AS j
            CROSS JOIN LATERAL (
                SELECT CAST(j.params ->> 'g' AS int) AS g, d[1 + g % 12] AS a,
                       d[1 + (g / 12) % 12] AS b, d[1 + (g / 144) % 12] AS c
                FROM CAST(j.params ->> 'g' AS int) AS g,
                     CAST(ARRAY[0.05, 0.049999, 0.050001, 1, 2.5, 0.3, 30, 300, 3600, 7.25, 0, 21600.5]
                          AS float8[]) AS d
            ) AS t
            CROSS JOIN LATERAL unnest(CASE t.g % 10
                WHEN 0 THEN ARRAY['submitted', 'claimed', 'started', 'progress', 'succeeded', 'expired']
                WHEN 1 THEN ARRAY['submitted', 'claimed', 'retry_scheduled', 'claimed', 'succeeded']
                WHEN 2 THEN ARRAY['submitted', 'claimed', 'failed']
                WHEN 3 THEN ARRAY['submitted', 'canceled']
                WHEN 4 THEN ARRAY['submitted', 'claimed', 'recovered', 'claimed', 'succeeded']
                WHEN 5 THEN ARRAY['submitted', 'claimed', 'failed']
                WHEN 6 THEN ARRAY['submitted', 'claimed', 'out_of_memory', 'claimed', 'released',
                                  'claimed', 'quarantined']
                WHEN 7 THEN ARRAY['submitted', 'claimed', 'failed', 'retried', 'claimed', 'succeeded']
                WHEN 8 THEN ARRAY['submitted', 'claimed']
                ELSE ARRAY['submitted', 'claimed', 'canceled']
            END) WITH ORDINALITY AS s(kind, step)
        ) AS e
    ) AS e
    CROSS JOIN LATERAL (
        SELECT CASE
            -- a backoff shorter than the wait before the next claim, or (clamped to 0) longer
            WHEN kind = 'retry_scheduled' THEN jsonb_build_object('run_after', at + make_interval(
                secs => CASE WHEN g % 4 = 1 THEN 2 * c ELSE c / 2 END))
            WHEN kind = 'recovered' OR (g % 10 = 5 AND kind = 'failed')
                THEN jsonb_build_object('lost_worker', 'test:gone', 'reason', 'lease_expired')
            ELSE '{}'::jsonb
        END AS detail
    ) AS d;
    SELECT setval(pg_get_serial_sequence('job_events', 'id'), (SELECT max(id) FROM job_events))
    """
)

# Events of the last seconds, past the cut-off: jobs left running end (their claim in the counted
# history), new jobs are submitted and claimed; a write rolled back leaves a hole among them.
RECENT = text(
    """
    INSERT INTO job_events (job_id, kind, detail)
    SELECT id, CASE WHEN g % 20 = 8 THEN 'succeeded' ELSE 'recovered' END,
           CASE WHEN g % 20 = 8 THEN '{}'::jsonb ELSE '{"lost_worker": "test:gone"}'::jsonb END
    FROM jobs, CAST(params ->> 'g' AS int) AS g WHERE g % 10 = 8;
    WITH j AS (
        INSERT INTO jobs (owner, model, input_id, megapixels, vram_mb, declared_vram_mb, max_attempts)
        SELECT 'owner', (ARRAY['alpha', 'delta'])[1 + g % 2], (SELECT min(id) FROM inputs), 0.1,
               1000, 1000, 3
        FROM generate_series(1, 40) AS g
        RETURNING id, model
    )
    INSERT INTO job_events (job_id, kind) SELECT id, 'submitted' FROM j
    UNION ALL SELECT id, 'claimed' FROM j WHERE model = 'delta'
    """
)
ONE_EVENT = text("INSERT INTO job_events (job_id, kind) SELECT id, 'progress' FROM jobs LIMIT 1")


async def build_history(engine: Any, *, jobs: int) -> None:
    """The history above, every event of it older than a day."""
    async with engine.begin() as conn:
        await conn.execute(JOBS, {"jobs": jobs})
        for statement in EVENTS.text.split(";\n"):
            await conn.execute(text(statement))


async def add_recent(engine: Any) -> None:
    """The recent events above, and a hole among them."""
    async with engine.begin() as conn:
        for statement in RECENT.text.split(";\n"):
            await conn.execute(text(statement))
    async with engine.connect() as conn:
        await conn.execute(ONE_EVENT)
        await conn.rollback()
    async with engine.begin() as conn:
        await conn.execute(ONE_EVENT)  # one past the hole


async def row_by_row(manager: JobManager, *, batch: int = 1000) -> tally.JobTally:
    """The tally of the whole history read as the tail reads it, from the first event on."""
    counted, after = tally.JobTally(), 0
    while True:
        after = counted.ids.next_read(after)
        rows = await manager.reports.events_for_metrics(after=after, limit=batch)
        counted.add(rows, time.monotonic())
        if len(rows) < batch:
            return counted
        after = rows[-1].id


def series(collector: Any) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """What a scrape of `collector` (anything with collect()) shows, parsed back."""
    registry = CollectorRegistry()
    registry.register(collector)
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for s in family.samples
    }


class Families:
    """A tally's families, as a collector."""

    def __init__(self, counted: tally.JobTally) -> None:
        self.counted = counted

    def collect(self) -> Any:
        return self.counted.families()


def job_series(samples: dict[tuple[str, frozenset[tuple[str, str]]], float]) -> dict[Any, float]:
    return {key: v for key, v in samples.items() if key[0].startswith(("gpujobs_job_", "gpujobs_jobs_"))}


def submitted(samples: dict[tuple[str, frozenset[tuple[str, str]]], float]) -> float:
    """Jobs submitted, all models together."""
    return sum(v for (name, _), v in samples.items() if name == "gpujobs_jobs_submitted_total")


def assert_same(found: dict[Any, float], expected: dict[Any, float]) -> None:
    """Equal series, sums included. The sums were equal to 1e-9 only (floats added in another order,
    against exact numerics in SQL), and a restart could read one a little lower than the process
    before it had: Prometheus takes any decrease for a counter's reset."""
    assert found.keys() == expected.keys()
    for key, value in expected.items():
        assert found[key] == value, key


async def test_the_history_counted_in_sql_gives_the_series_of_reading_it_row_by_row(engine, manager):
    """The start (the history up to a cut-off, grouped and bucketed by PostgreSQL) and the tail
    read from the cut-off give every job series exactly as the tally of each event does."""
    await build_history(engine, jobs=3000)
    await add_recent(engine)
    fresh = metrics.DatabaseMetrics(manager, cache_s=0, dead_after_s=60, batch=100)
    await fresh.refresh()
    assert fresh.caught_up
    async with engine.connect() as conn:
        last = await conn.scalar(text("SELECT max(id) FROM job_events"))
        old = await conn.scalar(text("SELECT max(id) FROM job_events WHERE at < now() - interval '1 day'"))
    start, _ = await manager.reports.event_groups_for_metrics(
        older_than_s=tally.GAP_WAIT_S,
        final=tally.FINAL,
        bucket_starts=tally.BUCKET_STARTS,
        timeout_s=metrics.HISTORY_TIMEOUT_S,
    )
    assert old <= start < last  # the old history counted in SQL, the recent events read row by row
    assert fresh.tally.ids.counted(last)  # (the floor waits at the hole for GAP_WAIT_S)
    expected = job_series(series(Families(await row_by_row(manager))))
    assert_same(job_series(series(fresh)), expected)
    names = {name for name, _ in expected}
    for family in ("job_queue_wait_seconds", "job_run_seconds", "job_end_to_end_seconds"):
        assert f"gpujobs_{family}_bucket" in names
    for model in ("alpha", "beta", "gamma"):
        assert expected[("gpujobs_job_recoveries_total", frozenset({("model", model)}))] > 0


async def test_a_new_process_reports_its_job_series_at_its_first_refresh(engine, manager):
    """It read the history row by row, a batch at a time for 2 s per scrape, and left its job
    series out until it had read all of it: beside 1,000,000 jobs, 34 scrapes (233 s of
    dashboards without them at a scrape every 7 s). Here 2,400 batches of 50 events."""
    await build_history(engine, jobs=30_000)
    fresh = metrics.DatabaseMetrics(manager, cache_s=0, dead_after_s=60, batch=50)
    started = time.monotonic()
    await fresh.refresh()
    assert time.monotonic() - started < metrics.READ_TIMEOUT_S
    found = series(fresh)
    assert found[("gpujobs_metrics_database_up", frozenset())] == 1
    assert submitted(found) == 30_000
    assert (
        found[("gpujobs_jobs_finished_total", frozenset({("model", "beta"), ("state", "quarantined")}))]
        == 1000
    )


async def test_a_late_commit_below_the_newest_event_is_counted_once(engine, manager):
    """The count in SQL stops below every event of the last GAP_WAIT_S: an insert not committed
    yet (a hole) under events committed after it is read by the tail once it commits, as a
    process reading row by row does, neither lost nor counted twice."""
    await build_history(engine, jobs=300)
    async with engine.connect() as late:
        await late.execute(
            text("INSERT INTO job_events (job_id, kind) SELECT id, 'submitted' FROM jobs LIMIT 1")
        )
        async with engine.begin() as conn:
            await conn.execute(ONE_EVENT)  # committed past the hole
        fresh = metrics.DatabaseMetrics(manager, cache_s=0, dead_after_s=60)
        await fresh.refresh()
        before = series(fresh)
        await late.commit()
    await fresh.refresh()
    after = series(fresh)
    assert submitted(after) == submitted(before) + 1 == 301
    assert_same(job_series(after), job_series(series(Families(await row_by_row(manager)))))


UP = ("gpujobs_metrics_database_up", frozenset())
CUT_WAITING_BACKENDS = text(
    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
    " WHERE datname = current_database() AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()"
)


async def test_a_count_that_fails_is_started_again(engine, manager):
    """The count runs beside the scrapes: one that waits on it (here behind a lock) answers within
    its budget, without the job series; a count that fails (its connection cut, as in an outage)
    reads as the database down at the next refresh, and the one after starts another."""
    await build_history(engine, jobs=300)
    fresh = metrics.DatabaseMetrics(manager, cache_s=0, dead_after_s=60)
    async with engine.connect() as locker:
        await locker.execute(text("LOCK TABLE job_events IN ACCESS EXCLUSIVE MODE"))
        started = time.monotonic()
        await fresh.refresh(budget_s=0.5)
        assert time.monotonic() - started < metrics.READ_TIMEOUT_S
        waiting = series(fresh)
        assert waiting[UP] == 1 and not job_series(waiting)
        assert await locker.scalar(CUT_WAITING_BACKENDS) == 1
        await locker.rollback()
    await fresh.refresh()
    failed = series(fresh)
    assert failed[UP] == 0 and not job_series(failed)
    await fresh.refresh()
    found = series(fresh)
    assert found[UP] == 1 and submitted(found) == 300


async def test_the_count_of_the_history_may_take_longer_than_the_servers_statement_timeout(engine, manager):
    """A statement_timeout set on the server (for a role or the database: short requests) cancelled
    the count of a long history at every scrape, which then answered 500; the job series never
    came. The count is bounded by HISTORY_TIMEOUT_S instead. Here it waits 1 s behind a lock under
    a statement_timeout of 300 ms."""
    await build_history(engine, jobs=300)
    async with engine.begin() as conn:
        name = await conn.scalar(text("SELECT current_database()"))
        await conn.execute(text(f'ALTER DATABASE "{name}" SET statement_timeout = 300'))
    await engine.dispose()  # the pooled connections have the setting of before
    fresh = metrics.DatabaseMetrics(manager, cache_s=0, dead_after_s=60)
    async with engine.connect() as locker:
        await locker.execute(text("LOCK TABLE job_events IN ACCESS EXCLUSIVE MODE"))
        refresh = asyncio.create_task(fresh.refresh(budget_s=3))
        await asyncio.sleep(1)
        await locker.rollback()
    await refresh
    found = series(fresh)
    assert found[UP] == 1 and submitted(found) == 300


WAITING_BACKENDS = text(
    "SELECT count(*) FROM pg_stat_activity"
    " WHERE datname = current_database() AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()"
)


async def test_a_process_that_ends_stops_its_count(engine, manager):
    """A process that ends before its count lands (Metrics.aclose) cancels the statement."""
    await build_history(engine, jobs=30)
    fresh = metrics.DatabaseMetrics(manager, cache_s=0, dead_after_s=60)
    async with engine.connect() as locker:
        await locker.execute(text("LOCK TABLE job_events IN ACCESS EXCLUSIVE MODE"))
        await fresh.refresh(budget_s=0.2)
        assert await locker.scalar(WAITING_BACKENDS) == 1
        await fresh.aclose()
        assert await locker.scalar(WAITING_BACKENDS) == 0
        await locker.rollback()


async def test_an_api_process_that_stops_stops_its_count(engine, settings):
    """The same through the API's lifespan: the count a scrape started ends with the process."""
    async with engine.connect() as locker:
        await locker.execute(text("LOCK TABLE job_events IN ACCESS EXCLUSIVE MODE"))
        async with api_client(settings) as http:
            assert (await http.get("/metrics")).status_code == 200
            assert await locker.scalar(WAITING_BACKENDS) == 1
        assert await locker.scalar(WAITING_BACKENDS) == 0
        await locker.rollback()
