"""Throughput benchmarks: jobs/s against procrastinate, NOTIFY latency, uploads against PostgreSQL alone.

Run on demand, never by pytest: `.venv/bin/python -m tests.bench.bench_throughput [--jobs N] [--quick]
[--repeat N]`. It prints numbers and asserts nothing. PostgreSQL is a fresh embedded server in a
temporary folder, or the server in DATABASE_URL (then the databases `gpujobs_bench_<pid>` and
`gpujobs_bench_<pid>_procrastinate` are created there and dropped at the end). The procrastinate
line needs the `bench` extra; without it that line is skipped with a message. See
tests/bench/README.md for what each number means.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import functools
import hashlib
import importlib
import io
import os
import resource
import shutil
import signal
import socket
import statistics
import struct
import sys
import tempfile
import time
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg
import httpx
import numpy as np
from PIL import Image
from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine

from app import auth, db, images, modelsfile
from app.queue import manager as manager_
from app.queue import records
from app.queue.sql import QUEUED_CHANNEL
from tests import dbadmin
from tests.bench import bench_queue as bq
from tests.bench import rawhttp, upload_floor

WORKER_SLOTS = 8  # jobs at a time per worker (ours: GPUJOBS_MAX_JOBS_PER_GPU; procrastinate: concurrency)
UPLOAD_CLIENTS = 32
UPLOAD_ROUNDS = 2  # PostgreSQL alone, then the API, twice in turn
UPLOAD_BYTES = 1_000_000
PRIMING_ROUNDS = 4  # standing workers are warmed with this many jobs per slot before the measured batch
PARTS = frozenset({"queue", "standing", "latency", "uploads"})  # --only picks among them

MODELS = """
[models.noop]
description = "Benchmark model: a process that does nothing"
argv = ["/bin/true"]
vram = {{ base_mb = 1 }}
timeout_s = 60
max_attempts = 1
[[models.noop.outputs]]
name = "out.txt"
required = false

[models.noop-warm]
extends = "noop"
description = "Benchmark model: a warm runner that does nothing"
mode = "persistent"
serve_argv = ["{{python}}", "{runner}"]
load_timeout_s = 60
"""

# The persistent no-op model: modelkit does the protocol, the job does nothing.
RUNNER = f"""
import sys
sys.path.insert(0, {str(bq.ROOT)!r})
from app import modelkit
sys.exit(modelkit.serve(lambda: None, lambda model, job: [], name="noop-warm"))
"""

# N queued jobs, each with its `submitted` event, in one statement (created_at a microsecond apart).
BULK_ENQUEUE = text(
    """
    WITH job AS (
        INSERT INTO jobs (owner, model, input_id, megapixels, priority, vram_mb, declared_vram_mb,
                          max_attempts, created_at)
        SELECT 'bench', :model, :input_id, :megapixels, 0, :vram_mb, :vram_mb, 1,
               now() + g * interval '1 microsecond'
        FROM generate_series(1, :count) AS g
        RETURNING id, model, vram_mb
    )
    INSERT INTO job_events (job_id, kind, attempt, detail)
    SELECT id, 'submitted', 0, jsonb_build_object('model', model, 'vram_mb', vram_mb) FROM job
    """
)
SMALL_INPUT = text(
    """
    INSERT INTO inputs (sha256, media_type, width, height, bytes, data)
    VALUES (:sha256, :media_type, :width, :height, :bytes, :data)
    ON CONFLICT (sha256) DO UPDATE SET bytes = EXCLUDED.bytes
    RETURNING id
    """
)
# Our queue read as the procrastinate line reads its own (tests/bench/reference_procrastinate.py):
# each query counts only the jobs queued after `{since}`, a timestamp literal; OURS_MARK gives the
# `since` that leaves out every job queued so far.
OURS_ENDED = (
    "SELECT count(*) FROM jobs"
    " WHERE state IN ('succeeded', 'failed', 'canceled', 'quarantined') AND created_at > {since}"
)
OURS_COUNTS = (
    "SELECT count(*) FILTER (WHERE state = 'succeeded') AS ok,"
    " count(*) FILTER (WHERE state IN ('failed', 'canceled', 'quarantined')) AS bad"
    " FROM jobs WHERE created_at > {since}"
)
OURS_SPAN = (
    "SELECT extract(epoch FROM max(finished_at) - min(started_at)) FROM jobs WHERE created_at > {since}"
)
OURS_FINISHES = "SELECT finished_at AS at FROM jobs WHERE state = 'succeeded' AND created_at > {since}"
NOTIFY_QUEUED = text("SELECT pg_notify(:channel, :model)")  # wakes listening workers at commit
OURS_MARK = "SELECT quote_literal(coalesce(max(created_at), '-infinity')) FROM jobs"
OURS_REGISTERED = "SELECT count(*) FROM workers WHERE state <> 'dead'"
# The statements that claimed jobs and that finished them: a claim sets started_at to its
# transaction's now(), a finish finished_at (successes carried by a claim share its now()).
OURS_STATEMENTS = (
    "SELECT count(DISTINCT started_at) AS claims, count(DISTINCT finished_at) AS finishes"
    " FROM jobs WHERE created_at > {since}"
)


def steady_sql(finishes: str) -> str:
    """SQL: successes per second between the 10th and the 90th percentile of their finish times
    (`finishes` selects one timestamp column, `at`), so neither the workers' start-up nor the last
    stragglers count. Jobs finished together (one statement) share a time: a rate over many."""
    return f"""
        WITH f AS ({finishes}),
        q AS (SELECT percentile_disc(0.1) WITHIN GROUP (ORDER BY at) AS lo,
                     percentile_disc(0.9) WITHIN GROUP (ORDER BY at) AS hi FROM f)
        SELECT count(*) FILTER (WHERE f.at > q.lo AND f.at <= q.hi)
               / nullif(extract(epoch FROM q.hi - q.lo), 0)
        FROM f, q GROUP BY q.lo, q.hi"""


@dataclass(frozen=True, slots=True)
class Sizes:
    """How much work each benchmark does, and where the workers and the API keep their files."""

    jobs: int
    latency_jobs: int
    uploads: int
    upload_timeout_s: float
    storage_parent: Path | None = None  # None: the temporary folder
    parts: frozenset[str] = PARTS  # which of queue, latency, uploads to run
    profile_dir: Path | None = None  # py-spy profiles of the workers go here (raw, one per worker)
    settings: tuple[tuple[str, str], ...] = ()  # GPUJOBS_ settings for the workers and the API (--set)
    upload_client: str = "lean"  # what sends the uploads: "lean" (tests/bench/rawhttp.py) or "httpx"
    repeat: int = 1  # rounds of each queue part (--repeat): the targets are judged on their medians


@dataclass(slots=True)
class Run:
    """The shared bench state plus what this benchmark needs: the server, the figures to judge."""

    bench: bq.Bench
    server_url: str
    storage: Path  # the workers' and the API's storage folders go below it
    profile_dir: Path | None = None
    settings: tuple[tuple[str, str], ...] = ()
    figures: dict[str, dict[int, float]] = field(default_factory=dict)  # round -> value
    round: int = 1  # the round being run (--repeat)
    round_label: str = ""  # ", round 2" in the section names while --repeat runs its rounds

    def figure(self, key: str, value: float) -> None:
        """This round's value of a figure the targets judge."""
        self.figures.setdefault(key, {})[self.round] = value

    def add(self, section: str, measure: str, value: str) -> None:
        """One line of the table."""
        self.bench.add(section, measure, value)


