"""bench_throughput's reference line: the same no-op queue workload through procrastinate.

procrastinate (https://procrastinate.readthedocs.io, 3.x) is the best-known Python job queue on
PostgreSQL. It and psycopg come with the `bench` extra (`pip install -e '.[bench]'`), never with
the service. bench_throughput imports this module only when procrastinate is installed: it applies
the schema and queues the jobs from its own process (`prepare`, `defer`), then starts workers as
`python -m tests.bench.reference_procrastinate worker --dsn DSN --concurrency N [--wait]` and reads
the timings with the SQL below (the database clock, like the gpujobs line).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import logging
import time

import procrastinate

TASK = "noop"
DEFER_BATCH = 1000  # jobs per INSERT statement (batch_defer_async sends one statement per call)

# Each query counts only the jobs queued after `{since}` (an id; 0 for all of them), and MARK
# gives the `since` that leaves out every job queued so far.
# How many of the queued jobs have ended (the bench polls it), and what became of them.
ENDED = (
    "SELECT count(*) FROM procrastinate_jobs"
    " WHERE status IN ('succeeded', 'failed', 'aborted') AND id > {since}"
)
COUNTS = (
    "SELECT count(*) FILTER (WHERE status = 'succeeded') AS ok,"
    " count(*) FILTER (WHERE status IN ('failed', 'aborted')) AS bad"
    " FROM procrastinate_jobs WHERE id > {since}"
)
# First start to last end, seconds, from the events procrastinate's triggers write.
SPAN = (
    "SELECT extract(epoch FROM max(at) FILTER (WHERE type IN ('succeeded', 'failed', 'aborted'))"
    " - min(at) FILTER (WHERE type = 'started')) FROM procrastinate_events WHERE job_id > {since}"
)
FINISHES = "SELECT at FROM procrastinate_events WHERE type = 'succeeded' AND job_id > {since}"  # steady_sql
MARK = "SELECT coalesce(max(id), 0)::text FROM procrastinate_jobs"
# Workers that have registered, and so are fetching jobs.
REGISTERED = "SELECT count(*) FROM procrastinate_workers"
RESET = "TRUNCATE procrastinate_events, procrastinate_jobs, procrastinate_workers CASCADE"


def version() -> str:
    """The installed procrastinate's version."""
    return importlib.metadata.version("procrastinate")


def make_app(dsn: str, *, pool_size: int) -> procrastinate.App:
    """An app on `dsn` (a libpq URL) with one task, `noop`, that does nothing."""
    connector = procrastinate.PsycopgConnector(conninfo=dsn, min_size=1, max_size=pool_size)
    app = procrastinate.App(connector=connector)

    @app.task(name=TASK)
    async def noop() -> None:
        """The no-op job."""

    return app


async def prepare(dsn: str) -> None:
    """Create procrastinate's schema (tables, functions, triggers) in an empty database."""
    async with make_app(dsn, pool_size=1).open_async() as app:
        await app.schema_manager.apply_schema_async()


async def defer(dsn: str, count: int) -> float:
    """Queue `count` no-op jobs with batch_defer_async; returns jobs per second."""
    async with make_app(dsn, pool_size=1).open_async() as app:
        task = app.tasks[TASK]
        started = time.perf_counter()
        for first in range(0, count, DEFER_BATCH):
            await task.batch_defer_async(*({} for _ in range(min(DEFER_BATCH, count - first))))
        return count / (time.perf_counter() - started)


async def work(dsn: str, concurrency: int, *, wait: bool) -> None:
    """One worker: run jobs `concurrency` at a time until none is left, then return; with `wait`,
    keep listening for new jobs until SIGTERM."""
    async with make_app(dsn, pool_size=concurrency + 2).open_async() as app:
        await app.run_worker_async(concurrency=concurrency, wait=wait, install_signal_handlers=True)


def main(argv: list[str] | None = None) -> None:
    """`worker --dsn DSN --concurrency N`: the reference worker process."""
    parser = argparse.ArgumentParser(prog="python -m tests.bench.reference_procrastinate")
    parser.add_argument("command", choices=["worker"])
    parser.add_argument("--dsn", required=True, help="libpq URL of the procrastinate database")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--wait", action="store_true", help="stay up for new jobs until SIGTERM")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(work(args.dsn, args.concurrency, wait=args.wait))


if __name__ == "__main__":
    # Through the module's import name: procrastinate finds tasks by module path, not via __main__.
    from tests.bench import reference_procrastinate

    reference_procrastinate.main()
