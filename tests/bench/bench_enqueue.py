"""One enqueue beside a backlog: what counting the jobs waiting for the queue limit costs.

Run on demand: `.venv/bin/python -m tests.bench.bench_enqueue [--backlog N ...] [--enqueues M]`.
For each backlog (jobs already waiting) it queues that many jobs in bulk, as bench_throughput
does, then makes M small enqueues through JobManager twice: counting the jobs waiting at every
enqueue (as every upload did before app.queue.waiting.WaitingCount), and as the service does now.
It prints the enqueue's latency p50 / p99 and PostgreSQL's CPU per enqueue (the embedded server
only), with a queue limit of 10,000. PostgreSQL: embedded, or the server in DATABASE_URL.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from sqlalchemy import text

from app import db, images
from app.queue import manager as manager_
from app.queue import records
from tests.bench import bench_queue as bq
from tests.bench import bench_throughput as bt

QUEUE_LIMIT = 10_000


async def enqueues(
    run: bt.Run, manager: manager_.JobManager, count: int
) -> tuple[float, float, float | None]:
    """`count` enqueues one after another; (p50 ms, p99 ms, PostgreSQL CPU ms per enqueue)."""
    image = images.inspect(bq.png_bytes((64, 48)), max_pixels=10**8)
    job = records.NewJob("bench", "noop", {}, 0, 1, 1)
    took: list[float] = []
    cpu_before = bt.postgres_cpu_s(run.bench.tmp / "pgdata")
    for _ in range(count):
        started = time.perf_counter()
        await manager.enqueue(job, image, queue_limit=QUEUE_LIMIT)
        took.append(1000 * (time.perf_counter() - started))
    cpu_after = bt.postgres_cpu_s(run.bench.tmp / "pgdata")
    cut = statistics.quantiles(took, n=100, method="inclusive")
    cpu_ms = None if cpu_before is None or cpu_after is None else 1000 * (cpu_after - cpu_before) / count
    return cut[49], cut[98], cpu_ms


async def measure(run: bt.Run, backlogs: list[int], count: int) -> None:
    """Each backlog, then each way of counting; one line each."""
    print(f"{'jobs waiting':>12}  {'counting':<22} {'p50 ms':>7} {'p99 ms':>7} {'PostgreSQL CPU ms':>18}")
    for backlog in backlogs:
        for label, refresh_s in (("at every enqueue", -1.0), ("as the service does", None)):
            async with run.bench.engine.begin() as conn:
                await conn.execute(text("TRUNCATE job_events, jobs"))
            if backlog:
                await bt.bulk_enqueue(run, "noop", backlog)
            manager = manager_.JobManager(run.bench.engine)
            if refresh_s is not None:
                manager.waiting.REFRESH_S = refresh_s  # older than this at once: every enqueue counts
            p50, p99, cpu_ms = await enqueues(run, manager, count)
            cpu = "n/a" if cpu_ms is None else f"{cpu_ms:.2f}"
            print(f"{backlog:>12,}  {label:<22} {p50:>7.2f} {p99:>7.2f} {cpu:>18}")


async def main_async(args: argparse.Namespace, tmp: Path) -> None:
    with bq.postgres_server(tmp) as (server_url, source):
        async with bq.bench_database(server_url) as url:
            engine = db.create_engine(url, pool_size=2)
            try:
                bench = bq.Bench(url, engine, tmp, bt.write_models(tmp))
                print(f"PostgreSQL: {source}; queue limit {QUEUE_LIMIT:,}; {args.enqueues} enqueues a line")
                await measure(bt.Run(bench, server_url, tmp / "storage"), args.backlog, args.enqueues)
            finally:
                await engine.dispose()


def main() -> None:
    """Parse the arguments, run, clean up."""
    parser = argparse.ArgumentParser(
        prog="python -m tests.bench.bench_enqueue", description=__doc__.splitlines()[0]
    )
    # With 500 enqueues, 8,000 stays below the last tenth of the limit, where every enqueue counts.
    parser.add_argument("--backlog", type=int, nargs="+", default=[0, 2_000, 8_000])
    parser.add_argument("--enqueues", type=int, default=500)
    args = parser.parse_args()
    bq.in_temp_folder("gpujobs-enqueue-", lambda tmp: main_async(args, tmp))


if __name__ == "__main__":
    main()