@dataclass(frozen=True, slots=True)
class Cpu:
    """CPU seconds used so far (or between two marks) by this process, its reaped children (workers
    with their models, the API), and the embedded PostgreSQL server (None with DATABASE_URL)."""

    own_s: float
    children_s: float
    postgres_s: float | None

    @classmethod
    def now(cls, run: Run) -> Cpu:
        """The counters now."""
        own = resource.getrusage(resource.RUSAGE_SELF)
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        return cls(
            own.ru_utime + own.ru_stime,
            children.ru_utime + children.ru_stime,
            postgres_cpu_s(run.bench.tmp / "pgdata"),
        )

    def since(self, run: Run) -> Cpu:
        """What was used from this mark until now."""
        return Cpu.now(run).minus(self)

    def minus(self, earlier: Cpu) -> Cpu:
        """What was used between an earlier mark and this one."""
        pg = None
        if self.postgres_s is not None and earlier.postgres_s is not None:
            pg = self.postgres_s - earlier.postgres_s
        return Cpu(self.own_s - earlier.own_s, self.children_s - earlier.children_s, pg)


def postgres_cpu_s(data_dir: Path) -> float | None:
    """CPU seconds of the embedded server: the postmaster with its reaped backends, and live ones."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        return process_tree([int((data_dir / "postmaster.pid").read_text().split()[0])])[0]
    return None


def per_item_ms(seconds: float | None, count: int) -> str:
    """Milliseconds per item, or "n/a"."""
    return "n/a" if seconds is None or not count else f"{1000 * seconds / count:.2f}"


@dataclass(frozen=True, slots=True)
class Drained:
    """How a queue of jobs was drained."""

    ok: int
    bad: int
    wall_s: float
    span_s: float
    codes: list[int]
    finished: bool
    cpu: Cpu
    steady_per_s: float  # successes per second between the 10th and 90th percentile finish times
    output: str = ""  # the last lines of a worker's output, when the queue was not drained
    processes: tuple[int, int] | None = None  # standing workers with their models: before, after
    statements: tuple[int, int] | None = None  # claim statements, statements that finished jobs

    def per_s(self, seconds: float) -> float:
        """Jobs succeeded per second over `seconds`."""
        return self.ok / seconds if seconds > 0 else 0.0


# -- 1. the queue, end to end -----------------------------------------------------------------


def worker_env(run: Run, name: str) -> dict[str, str]:
    """A worker's settings: its own identity and storage, one big virtual GPU, WORKER_SLOTS jobs."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUJOBS_")}
    env.update(
        GPUJOBS_WORKER_NAME=name,
        GPUJOBS_DATABASE_URL=run.bench.url,
        GPUJOBS_MODELS_FILE=str(run.bench.models_file),
        GPUJOBS_STORAGE_DIR=str(run.storage / name),
        GPUJOBS_GPUS="1024GiB",
        GPUJOBS_VRAM_BUFFER_MB="0",
        GPUJOBS_MAX_JOBS_PER_GPU=str(WORKER_SLOTS),
        GPUJOBS_RETENTION_DAYS="0",
        GPUJOBS_LOG_LEVEL="WARNING",
    )
    env.update(run.settings)
    return env


def start_worker(run: Run, name: str, *, burst: bool) -> bq.Child:
    """`python -m app worker [--burst]`, reaped by the bench whatever happens."""
    argv = [sys.executable, "-m", "app", "worker", *(["--burst"] if burst else [])]
    if run.profile_dir is not None:  # sampled by py-spy, with the processes it starts
        out = run.profile_dir / f"{name}.txt"
        argv = [str(Path(sys.executable).parent / "py-spy"), "record", "-r", "250", "-f", "raw",
                "--subprocesses", "-o", str(out), "--", *argv]  # fmt: skip
    return bq.start_child(run.bench, argv, run.bench.tmp / f"{name}.log", worker_env(run, name))


async def small_input(run: Run) -> tuple[int, float]:
    """The one stored 64x48 PNG every queued job points at: (input id, megapixels)."""
    image = images.inspect(bq.png_bytes((64, 48)), max_pixels=10**8)
    async with run.bench.engine.begin() as conn:
        return int(await conn.scalar(SMALL_INPUT, image.row_values())), image.megapixels


async def bulk_enqueue(run: Run, model: str, count: int) -> float:
    """Queue `count` jobs of `model` in one statement, with one NOTIFY for listening workers;
    returns jobs per second."""
    input_id, megapixels = await small_input(run)
    vram_mb = modelsfile.load_registry(run.bench.models_file).get(model).estimate_vram_mb(megapixels)
    values = {"model": model, "input_id": input_id, "megapixels": megapixels, "vram_mb": vram_mb}
    started = time.perf_counter()
    async with run.bench.engine.begin() as conn:
        await conn.execute(BULK_ENQUEUE, {**values, "count": count})
        await conn.execute(NOTIFY_QUEUED, {"channel": QUEUED_CHANNEL, "model": model})
    took_s = time.perf_counter() - started
    await dbadmin.admin(run.bench.url, "ANALYZE")  # as autovacuum would have, given time
    return count / took_s


@dataclass(frozen=True, slots=True)
class Queue:
    """Where a queue lives, how its workers start and how to read it. The SQL templates count only
    the jobs queued after `since` (see OURS_ENDED): jobs ended, (ok, bad), seconds from the first
    start to the last end, the successes' finish times (one column `at`, see steady_sql). `mark`
    gives the `since` that leaves out every job queued so far; `registered` counts live workers."""

    url: str
    start: Callable[[int], bq.Child]  # starts worker i
    enqueue: Callable[[int], Awaitable[float]]  # queues n jobs in bulk; returns jobs/s
    ended: str
    counts: str
    span: str
    finishes: str
    mark: str
    registered: str
    since: str
    statements: str | None = None  # (claims, finishes): how many statements the jobs shared

    def sql(self, template: str) -> str:
        """`template` for the jobs this queue counts."""
        return template.format(since=self.since)


