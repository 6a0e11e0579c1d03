"""One worker, in this process, draining no-op jobs: where a job's time and CPU go.

Run on demand: `.venv/bin/python -m tests.bench.drive_worker [--model noop|noop-warm] [--jobs N]
[--profile tottime|cumulative]`. It queues N jobs in bulk (as bench_throughput does), runs one burst
worker built from Settings in this process (one 1024 GiB virtual GPU, 8 jobs at a time), and prints
jobs/s, the worker's CPU per job (user, system, and its model processes), how long a job spends
between its claim and its finish (database clock), and how many claim and finish statements the
jobs shared. With --profile it also prints cProfile's top functions. PostgreSQL: embedded, or the
server in DATABASE_URL.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import resource
import time
from pathlib import Path

from sqlalchemy import text

from app import db, modelsfile, storage
from app.queue import factory
from app.queue import manager as manager_
from app.settings import Settings
from tests.bench import bench_queue as bq
from tests.bench import bench_throughput as bt

SPANS = text(
    """
    SELECT percentile_cont(ARRAY[0.5, 0.9, 0.99]) WITHIN GROUP (
               ORDER BY extract(epoch FROM finished_at - started_at) * 1000),
           count(*) FILTER (WHERE state = 'succeeded'), count(DISTINCT started_at),
           count(DISTINCT finished_at)
    FROM jobs
    """
)


async def drive(url: str, tmp: Path, model: str, jobs: int, profile: str | None) -> None:
    """Queue, drain with one in-process worker, print the figures."""
    models_file = bt.write_models(tmp)
    engine, queue_engine = (
        db.create_engine(url, pool_size=8),
        db.create_queue_engine(url),
    )  # as `gpujobs worker`
    run = bt.Run(bq.Bench(url, engine, tmp, models_file), url, tmp / "storage")
    await bt.bulk_enqueue(run, model, jobs)
    settings = Settings(
        database_url=url, models_file=models_file, storage_dir=tmp / "storage", gpus="1024GiB",
        vram_buffer_mb=0, max_jobs_per_gpu=bt.WORKER_SLOTS, retention_days=0, worker_name="drive",
    )  # fmt: skip
    worker = factory.build_worker(
        settings,
        manager=manager_.JobManager(engine, queue_engine=queue_engine),
        store=storage.ResultStore(settings.storage_dir),
        models=modelsfile.load_registry(models_file),
        listen_dsn=None,
        burst=True,
    )
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    profiler = cProfile.Profile() if profile else None
    started = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    await worker.run()
    if profiler is not None:
        profiler.disable()
    took_s = time.perf_counter() - started
    own2, children2 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    async with engine.connect() as conn:
        spans, ok, claims, finishes = (await conn.execute(SPANS)).one()
    await queue_engine.dispose()
    await engine.dispose()
    per_job = 1000 / max(ok, 1)
    models_s = children2.ru_utime + children2.ru_stime - children.ru_utime - children.ru_stime
    print(f"{model}: {ok} jobs in {took_s:.2f} s = {ok / took_s:.0f} jobs/s")
    print(
        f"worker CPU per job: user {(own2.ru_utime - own.ru_utime) * per_job:.2f} ms, "
        f"system {(own2.ru_stime - own.ru_stime) * per_job:.2f} ms, models {models_s * per_job:.2f} ms"
    )
    print("claim to finish, ms p50 / p90 / p99: " + " / ".join(f"{v:.1f}" for v in spans))
    print(f"claim statements {claims}, finish statements {finishes}, for {ok} jobs")
    if profiler is not None:
        pstats.Stats(profiler).sort_stats(profile).print_stats(40)


async def main_async(args: argparse.Namespace, tmp: Path) -> None:
    with bq.postgres_server(tmp) as (server_url, _source):
        async with bq.bench_database(server_url) as url:
            await drive(url, tmp, args.model, args.jobs, args.profile)


def main() -> None:
    """Parse the arguments, run, clean up."""
    parser = argparse.ArgumentParser(
        prog="python -m tests.bench.drive_worker", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model", choices=("noop", "noop-warm"), default="noop-warm")
    parser.add_argument("--jobs", type=int, default=3000)
    parser.add_argument("--profile", choices=("tottime", "cumulative"), default=None)
    args = parser.parse_args()
    bq.in_temp_folder("gpujobs-drive-", lambda tmp: main_async(args, tmp))


if __name__ == "__main__":
    main()