@contextlib.asynccontextmanager
async def queue_engine(run: Run, queue: Queue) -> AsyncIterator[AsyncEngine]:
    """An engine on the queue's database (the bench's own, or a small one for the reference)."""
    if queue.url == run.bench.url:
        yield run.bench.engine
        return
    engine = db.create_engine(queue.url, pool_size=2)
    try:
        yield engine
    finally:
        await engine.dispose()


async def read_out(
    engine: AsyncEngine, queue: Queue, wall_s: float, codes: list[int], finished: bool, used: Cpu, output: str
) -> Drained:
    """The counts and times of a drained queue."""
    async with engine.connect() as conn:
        counts = (await conn.execute(text(queue.sql(queue.counts)))).one()
        span = await conn.scalar(text(queue.sql(queue.span)))
        steady = await conn.scalar(text(steady_sql(queue.sql(queue.finishes))))
        statements = None
        if queue.statements is not None:
            claims, finishes = (await conn.execute(text(queue.sql(queue.statements)))).one()
            statements = int(claims), int(finishes)
    return Drained(
        int(counts.ok), int(counts.bad), wall_s, float(span or 0), codes, finished, used, float(steady or 0),
        "" if finished else output, statements=statements,
    )  # fmt: skip


async def drain(run: Run, queue: Queue, workers: int, jobs: int) -> Drained:
    """Start `workers` burst workers, wait until `jobs` jobs have ended, reap them."""
    async with queue_engine(run, queue) as engine:
        started, cpu = time.perf_counter(), Cpu.now(run)
        children = [queue.start(i) for i in range(workers)]
        done = f"SELECT ({queue.sql(queue.ended)}) >= {jobs}"
        finished = await bq.wait_for(engine, done, timeout_s=max(120.0, jobs / 5), workers=children)
        wall_s = time.perf_counter() - started
        codes = await bq.reap_workers(run.bench, children, timeout_s=30)
        return await read_out(engine, queue, wall_s, codes, finished, cpu.since(run), children[0].tail())


async def drain_standing(run: Run, queue: Queue, workers: int, jobs: int) -> tuple[Drained, float]:
    """Workers started first, and warmed by PRIMING_ROUNDS jobs per slot; then `jobs` jobs queued
    in bulk while they listen, and timed until all have ended. Returns that, and the enqueue rate."""
    async with queue_engine(run, queue) as engine:
        children = [queue.start(i) for i in range(workers)]

        async def not_ready() -> tuple[Drained, float]:
            return await read_out(engine, queue, 0.0, [], False, Cpu(0, 0, None), children[0].tail()), 0.0

        try:
            up = f"SELECT ({queue.registered}) >= {workers}"
            if not await bq.wait_for(engine, up, timeout_s=120, workers=children):
                return await not_ready()
            await asyncio.sleep(0.5)  # let the LISTEN connections settle
            priming = workers * WORKER_SLOTS * PRIMING_ROUNDS
            await queue.enqueue(priming)
            primed = f"SELECT ({queue.sql(queue.ended)}) >= {priming}"
            if not await bq.wait_for(engine, primed, timeout_s=120, workers=children):
                return await not_ready()
            async with engine.connect() as conn:
                queue = dataclasses.replace(queue, since=str(await conn.scalar(text(queue.mark))))
            pids = [child.proc.pid for child in children]
            started, cpu, (tree_s, before) = time.perf_counter(), Cpu.now(run), process_tree(pids)
            enqueue_per_s = await queue.enqueue(jobs)
            done = f"SELECT ({queue.sql(queue.ended)}) >= {jobs}"
            finished = await bq.wait_for(engine, done, timeout_s=max(120.0, jobs / 5), workers=children)
            wall_s = time.perf_counter() - started
            used, (tree_end_s, after) = cpu.since(run), process_tree(pids)
            used = dataclasses.replace(used, children_s=used.children_s + tree_end_s - tree_s)
        finally:
            stop_workers(children)
            codes = await bq.reap_workers(run.bench, children, timeout_s=30)
        drained = await read_out(engine, queue, wall_s, codes, finished, used, children[0].tail())
        return dataclasses.replace(drained, processes=(before, after)), enqueue_per_s


def stop_workers(children: Sequence[bq.Child]) -> None:
    """SIGTERM each standing worker still running. Under --profile our workers' child is py-spy:
    the worker it started gets the signal, and py-spy writes its profile once that has ended."""
    started_by: dict[int, list[int]] | None = None  # read from /proc only under --profile
    for child in children:
        if not child.poll():
            pids = [child.proc.pid]
            if Path(str(child.proc.args[0])).name == "py-spy":  # type: ignore[index]
                started_by = process_table()[1] if started_by is None else started_by
                pids = started_by.get(child.proc.pid, [])
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)


def process_table() -> tuple[dict[int, int], dict[int, list[int]]]:
    """From /proc: each live process's CPU ticks (with the children it reaped), and each one's
    children."""
    ticks: dict[int, int] = {}
    children: dict[int, list[int]] = collections.defaultdict(list)
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError, IndexError):
            if entry.name.isdigit():
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                ticks[int(entry.name)] = sum(int(f) for f in fields[11:15])  # utime, stime, cutime, cstime
                children[int(fields[1])].append(int(entry.name))
    return ticks, children


def process_tree(roots: Sequence[int]) -> tuple[float, int]:
    """(CPU seconds, processes) of live processes and all their descendants; the CPU includes the
    children each has reaped (a warm runner that ended counts in its worker's)."""
    ticks, children = process_table()
    total, count, todo = 0, 0, list(roots)
    while todo:
        pid = todo.pop()
        if pid in ticks:
            total, count = total + ticks[pid], count + 1
        todo.extend(children.get(pid, ()))
    return total / os.sysconf("SC_CLK_TCK"), count


def report(run: Run, section: str, drained: Drained, enqueue_per_s: float, *, standing: bool = False) -> None:
    """The lines of one drained queue."""
    when = "while the workers listen" if standing else "before the workers start"
    run.add(section, f"enqueue (bulk, {when})", f"{enqueue_per_s:,.0f} jobs/s")
    if not drained.finished:
        run.add(section, bq.NOT_DRAINED, f"{drained.ok} succeeded; {drained.output}")
    run.add(section, "jobs/s, first start to last finish", f"{drained.per_s(drained.span_s):.0f}")
    wall = "from the enqueue" if standing else "incl. worker start"
    run.add(section, f"jobs/s, wall ({wall})", f"{drained.per_s(drained.wall_s):.0f}")
    run.add(section, "jobs/s, steady (10th to 90th percentile of finishes)", f"{drained.steady_per_s:.0f}")
    if drained.processes is not None:
        before, after = drained.processes
        run.add(section, "processes: workers with their models, before / after", f"{before} / {after}")
    workers_ms = per_item_ms(drained.cpu.children_s, drained.ok)
    cpu = "CPU ms/job" if standing else "CPU ms/job, start-up incl."
    run.add(section, f"{cpu}: workers and their models / PostgreSQL",
            f"{workers_ms} / {per_item_ms(drained.cpu.postgres_s, drained.ok)}")  # fmt: skip
    if drained.statements is not None and drained.ok:
        claims, finishes = (100 * n / drained.ok for n in drained.statements)
        run.add(section, "statements per 100 jobs: claims / finishing", f"{claims:.1f} / {finishes:.1f}")
    run.add(section, "succeeded / failed; worker exit codes",
            f"{drained.ok} / {drained.bad}; {' '.join(map(str, drained.codes))}")  # fmt: skip


def plural(n_workers: int) -> str:
    """The words for a worker count: 1 worker, 4 workers."""
    return f"{n_workers} worker{'s' if n_workers > 1 else ''}"


async def measure_queue(run: Run, queue: Queue, key: str, label: str, jobs: int, n_workers: int, *,
                        standing: bool) -> None:  # fmt: skip
    """One line of section 1 (burst workers started after a bulk enqueue) or of section 1b
    (standing workers, warmed first); its rates go into run.figures under `key`."""
    if standing:
        drained, enqueue_per_s = await drain_standing(run, queue, n_workers, jobs)
        section = f"1b. {plural(n_workers)}, standing and warmed{run.round_label}: {label}"
        key = f"{key}/{n_workers}/standing"
    else:
        enqueue_per_s = await queue.enqueue(jobs)
        drained = await drain(run, queue, n_workers, jobs)
        section = f"1. {plural(n_workers)}{run.round_label}: {label}"
        key = f"{key}/{n_workers}"
    report(run, section, drained, enqueue_per_s, standing=standing)
    run.figure(key, drained.per_s(drained.span_s))
    run.figure(f"{key}/steady", drained.steady_per_s)


async def ours(run: Run, model: str, label: str, jobs: int, n_workers: int, *, standing: bool) -> None:
    """`jobs` jobs of `model` queued in bulk and drained by `n_workers` workers."""
    await bq.reset(run.bench.engine)

    def start(i: int) -> bq.Child:
        kind = "standing" if standing else "burst"
        return start_worker(run, f"tp-{model}-{n_workers}-{kind}-{i}", burst=not standing)

    queue = Queue(
        run.bench.url, start, functools.partial(bulk_enqueue, run, model), OURS_ENDED, OURS_COUNTS, OURS_SPAN,
        OURS_FINISHES, OURS_MARK, OURS_REGISTERED, "'-infinity'", OURS_STATEMENTS,
    )  # fmt: skip
    await measure_queue(run, queue, model, f"gpujobs, {label}", jobs, n_workers, standing=standing)


async def queues(run: Run, jobs: int, *, standing: bool, repeat: int = 1) -> None:
    """Both modes and the reference, side by side for 1 worker, then 4: close in time, since other
    work on the machine drifts. Burst workers started after the jobs were queued, or standing ones.
    With `repeat` > 1 the whole sequence runs that many times (each round's lines are named)."""
    async with reference_database(run) as reference_url:
        for number in range(1, repeat + 1):
            run.round, run.round_label = number, f", round {number}" if repeat > 1 else ""
            for n_workers in (1, 4):
                await ours(run, "noop", "oneshot /bin/true", jobs, n_workers, standing=standing)
                await ours(run, "noop-warm", "persistent no-op", jobs, n_workers, standing=standing)
                if reference_url is not None:
                    await reference(run, reference_url, jobs, n_workers, standing=standing)
        run.round, run.round_label = 1, ""


# -- 1. the reference: procrastinate ----------------------------------------------------------


@contextlib.asynccontextmanager
async def empty_database(server_url: str, name: str) -> AsyncIterator[str]:
    """A new, empty database on the bench's server (URL), dropped on the way out."""
    await dbadmin.admin(server_url, f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    await dbadmin.admin(server_url, f"CREATE DATABASE {name}")
    try:
        yield make_url(server_url).set(database=name).render_as_string(hide_password=False)
    finally:
        await dbadmin.admin(server_url, f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def procrastinate_missing() -> str | None:
    """Why the reference line cannot run, or None."""
    for module in ("procrastinate", "psycopg"):
        try:
            importlib.import_module(module)
        except ImportError as exc:
            return f"{module} cannot be imported ({exc}): pip install -e '.[bench]'"
    return None


@contextlib.asynccontextmanager
async def reference_database(run: Run) -> AsyncIterator[str | None]:
    """procrastinate's own database on the same server, with its schema; None if it cannot run."""
    missing = procrastinate_missing()
    if missing:
        print(f"procrastinate reference line skipped: {missing}", file=sys.stderr)
        run.add("1. procrastinate (reference)", "not run", missing)
        yield None
        return
    from tests.bench import reference_procrastinate as rp

    async with empty_database(run.server_url, f"gpujobs_bench_{os.getpid()}_procrastinate") as url:
        await rp.prepare(db.asyncpg_dsn(url))
        yield url


async def reference(run: Run, url: str, jobs: int, n_workers: int, *, standing: bool) -> None:
    """The same no-op jobs through procrastinate: queued in bulk, drained by `n_workers` workers."""
    from tests.bench import reference_procrastinate as rp

    dsn = db.asyncpg_dsn(url)
    await dbadmin.admin(url, rp.RESET)

    async def enqueue(count: int) -> float:
        per_s = await rp.defer(dsn, count)
        # Fresh statistics, as for our queue: on a just-filled table they said "empty", and with
        # 8,000 jobs procrastinate's fetch then cost PostgreSQL 3.9 ms per job instead of 0.7.
        await dbadmin.admin(url, "ANALYZE")
        return per_s

    def start(i: int) -> bq.Child:
        argv = [sys.executable, "-m", "tests.bench.reference_procrastinate", "worker", "--dsn", dsn,
                "--concurrency", str(WORKER_SLOTS), *(["--wait"] if standing else [])]  # fmt: skip
        return bq.start_child(run.bench, argv, run.bench.tmp / f"procrastinate-{n_workers}-{i}.log")

    queue = Queue(url, start, enqueue, rp.ENDED, rp.COUNTS, rp.SPAN, rp.FINISHES, rp.MARK, rp.REGISTERED, "0")
    label = f"procrastinate {rp.version()}, concurrency {WORKER_SLOTS} (reference)"
    await measure_queue(run, queue, "procrastinate", label, jobs, n_workers, standing=standing)


# -- 2. wake-up latency -----------------------------------------------------------------------


async def enqueue_paced(run: Run, count: int, pause_s: float) -> None:
    """Queue `count` noop jobs through JobManager.enqueue (which NOTIFYs), `pause_s` apart."""
    manager = manager_.JobManager(run.bench.engine)
    image = images.inspect(bq.png_bytes((64, 48)), max_pixels=10**8)
    vram_mb = modelsfile.load_registry(run.bench.models_file).get("noop").estimate_vram_mb(image.megapixels)
    job = records.NewJob("bench", "noop", {}, 0, vram_mb, 1)
    for _ in range(count):
        await manager.enqueue(job, image, queue_limit=10**9)
        await asyncio.sleep(pause_s)


async def latency(run: Run, jobs: int) -> None:
    """An idle, listening worker; jobs queued one at a time; created_at -> started_at (DB clock)."""
    section = "2. enqueue -> start, idle worker"
    await bq.reset(run.bench.engine)
    worker = start_worker(run, "tp-latency", burst=False)
    try:
        registered = f"SELECT EXISTS (SELECT 1 FROM workers WHERE id = '{bq.HOST}:tp-latency')"
        if not await bq.wait_for(run.bench.engine, registered, timeout_s=60):
            run.add(section, "worker did not start", worker.tail())
            return
        await asyncio.sleep(0.5)  # let its LISTEN connection settle
        await enqueue_paced(run, jobs, pause_s=0.03)
        started = f"SELECT count(*) = {jobs} FROM jobs WHERE started_at IS NOT NULL"
        await bq.wait_for(run.bench.engine, started, 60)
    finally:
        worker.proc.send_signal(signal.SIGTERM)
        code = (await bq.reap_workers(run.bench, [worker], timeout_s=30))[0]
    query = "SELECT 1000 * extract(epoch FROM started_at - created_at) FROM jobs WHERE started_at IS NOT NULL"
    async with run.bench.engine.connect() as conn:
        values = [float(v) for v in (await conn.scalars(text(query))).all()]
    if len(values) < 2:
        run.add(section, "too few jobs started", f"{len(values)}; log: {worker.tail()}")
        return
    run.add(section, f"latency ms p50/p90/p99/max ({len(values)} jobs, 30 ms apart)", bq.percentiles(values))
    run.add(section, "worker exit code after SIGTERM", str(code))


# -- 3. uploads -------------------------------------------------------------------------------

BOUNDARY = "gpujobs-bench-7f3a9c"
UPLOAD_HEAD = (
    f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="model"\r\n\r\nnoop\r\n'
    f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="image"; filename="bench.png"\r\n'
    "Content-Type: image/png\r\n\r\n"
).encode()
UPLOAD_TAIL = f"\r\n--{BOUNDARY}--\r\n".encode()


@dataclass(frozen=True, slots=True)
class Picture:
    """A PNG of random pixels (noise does not compress, in PNG or in PostgreSQL's TOAST)."""

    data: bytes
    width: int
    height: int

    @classmethod
    def noise(cls, size_bytes: int) -> Picture:
        """About `size_bytes` of RGB noise as a PNG."""
        side = int((size_bytes / 3) ** 0.5)
        pixels = np.random.default_rng(8).integers(0, 256, (side, side, 3), dtype=np.uint8)
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="PNG", compress_level=1)
        return cls(buffer.getvalue(), side, side)

    def variant(self, i: int) -> bytes:
        """The same pixels with a tEXt chunk naming `i` after the header: a distinct sha256 each."""
        data = b"bench\x00" + str(i).encode()
        crc = zlib.crc32(b"tEXt" + data)
        chunk = struct.pack(">I", len(data)) + b"tEXt" + data + struct.pack(">I", crc)
        return self.data[:33] + chunk + self.data[33:]  # 8 signature bytes, then the 25-byte IHDR


@dataclass(frozen=True, slots=True)
class Timed:
    """Requests made concurrently: the latency of each success, the time they took, the failures."""

    latencies_s: list[float]
    elapsed_s: float
    problems: list[str]

    @property
    def rate(self) -> float:
        """Successes per second."""
        return len(self.latencies_s) / self.elapsed_s if self.elapsed_s else 0.0

    def ms(self, q: int) -> float:
        """The q-th percentile of the latencies, in ms."""
        if len(self.latencies_s) < 2:
            return float("nan")
        return 1000 * statistics.quantiles(self.latencies_s, n=100, method="inclusive")[q - 1]


async def clear_inputs(run: Run) -> None:
    """Empty the job and input tables, and checkpoint (so no run pays for the last one's writes)."""
    async with run.bench.engine.begin() as conn:
        await conn.execute(text("TRUNCATE job_events, jobs, inputs, workers"))
    with contextlib.suppress(Exception):  # CHECKPOINT needs a superuser (the embedded server's is)
        await dbadmin.admin(run.bench.url, "CHECKPOINT")


@dataclass(frozen=True, slots=True)
class Measured:
    """Uploads measured in a steady stream, and the CPU they cost: this process (the clients),
    PostgreSQL, and the API process (None for the PostgreSQL-alone reference). `burst_ms`: the
    slowest call of the uncounted first round, in which every client started at once."""

    timed: Timed
    cpu: Cpu
    api_s: float | None = None
    burst_ms: float = float("nan")

    @classmethod
    def pooled(cls, rounds: Sequence[Measured]) -> Measured:
        """Rounds as one: all their calls, their times and their CPU added up."""
        timed = Timed(
            [t for r in rounds for t in r.timed.latencies_s],
            sum(r.timed.elapsed_s for r in rounds),
            [p for r in rounds for p in r.timed.problems],
        )
        pg = [r.cpu.postgres_s for r in rounds]
        cpu = Cpu(
            sum(r.cpu.own_s for r in rounds),
            sum(r.cpu.children_s for r in rounds),
            None if None in pg else sum(x for x in pg if x is not None),
        )
        api = [r.api_s for r in rounds]
        api_s = None if None in api else sum(x for x in api if x is not None)
        return cls(timed, cpu, api_s, max(r.burst_ms for r in rounds))

    def cpu_line(self) -> str:
        """CPU ms per upload, by process."""
        count = len(self.timed.latencies_s) + len(self.timed.problems)
        api = "" if self.api_s is None else f" / API {per_item_ms(self.api_s, count)}"
        postgres = per_item_ms(self.cpu.postgres_s, count)
        return f"bench {per_item_ms(self.cpu.own_s, count)}{api} / PostgreSQL {postgres}"


async def measure(
    run: Run, one: Callable[[int], Awaitable[str | None]], sizes: Sizes, api_pid: int = 0
) -> Measured:
    """UPLOAD_CLIENTS clients, each calling `one(i)` again as soon as its last call ended: a first
    round (uncounted: connections, caches), then `sizes.uploads` measured calls, then one more round
    (uncounted), so every measured call shares the server with as many others. The rate, the
    latencies and the CPU are those of the measured calls, from the start of the first to the end
    of the last. `one` returns a problem, or None."""
    count, clients = sizes.uploads, UPLOAD_CLIENTS
    todo = iter(range(-clients, count + clients))  # shared by the clients: each takes the next
    latencies: list[float] = []
    problems: list[str] = []
    burst: list[float] = []
    marks: list[tuple[float, Cpu, float]] = []  # at the first measured call's start, the last's end
    deadline = time.perf_counter() + sizes.upload_timeout_s

    def mark() -> None:
        marks.append((time.perf_counter(), Cpu.now(run), bq.tree_cpu_s(api_pid)))

    async def client() -> None:
        for i in todo:
            if time.perf_counter() > deadline or len(marks) == 2:
                return
            if i == 0:
                mark()
            started = time.perf_counter()
            problem = await one(i)
            took = time.perf_counter() - started
            if i < 0:
                burst.append(took)
            elif i < count:
                latencies.append(took) if problem is None else problems.append(problem)
                if len(latencies) + len(problems) == count:
                    mark()

    await asyncio.gather(*(client() for _ in range(clients)))
    if len(marks) < 2:  # timed out
        mark()
    (t0, cpu0, api0), (t1, cpu1, api1) = marks[0], marks[-1]
    timed = Timed(latencies, t1 - t0, problems)
    burst_ms = 1000 * max(burst, default=float("nan"))
    return Measured(timed, cpu1.minus(cpu0), api1 - api0 if api_pid else None, burst_ms)


async def insert_uploads(run: Run, picture: Picture, sizes: Sizes) -> Measured:
    """The reference: each image inserted into `inputs` by asyncpg, a pool of UPLOAD_CLIENTS connections."""
    pool = await asyncpg.create_pool(
        db.asyncpg_dsn(run.bench.url), min_size=UPLOAD_CLIENTS, max_size=UPLOAD_CLIENTS
    )
    assert pool is not None
    try:

        async def one(i: int) -> str | None:
            data = picture.variant(i)
            digest = hashlib.sha256(data).hexdigest()
            await pool.execute(
                upload_floor.INSERT, digest, "image/png", picture.width, picture.height, len(data), data
            )
            return None

        return await measure(run, one, sizes)
    finally:
        await pool.close()


def free_port() -> int:
    """A loopback port nobody listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def status_kb(pid: int, key: str) -> int:
    """A `Vm...` line of /proc/<pid>/status, in kB (0 when unreadable)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1])
    return 0


def tree_kb(pid: int, key: str) -> int:
    """A `Vm...` line summed over `pid` and its descendants (the API's processes), in kB."""
    return sum(status_kb(p, key) for p in bq.process_tree(pid))


def api_argv(run: Run, port: int) -> tuple[list[str], dict[str, str]]:
    """`gpujobs serve --no-worker` on `port`, with no queue limit, and no cap on the uploads its one
    key has in progress (UPLOAD_CLIENTS of them): (argv, environment)."""
    env = worker_env(run, "tp-api")
    env.update(GPUJOBS_QUEUE_LIMIT=str(10**8), GPUJOBS_QUEUE_LIMIT_PER_KEY="0", GPUJOBS_UPLOADS_PER_KEY="0")
    argv = [sys.executable, "-m", "app", "serve", "--no-worker", "--host", "127.0.0.1", "--port", str(port)]
    return argv, env


def floor_argv(run: Run, port: int) -> tuple[list[str], dict[str, str]]:
    """The bare ASGI upload app (tests/bench/upload_floor.py) under uvicorn, configured as `serve`
    configures it (the default asyncio loop, httptools, no access log): (argv, environment)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUJOBS_")}
    env.update(UPLOAD_FLOOR_DSN=db.asyncpg_dsn(run.bench.url))
    argv = [sys.executable, "-m", "uvicorn", "tests.bench.upload_floor:app", "--loop", "asyncio",
            "--http", "httptools", "--no-access-log", "--log-level", "warning",
            "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    return argv, env


async def start_server(run: Run, command: Callable[[Run, int], tuple[list[str], dict[str, str]]], name: str
                       ) -> tuple[bq.Child, str]:  # fmt: skip
    """`command` on a free loopback port; (process, base URL) once its /healthz answers."""
    port = free_port()
    argv, env = command(run, port)
    api = bq.start_child(run.bench, argv, run.bench.tmp / f"{name}.log", env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    async with httpx.AsyncClient(base_url=base, timeout=2) as client:
        while time.monotonic() < deadline and not api.poll():
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get("/healthz")).status_code == 200:
                    return api, base
            await asyncio.sleep(0.1)
    raise RuntimeError(f"the API did not start: {api.tail()}")


async def post_uploads(run: Run, api: bq.Child, base: str, picture: Picture, sizes: Sizes) -> Measured:
    """POST /jobs with a distinct 1 MB PNG each, UPLOAD_CLIENTS at a time (one kept-alive connection
    each), by the lean client (tests/bench/rawhttp.py) or, with --upload-client httpx, by httpx."""
    engine = db.create_engine(run.bench.url, pool_size=1)
    try:
        key = (await auth.KeyStore(engine).create("bench", role=auth.Role.user)).secret
    finally:
        await engine.dispose()
    headers = {"Authorization": f"Bearer {key}", "Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}

    def body(i: int) -> bytes:
        return UPLOAD_HEAD + picture.variant(i) + UPLOAD_TAIL

    if sizes.upload_client == "httpx":
        limits = httpx.Limits(max_connections=UPLOAD_CLIENTS, max_keepalive_connections=UPLOAD_CLIENTS)
        async with httpx.AsyncClient(base_url=base, headers=headers, limits=limits, timeout=120) as client:

            async def by_httpx(i: int) -> str | None:
                try:
                    response = await client.post("/jobs", content=body(i))
                except httpx.TransportError as exc:  # counted and shown, not fatal to the whole bench
                    return f"{type(exc).__name__}: {exc}"
                if response.status_code != 201:
                    return f"{response.status_code} {response.text[:200]}"
                return None

            return await measure(run, by_httpx, sizes, api.proc.pid)
    url = httpx.URL(base)
    connections = rawhttp.Connections(url.host, url.port or 80)

    async def by_lean_client(i: int) -> str | None:
        data = body(i)
        head = rawhttp.request_head("POST", f"{url.host}:{url.port}", "/jobs", headers, len(data))
        try:
            answer = await connections.send(head, data)
        except (OSError, rawhttp.BadAnswer) as exc:  # counted and shown, as above
            return f"{type(exc).__name__}: {exc}"
        return None if answer.status == 201 else f"{answer.status} {answer.body[:200]!r}"

    try:
        return await measure(run, by_lean_client, sizes, api.proc.pid)
    finally:
        await connections.close()


async def api_uploads(
    run: Run, picture: Picture, sizes: Sizes, *, floor: bool = False
) -> tuple[Measured, int, int]:
    """The uploads through the API (`gpujobs serve --no-worker`, one process or a parent and its
    children), or with `floor` through the bare ASGI app; (measures, its RSS before, its peak RSS)
    in kB, summed over its processes."""
    command, name = (floor_argv, "tp-floor") if floor else (api_argv, "tp-api")
    api, base = await start_server(run, command, name)
    try:
        idle_kb = tree_kb(api.proc.pid, "VmRSS")
        measured = await post_uploads(run, api, base, picture, sizes)
        return measured, idle_kb, tree_kb(api.proc.pid, "VmHWM")
    finally:
        api.proc.send_signal(signal.SIGTERM)
        await api.reap(timeout_s=30)


def timed_line(timed: Timed, unit: str) -> str:
    """Rate, MB/s, p50 / p99, failures."""
    mb_s = timed.rate * UPLOAD_BYTES / 1e6
    bad = f"; {len(timed.problems)} failed, first: {timed.problems[0]}" if timed.problems else ""
    rate = f"{timed.rate:.0f} {unit}/s ({mb_s:.0f} MB/s)"
    return f"{rate}   p50 {timed.ms(50):.0f} ms, p99 {timed.ms(99):.0f} ms{bad}"


def check_ms(picture: Picture, count: int = 200) -> str:
    """What the API's check of one upload costs, in this process: the median of `count` runs of
    `images.inspect_quickly` (the header, every chunk's CRC, the inflate, SHA-256)."""
    data, took = picture.variant(0), []
    for _ in range(count):
        started = time.process_time()
        images.inspect_quickly(data, max_pixels=picture.width * picture.height)
        took.append(time.process_time() - started)
    return f"{1000 * statistics.median(took):.2f}"


async def uploads(run: Run, sizes: Sizes) -> None:
    """The same 1 MB PNGs into PostgreSQL alone, then through POST /jobs, UPLOAD_ROUNDS times in
    turn; each line pools the rounds. An uncounted round primes the server first: PostgreSQL makes
    new WAL files (and writes them full of zeros) until it has enough to recycle, which halved the
    rate of whichever side came first."""
    section = f"3. uploads, 1 MB PNGs, {UPLOAD_CLIENTS} clients"
    picture = Picture.noise(UPLOAD_BYTES)
    await clear_inputs(run)
    await insert_uploads(run, picture, sizes)
    pg_rounds: list[Measured] = []
    api_rounds: list[Measured] = []
    floor_rounds: list[Measured] = []
    idle_kb = peak_kb = 0
    for _ in range(UPLOAD_ROUNDS):
        await clear_inputs(run)
        pg_rounds.append(await insert_uploads(run, picture, sizes))
        await clear_inputs(run)
        measured, idle_kb, peak = await api_uploads(run, picture, sizes)
        api_rounds.append(measured)
        peak_kb = max(peak_kb, peak)
        await clear_inputs(run)
        floor_rounds.append((await api_uploads(run, picture, sizes, floor=True))[0])
    await clear_inputs(run)
    pg, api, floor = (Measured.pooled(r) for r in (pg_rounds, api_rounds, floor_rounds))
    rounds = f"{UPLOAD_ROUNDS} rounds of {sizes.uploads}"
    run.add(section, f"PostgreSQL alone: INSERT into inputs ({rounds} rows)", timed_line(pg.timed, "rows"))
    run.add(section, "  each round", " | ".join(f"{r.timed.rate:.0f} rows/s" for r in pg_rounds))
    run.add(section, "  CPU ms per row", pg.cpu_line())
    run.add(section, "  first round, all clients at once (not counted): slowest", f"{pg.burst_ms:.0f} ms")
    run.add(section, f"POST /jobs over HTTP ({rounds} requests)", timed_line(api.timed, "req"))
    run.add(section, "  each round", " | ".join(f"{r.timed.rate:.0f} req/s" for r in api_rounds))
    run.add(section, "  CPU ms per request", api.cpu_line())
    run.add(section, "  first round, all clients at once (not counted): slowest", f"{api.burst_ms:.0f} ms")
    bare = "bare ASGI app, one process: uvicorn + asyncpg, no framework, form parser, check or job"
    run.add(section, f"{bare} ({rounds} requests)", timed_line(floor.timed, "req"))
    run.add(section, "  each round", " | ".join(f"{r.timed.rate:.0f} req/s" for r in floor_rounds))
    run.add(section, "  CPU ms per request", floor.cpu_line())
    processes = dict(run.settings).get("GPUJOBS_API_PROCESSES", "1")
    run.add(section, "API processes (GPUJOBS_API_PROCESSES; --set to change)", processes)
    run.add(section, "the image check alone (images.inspect_quickly), CPU ms per image", check_ms(picture))
    memory = f"{idle_kb / 1024:.0f} MB / {peak_kb / 1024:.0f} MB"
    run.add(section, "API RSS, its processes summed: idle / peak (VmHWM)", memory)
    run.figure("upload ratio", api.timed.rate / pg.timed.rate if pg.timed.rate else 0.0)
    run.figure("upload p99/p50", api.timed.ms(99) / api.timed.ms(50))
    run.figure("pg p99/p50", pg.timed.ms(99) / pg.timed.ms(50))
    run.figure("floor ratio", floor.timed.rate / pg.timed.rate if pg.timed.rate else 0.0)


# -- 4. against the targets -------------------------------------------------------------------


def ratios(ours: dict[int, float], reference: dict[int, float]) -> list[float]:
    """Each round's ratio of our rate to the reference's, in round order, for the rounds where
    both sides ran (side by side)."""
    return [ours[n] / reference[n] for n in sorted(ours.keys() & reference.keys()) if reference[n]]


def judged(values: list[float], unit: str) -> str:
    """A figure judged on its median; with several rounds, each round's value after it."""
    median = f"{statistics.median(values):.2f}{unit}"
    if len(values) < 2:
        return median
    return f"{median}, median of {len(values)} rounds ({', '.join(f'{v:.2f}' for v in values)})"


def targets(run: Run) -> None:
    """Each figure the issue sets a target for, next to its target (medians of the rounds)."""
    section, f = "4. against the targets", run.figures
    for kind, words in (("", ""), ("/standing", ", standing and warmed")):
        for n in (1, 4):
            if each := ratios(f.get(f"noop-warm/{n}{kind}", {}), f.get(f"procrastinate/{n}{kind}", {})):
                run.add(section, f"persistent / procrastinate jobs/s, {plural(n)}{words}",
                        f"{judged(each, 'x')} (target >= 2x)")  # fmt: skip
            key = f"{n}{kind}/steady"
            if steady := ratios(f.get(f"noop-warm/{key}", {}), f.get(f"procrastinate/{key}", {})):
                measure = "  the same, steady rates (10th to 90th percentile of finishes)"
                run.add(section, measure, judged(steady, "x"))
        lines = (f"noop/1{kind}", f"noop/4{kind}")
        oneshot = [statistics.median(f[key].values()) for key in lines if key in f]
        if oneshot:
            best = f"{max(oneshot):.0f} (target about 1000)"
            run.add(section, f"oneshot /bin/true, best jobs/s{words}", best)
    if "upload ratio" in f:
        # Uploads run once per bench run: one value each.
        percent, tail, pg_tail, floor = (
            f[k][1] for k in ("upload ratio", "upload p99/p50", "pg p99/p50", "floor ratio")
        )
        run.add(section, "POST /jobs rate / PostgreSQL's", f"{100 * percent:.0f} % (target >= 90 %)")
        run.add(
            section, "  the bare ASGI app's rate / PostgreSQL's (the stack's floor)", f"{100 * floor:.0f} %"
        )
        run.add(section, "POST /jobs p99 / p50",
                f"{tail:.2f}x (target <= 1.5x; PostgreSQL alone {pg_tail:.2f}x)")  # fmt: skip


# -- the run ----------------------------------------------------------------------------------


def the_end(run: Run) -> None:
    """Peak RSS of the workers and of this process; the load at the end."""
    if run.bench.worker_rss_kb:
        run.add("5. the end", "peak RSS of one worker process", f"{run.bench.worker_rss_kb / 1024:.0f} MB")
    own_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    run.add("5. the end", "peak RSS of this bench process", f"{own_kb / 1024:.0f} MB")
    run.add("5. the end", "load average (1 min) at the end", bq.load_average())


async def run_all(run: Run, sizes: Sizes, source: str) -> None:
    """Every benchmark, in order."""
    await bq.machine(run.bench, source)
    run.add(
        "0. machine",
        "workers' storage; database files",
        f"{filesystem(run.storage)}; {filesystem(run.bench.tmp)}",
    )
    if run.settings:
        run.add("0. machine", "settings given with --set", " ".join(f"{k}={v}" for k, v in run.settings))
    if "queue" in sizes.parts:
        await queues(run, sizes.jobs, standing=False, repeat=sizes.repeat)
    if "standing" in sizes.parts:
        await queues(run, sizes.jobs, standing=True, repeat=sizes.repeat)
    if "latency" in sizes.parts:
        await latency(run, sizes.latency_jobs)
    if "uploads" in sizes.parts:
        await uploads(run, sizes)
    targets(run)
    the_end(run)


def write_models(tmp: Path) -> Path:
    """The registry file (noop, noop-warm) and the warm runner's script, in the temp folder."""
    runner = tmp / "noop_runner.py"
    runner.write_text(RUNNER)
    models_file = tmp / "bench-models.toml"
    models_file.write_text(MODELS.format(runner=runner))
    return models_file


def filesystem(path: Path) -> str:
    """The type and mount point of the file system holding `path` (from /proc/mounts)."""
    best = ("?", "")
    with contextlib.suppress(OSError):
        for line in Path("/proc/mounts").read_text().splitlines():
            _, mount, kind, *_ = line.split()
            if path.resolve().is_relative_to(mount) and len(mount) >= len(best[1]):
                best = (kind, mount)
    return f"{best[0]} on {best[1] or '?'}"


async def bench_main(sizes: Sizes, tmp: Path, storage: Path) -> list[tuple[str, str, str]]:
    """Start PostgreSQL and the bench database, run everything, clean up (also after SIGTERM)."""
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    models_file = write_models(tmp)
    with bq.postgres_server(tmp) as (server_url, source):
        async with bq.bench_database(server_url) as url:
            engine = db.create_engine(url, pool_size=8)
            bench = bq.Bench(url, engine, tmp, models_file)
            run = Run(bench, server_url, storage, sizes.profile_dir, sizes.settings)
            try:
                await run_all(run, sizes, source)
            finally:
                await asyncio.shield(bq.reap_leftovers(run.bench))
                await engine.dispose()
    return run.bench.rows


def parse_args(argv: list[str] | None = None) -> Sizes:
    """--jobs N, --quick, --storage-dir, --only."""
    parser = argparse.ArgumentParser(
        prog="python -m tests.bench.bench_throughput", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--jobs", type=int, default=None, help="jobs per queue run (default 2000)")
    parser.add_argument("--quick", action="store_true", help="smaller sizes: a smoke run of every part")
    parser.add_argument(
        "--storage-dir", type=Path, default=None, help="parent folder of the workers' storage (e.g. /dev/shm)"
    )
    parser.add_argument(
        "--only", choices=sorted(PARTS), action="append", help="run only this part (repeatable; default all)"
    )
    parser.add_argument(
        "--profile", type=Path, default=None, metavar="DIR",
        help="run each worker under py-spy (pip install py-spy); one raw flame file per worker in DIR",
    )  # fmt: skip
    parser.add_argument(
        "--set", action="append", default=[], metavar="GPUJOBS_NAME=VALUE", dest="settings",
        help="a setting for the workers and the API, e.g. GPUJOBS_CLAIM_GATHER_S=0 (repeatable)",
    )  # fmt: skip
    parser.add_argument(
        "--repeat", type=int, default=1, metavar="N",
        help="run the queue parts N times in turn; the targets are judged on the rounds' medians",
    )  # fmt: skip
    parser.add_argument(
        "--upload-client", choices=("lean", "httpx"), default="lean",
        help="what sends the uploads: the lean HTTP/1.1 client (default) or httpx, as before",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error(f"--repeat wants a count of 1 or more, got {args.repeat}")
    settings = tuple(_setting(parser, text) for text in args.settings)
    parts = frozenset(args.only or PARTS)
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
    if args.quick:
        sizes = Sizes(args.jobs or 200, 30, 96, 30)
    else:
        sizes = Sizes(args.jobs or 2000, 200, 640, 120)
    return dataclasses.replace(
        sizes, storage_parent=args.storage_dir, parts=parts, profile_dir=args.profile, settings=settings,
        upload_client=args.upload_client, repeat=args.repeat,
    )  # fmt: skip


def _setting(parser: argparse.ArgumentParser, text: str) -> tuple[str, str]:
    """`GPUJOBS_NAME=VALUE` as a pair; exits with a usage error for anything else."""
    name, equals, value = text.partition("=")
    if not equals or not name.startswith("GPUJOBS_"):
        parser.error(f"--set wants GPUJOBS_NAME=VALUE, got {text!r}")
    return name, value


def main(argv: list[str] | None = None) -> None:
    """Run the benchmarks and print the table."""
    sizes = parse_args(argv)
    bq.compile_app()
    tmp = Path(tempfile.mkdtemp(prefix="gpujobs-bench-"))
    storage = tmp / "storage"
    if sizes.storage_parent is not None:
        storage = Path(tempfile.mkdtemp(prefix="gpujobs-bench-storage-", dir=sizes.storage_parent))
    started = time.perf_counter()
    try:
        rows = asyncio.run(bench_main(sizes, tmp, storage))
    except (KeyboardInterrupt, asyncio.CancelledError):
        sys.exit("interrupted; subprocesses reaped, databases and temporary folders removed")
    finally:
        shutil.rmtree(storage, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
    bq.print_table(rows)
    print(f"(total {time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
