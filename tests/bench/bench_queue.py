"""Queue benchmarks: end-to-end throughput, wake-up latency, claim rate, `relief` run time.

Run on demand, never by pytest: `.venv/bin/python -m tests.bench.bench_queue [--jobs N] [--quick]`.
It prints numbers and asserts nothing. PostgreSQL is a fresh embedded server in a temporary
folder, or the server in DATABASE_URL (then a database `gpujobs_bench_<pid>` is created there and
dropped at the end). See tests/bench/README.md for what each number means.
"""

from __future__ import annotations

import argparse
import asyncio
import compileall
import contextlib
import io
import json
import os
import platform
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image
from sqlalchemy import event, text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.util import greenlet_spawn

import app
from app import db, images, migrate, modelsfile, pgserver, settings
from app.queue import manager as manager_
from app.queue import records
from tests import dbadmin

ROOT = Path(__file__).resolve().parents[2]
HOST = socket.gethostname()
BUDGET_MB = 24_000  # the claim benchmark's one GPU
POLL_S = 0.05

NOOP_MODEL = """
[models.noop]
description = "Benchmark model: does nothing"
argv = ["/bin/true"]
vram = { base_mb = 100 }
timeout_s = 60
max_attempts = 1
[[models.noop.outputs]]
name = "out.txt"
required = false
"""

# DESIGN.md's naive claim: one fit filter on table rows, walked in (priority, created_at) order.
# A reference line only; it writes no event, so it does a little less work than sql.CLAIM.
NAIVE_INDEX = "CREATE INDEX ix_bench_naive ON jobs (priority DESC, created_at) WHERE state = 'queued'"
NAIVE_CLAIM = text(
    """
    UPDATE jobs SET state = 'running', attempt = attempt + 1, worker_id = :worker_id,
           lease_expires_at = now() + interval '60 seconds', started_at = now()
    WHERE id = (SELECT id FROM jobs
                WHERE state = 'queued' AND run_after <= now()
                  AND model = ANY(CAST(:models AS text[])) AND vram_mb <= :budget
                ORDER BY priority DESC, created_at
                LIMIT 1 FOR UPDATE SKIP LOCKED)
    RETURNING vram_mb
    """
)

# Many jobs in one statement: `created_at` spaced a microsecond apart from `:age_s` ago, runnable
# after `:delay_s` (a retry's backoff: the service keeps such jobs `scheduled`, out of the queue;
# the naive reference line, like DESIGN.md's first sketch, would keep them queued with run_after).
BULK_JOBS = text(
    """
    INSERT INTO jobs (owner, model, input_id, megapixels, priority, vram_mb, max_attempts, created_at,
                      run_after, state)
    SELECT 'bench', :model, :input_id, 1.0, :priority, :vram_mb, 1,
           now() - make_interval(secs => :age_s) + g * interval '1 microsecond',
           now() + make_interval(secs => :delay_s),
           CAST(CASE WHEN :delay_s > 0 AND :scheduled THEN 'scheduled' ELSE 'queued' END AS job_state)
    FROM generate_series(1, :count) AS g
    """
)
BENCH_INPUT = text(
    """
    INSERT INTO inputs (sha256, media_type, width, height, bytes, data)
    VALUES ('bench', 'image/png', 1, 1, 0, '') ON CONFLICT (sha256) DO UPDATE SET bytes = 0
    RETURNING id
    """
)
JOB_COUNTS = text(
    "SELECT count(*) FILTER (WHERE state = 'succeeded') AS ok,"
    " count(*) FILTER (WHERE state IN ('failed', 'canceled')) AS bad FROM jobs"
)


@dataclass(frozen=True, slots=True)
class Sizes:
    """How much work each benchmark does."""

    jobs: int
    latency_jobs: int
    claim_s: float
    fitting_jobs: int
    relief_runs: int


@dataclass(slots=True)
class Bench:
    """What every benchmark needs: the database, a temp folder, the registry file, the results."""

    url: str
    engine: AsyncEngine
    tmp: Path
    models_file: Path
    rows: list[tuple[str, str, str]] = field(default_factory=list)
    children: list[Child] = field(default_factory=list)
    worker_rss_kb: int = 0

    def add(self, section: str, measure: str, value: str) -> None:
        """Record one line of the table (and show progress on stderr)."""
        self.rows.append((section, measure, value))
        print(f"  {section}: {measure} = {value}", file=sys.stderr, flush=True)


# -- processes --------------------------------------------------------------------------------


@dataclass(slots=True)
class Child:
    """A subprocess we started, reaped with wait4 so its own peak RSS is known."""

    proc: subprocess.Popen[bytes]
    log: Path
    exit_code: int | None = None
    maxrss_kb: int = 0

    def poll(self) -> bool:
        """Reap the process if it has ended; True once it has."""
        if self.exit_code is None:
            pid, status, usage = os.wait4(self.proc.pid, os.WNOHANG)
            if pid == 0:
                return False
            self.exit_code = os.waitstatus_to_exitcode(status)
            self.proc.returncode = self.exit_code  # Popen must not wait again
            self.maxrss_kb = usage.ru_maxrss
        return True

    async def reap(self, timeout_s: float) -> int:
        """Wait for the end (SIGKILL after `timeout_s`); returns the exit code."""
        deadline = time.monotonic() + timeout_s
        while not self.poll():
            if time.monotonic() > deadline:
                self.proc.kill()
                deadline = float("inf")
            await asyncio.sleep(POLL_S)
        assert self.exit_code is not None
        return self.exit_code

    def tail(self) -> str:
        """The last lines of the process's output."""
        lines = self.log.read_text(errors="replace").strip().splitlines()
        return " | ".join(lines[-3:])


def start_child(bench: Bench, argv: list[str], log: Path, env: dict[str, str] | None = None) -> Child:
    """Start `argv` with stdout and stderr into `log`; `bench` reaps it in the end whatever happens."""
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    child = Child(proc, log)
    bench.children.append(child)
    return child


async def reap_leftovers(bench: Bench) -> None:
    """Kill and reap every child still running (after an error or an interrupt)."""
    for child in bench.children:
        if not child.poll():
            child.proc.kill()
            await child.reap(timeout_s=10)


def start_worker(bench: Bench, name: str, *, burst: bool) -> Child:
    """`python -m app worker` with its own identity and storage, on one big virtual GPU."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUJOBS_")}
    env.update(
        GPUJOBS_WORKER_NAME=name,
        GPUJOBS_DATABASE_URL=bench.url,
        GPUJOBS_MODELS_FILE=str(bench.models_file),
        GPUJOBS_STORAGE_DIR=str(bench.tmp / "storage" / name),
        GPUJOBS_GPUS="1024GiB",
        GPUJOBS_VRAM_BUFFER_MB="0",
        GPUJOBS_MAX_JOBS_PER_GPU="8",
        GPUJOBS_LOG_LEVEL="WARNING",
    )
    argv = [sys.executable, "-m", "app", "worker", *(["--burst"] if burst else [])]
    return start_child(bench, argv, bench.tmp / f"{name}.log", env)


async def reap_workers(bench: Bench, workers: list[Child], timeout_s: float) -> list[int]:
    """Wait for every worker; remember the largest peak RSS; returns the exit codes."""
    codes = [await w.reap(timeout_s) for w in workers]
    bench.worker_rss_kb = max([bench.worker_rss_kb, *(w.maxrss_kb for w in workers)])
    return codes


# -- database ---------------------------------------------------------------------------------


@contextlib.contextmanager
def postgres_server(tmp: Path) -> Iterator[tuple[str, str]]:
    """(asyncpg URL of a server where we may create databases, where it comes from)."""
    external = os.environ.get("DATABASE_URL")
    if external:
        url = settings.load_settings(database_url=external).database_url
        assert url is not None
        yield url, "DATABASE_URL"
        return
    server = pgserver.EmbeddedPostgres(tmp / "pgdata")
    try:
        yield server.start(), "embedded"
    finally:
        server.stop()


@contextlib.asynccontextmanager
async def bench_database(server_url: str) -> AsyncIterator[str]:
    """A new database migrated to head, dropped on the way out."""
    name = f"gpujobs_bench_{os.getpid()}"
    await dbadmin.admin(server_url, f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    await dbadmin.admin(server_url, f"CREATE DATABASE {name}")
    try:
        url = make_url(server_url).set(database=name).render_as_string(hide_password=False)
        await asyncio.to_thread(migrate.upgrade, url)
        yield url
    finally:
        await dbadmin.admin(server_url, f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


async def reset(engine: AsyncEngine) -> None:
    """Empty the queue tables between benchmarks."""
    async with engine.begin() as conn:
        await conn.execute(text("TRUNCATE job_events, jobs, workers"))


NOT_DRAINED = "NOT DRAINED (timed out, or every worker ended)"


async def wait_for(engine: AsyncEngine, query: str, timeout_s: float, workers: Sequence[Child] = ()) -> bool:
    """Poll `query` (one boolean) every 50 ms until true; False on timeout, or once every one of
    `workers` has exited without it coming true (a worker that fails at start-up ends the wait
    at once instead of after the timeout)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        gone = bool(workers) and all(w.poll() for w in workers)
        async with engine.connect() as conn:
            if await conn.scalar(text(query)):
                return True
        if gone:
            return False
        await asyncio.sleep(POLL_S)
    return False


# -- 1. end to end ----------------------------------------------------------------------------


def in_temp_folder(prefix: str, bench: Callable[[Path], Awaitable[None]]) -> None:
    """Run `bench(tmp)` on a new event loop, in a temporary folder removed afterwards."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        asyncio.run(bench(tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def png_bytes(size: tuple[int, int]) -> bytes:
    """A smooth grey-scale pattern (a relief model needs shapes, not noise)."""
    height, width = size[1], size[0]
    y, x = np.mgrid[0:height, 0:width] / max(size)
    z = 0.5 + 0.25 * np.sin(9 * x) * np.cos(7 * y) + 0.25 * np.exp(-20 * ((x - 0.5) ** 2 + (y - 0.5) ** 2))
    buffer = io.BytesIO()
    Image.fromarray((np.clip(z, 0, 1) * 255).astype(np.uint8), mode="L").save(buffer, format="PNG")
    return buffer.getvalue()


async def enqueue_noop(bench: Bench, count: int, pause_s: float = 0.0) -> float:
    """Queue `count` noop jobs through JobManager.enqueue; returns enqueues per second."""
    manager = manager_.JobManager(bench.engine)
    image = images.inspect(png_bytes((64, 48)), max_pixels=10**8)
    spec = modelsfile.load_registry(bench.models_file).get("noop")
    job = records.NewJob("bench", "noop", {}, 0, spec.estimate_vram_mb(image.megapixels), 1)
    started = time.perf_counter()
    for _ in range(count):
        await manager.enqueue(job, image, queue_limit=10**9)
        if pause_s:
            await asyncio.sleep(pause_s)
    return count / (time.perf_counter() - started)


async def end_to_end(bench: Bench, jobs: int, n_workers: int) -> None:
    """N noop jobs queued first, then `n_workers` burst workers drain them."""
    section = f"1. end-to-end, {n_workers} worker{'s' if n_workers > 1 else ''}"
    await reset(bench.engine)
    bench.add(section, f"enqueue {jobs} jobs (one by one)", f"{await enqueue_noop(bench, jobs):.0f} jobs/s")
    started = time.perf_counter()
    workers = [start_worker(bench, f"bench-e2e-{n_workers}-{i}", burst=True) for i in range(n_workers)]
    done = f"SELECT count(*) = {jobs} FROM jobs WHERE state IN ('succeeded', 'failed', 'canceled')"
    finished = await wait_for(bench.engine, done, timeout_s=max(120.0, jobs / 5), workers=workers)
    elapsed = time.perf_counter() - started
    codes = await reap_workers(bench, workers, timeout_s=30)
    async with bench.engine.connect() as conn:
        counts = (await conn.execute(JOB_COUNTS)).one()
        span = await conn.scalar(
            text("SELECT extract(epoch FROM max(finished_at) - min(started_at)) FROM jobs")
        )
    if not finished:
        bench.add(section, NOT_DRAINED, f"{counts.ok} succeeded; log: {workers[0].tail()}")
    bench.add(section, "jobs/s, wall (incl. worker start)", f"{counts.ok / elapsed:.1f}")
    bench.add(section, "jobs/s, first start to last finish", f"{counts.ok / float(span or 1):.1f}")
    bench.add(section, "succeeded / failed", f"{counts.ok} / {counts.bad}")
    bench.add(section, "worker exit codes", " ".join(map(str, codes)))


# -- 2. wake-up latency -----------------------------------------------------------------------


def own_cpu_s() -> float:
    """User + system CPU seconds of this process so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def process_cpu_s(pid: int, *, reaped: bool = False) -> float:
    """CPU seconds of one live process, all its threads (0 when unreadable); with `reaped`, those of
    the children it waited for too."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks = sum(int(f) for f in fields[11 : 15 if reaped else 13])
        return ticks / os.sysconf("SC_CLK_TCK")
    return 0.0


def process_tree(pid: int) -> list[int]:
    """`pid` and its live descendants (from /proc/<pid>/task/<tid>/children)."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{current}/task").iterdir():
                with contextlib.suppress(OSError):
                    todo.extend(int(child) for child in (task / "children").read_text().split())
    return found


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of `pid` and its descendants, the ones they reaped included (`gpujobs serve`
    with several API processes is a parent and its children)."""
    return sum(process_cpu_s(p, reaped=True) for p in process_tree(pid))


def percentiles(values: list[float]) -> str:
    """p50 / p90 / p99 / max."""
    q = statistics.quantiles(values, n=100, method="inclusive")
    return f"{q[49]:.1f} / {q[89]:.1f} / {q[98]:.1f} / {max(values):.1f}"


async def latency(bench: Bench, jobs: int) -> None:
    """An idle, listening worker; jobs queued one at a time; created_at -> started_at."""
    section = "2. enqueue -> start, idle worker"
    await reset(bench.engine)
    worker = start_worker(bench, "bench-latency", burst=False)
    try:
        registered = f"SELECT EXISTS (SELECT 1 FROM workers WHERE id = '{HOST}:bench-latency')"
        if not await wait_for(bench.engine, registered, timeout_s=60):
            bench.add(section, "worker did not start", worker.tail())
            return
        await asyncio.sleep(0.5)  # let its LISTEN connection settle
        await enqueue_noop(bench, jobs, pause_s=0.05)
        await wait_for(bench.engine, f"SELECT count(*) = {jobs} FROM jobs WHERE started_at IS NOT NULL", 60)
    finally:
        worker.proc.send_signal(signal.SIGTERM)
        code = (await reap_workers(bench, [worker], timeout_s=30))[0]
    query = "SELECT 1000 * extract(epoch FROM started_at - created_at) FROM jobs WHERE started_at IS NOT NULL"
    async with bench.engine.connect() as conn:
        values = [float(v) for v in (await conn.scalars(text(query))).all()]
    if len(values) < 2:
        bench.add(section, "too few jobs started", f"{len(values)}; log: {worker.tail()}")
        return
    bench.add(section, f"latency ms p50/p90/p99/max ({len(values)} jobs)", percentiles(values))
    bench.add(section, "worker exit code after SIGTERM", str(code))


# -- 3. claim rate ----------------------------------------------------------------------------

ClaimOnce = Callable[[int], Awaitable[int | None]]  # claimer number -> claimed job's vram_mb


@dataclass(frozen=True, slots=True)
class ClaimCase:
    """A queue shape: fitting jobs, behind `blocked` older, higher-priority jobs of `blocked_mb`
    that may run only after `delay_s`. The claimer takes up to `limit` jobs a claim (a worker takes as
    many as it has free slots) and also serves `idle_models` models with nothing queued."""

    label: str
    blocked_mb: int
    blocked: int
    delay_s: float = 0
    idle_models: int = 0
    limit: int = 1


async def fill_queue(engine: AsyncEngine, case: ClaimCase, fitting: int, *, naive: bool = False) -> None:
    """A fresh queue of the case's shape (bulk insert, then ANALYZE)."""
    await reset(engine)
    async with engine.begin() as conn:
        input_id = await conn.scalar(BENCH_INPUT)
        common = {"model": "noop", "input_id": input_id}
        fit = {"priority": 0, "vram_mb": 1000, "age_s": 0, "count": fitting, "delay_s": 0, "scheduled": False}
        await conn.execute(BULK_JOBS, {**common, **fit})
        if case.blocked:
            blocked = {"priority": 10, "vram_mb": case.blocked_mb, "age_s": 3600, "count": case.blocked}
            await conn.execute(
                BULK_JOBS, {**common, **blocked, "delay_s": case.delay_s, "scheduled": not naive}
            )
    async with engine.connect() as conn:
        await (await conn.execution_options(isolation_level="AUTOCOMMIT")).execute(text("ANALYZE jobs"))


def manager_claim(
    engine: AsyncEngine, models: list[str], limit: int = 1, queue_engine: AsyncEngine | None = None
) -> ClaimOnce:
    """The real claim: JobManager.claim of up to `limit` jobs on one GPU of BUDGET_MB, on
    `queue_engine` as a worker claims (db.create_queue_engine: one generic plan per connection,
    made without sequential scans)."""
    manager = manager_.JobManager(engine, queue_engine=queue_engine)

    async def once(claimer: int) -> int | None:
        jobs = await manager.claim(
            worker_id=f"{HOST}:bench-claimer-{claimer}",
            host=HOST,
            models=models,
            budgets={0: BUDGET_MB},
            lease_s=60,
            limit=limit,
            slots={0: limit},
        )
        return max(c.job.vram_mb for c in jobs) if jobs else None

    return once


def naive_claim(engine: AsyncEngine, models: list[str]) -> ClaimOnce:
    """DESIGN.md's single-index claim (NAIVE_CLAIM)."""

    async def once(claimer: int) -> int | None:
        values = {"worker_id": f"{HOST}:bench-naive-{claimer}", "models": models, "budget": BUDGET_MB}
        async with engine.begin() as conn:
            vram_mb = await conn.scalar(NAIVE_CLAIM, values)
        return None if vram_mb is None else int(vram_mb)

    return once


async def claim_rate(claim: ClaimOnce, claimers: int, duration_s: float) -> tuple[float, int]:
    """Claims per second over `duration_s` with `claimers` concurrent tasks; (rate, misfits)."""
    counts, misfits = [0] * claimers, [0]

    async def loop(i: int, deadline: float) -> None:
        while time.perf_counter() < deadline:
            vram_mb = await claim(i)
            if vram_mb is None:
                return
            counts[i] += 1
            misfits[0] += vram_mb > BUDGET_MB

    await asyncio.gather(*(claim(i) for i in range(claimers)))  # warm up: one connection each
    started = time.perf_counter()
    await asyncio.gather(*(loop(i, started + duration_s) for i in range(claimers)))
    return sum(counts) / (time.perf_counter() - started), misfits[0]


async def best_rate(claim: ClaimOnce, claimers: int, sizes: Sizes) -> tuple[float, int]:
    """The best of CLAIM_ROUNDS rounds of `claim_rate` (other work on the machine only slows a round)."""
    rounds = [await claim_rate(claim, claimers, sizes.claim_s / CLAIM_ROUNDS) for _ in range(CLAIM_ROUNDS)]
    return max(rate for rate, _ in rounds), sum(misfits for _, misfits in rounds)


async def server_ms(engine: AsyncEngine, claim: ClaimOnce) -> tuple[float, float]:
    """Best-of-5 planning + execution time of the claim's statement on the server (EXPLAIN ANALYZE),
    and the planning time of that run (a worker's queue connection keeps one generic plan, so its
    claims skip the planning; EXPLAIN with values always plans afresh).

    The statement is caught as the claim sends it: through SQLAlchemy (the naive claim) or straight
    to the driver (`db.fetch_rows`, the real one); each EXPLAIN is rolled back."""
    captured: list[tuple[str, list[Any]]] = []

    def grab(_conn: Any, _cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        captured.append((statement, list(parameters)))

    fetch_rows = db.fetch_rows

    async def grab_driver(engine_: AsyncEngine, statement: Any, values: Any) -> list[Any]:
        compiled = db._driver_sql(statement, engine_.dialect)
        captured.append((compiled.string, [values[k] for k in compiled.names]))
        return await fetch_rows(engine_, statement, values)

    event.listen(engine.sync_engine, "before_cursor_execute", grab)
    db.fetch_rows = grab_driver  # type: ignore[assignment]
    try:
        await claim(0)  # the statement and parameters exactly as the claim sends them
    finally:
        db.fetch_rows = fetch_rows  # type: ignore[assignment]
        event.remove(engine.sync_engine, "before_cursor_execute", grab)
    statement, parameters = captured[-1]
    times: list[tuple[float, float]] = []
    pooled = await engine.raw_connection()  # the service's own settings (jit off among them)
    driver = pooled.driver_connection
    assert driver is not None
    try:
        for _ in range(5):
            explaining = driver.transaction()
            await explaining.start()
            plan = await driver.fetchval(f"EXPLAIN (ANALYZE, FORMAT JSON) {statement}", *parameters)
            await explaining.rollback()  # the explained claim changes nothing
            top = (json.loads(plan) if isinstance(plan, str) else plan)[0]
            times.append((top["Planning Time"] + top["Execution Time"], top["Planning Time"]))
    finally:
        await greenlet_spawn(pooled.close)
    return min(times)


CLAIM_ROUNDS = 3
CLAIM_CASES = (
    ClaimCase("a) only fitting jobs", 0, 0),
    ClaimCase("b) + 10,000 ahead at 40000 MB", 40_000, 10_000),
    ClaimCase("c) + 10,000 ahead at 26000 MB", 26_000, 10_000),
    ClaimCase("d) + 10,000 ahead at 28000 MB", 28_000, 10_000),
    ClaimCase("e) + 10,000 ahead at 1000 MB, retry in 1 h", 1000, 10_000, delay_s=3600),
    ClaimCase("f) as b), 8 jobs a claim, 9 more models served", 40_000, 10_000, idle_models=9, limit=8),
)


async def claim_case(bench: Bench, sizes: Sizes, make: Callable[..., ClaimOnce], case: ClaimCase) -> str:
    """One queue shape: best claims/s with 1 and 4 claimers, and server-side ms per claim."""
    models = list(modelsfile.load_registry(bench.models_file).models)
    models += [f"idle-{i}" for i in range(case.idle_models)]
    queue_engine = None
    if make is manager_claim:  # each of the 4 claimers stands for a worker, with its queue connection
        queue_engine = db.create_queue_engine(bench.url, pool_size=4)
        claim = manager_claim(bench.engine, models, case.limit, queue_engine)
    elif case.limit > 1:
        return "n/a (it takes one job a claim)"
    else:
        claim = make(bench.engine, models)
    rates, misfits = [], 0
    try:
        for claimers in (1, 4):
            await fill_queue(bench.engine, case, sizes.fitting_jobs, naive=make is naive_claim)
            rate, wrong = await best_rate(claim, claimers, sizes)
            rates.append(rate)
            misfits += wrong
        ms, planning_ms = await server_ms(bench.engine, claim)
    finally:
        if queue_engine is not None:
            await queue_engine.dispose()
    bad = f" ({misfits} claimed jobs did not fit!)" if misfits else ""
    return f"{rates[0]:5.0f} / {rates[1]:5.0f} claims/s   {ms:5.2f} ms ({planning_ms:.2f} planning){bad}"


async def claims(bench: Bench, sizes: Sizes) -> None:
    """sql.CLAIM through JobManager.claim, then the naive claim on its own index."""
    head = "claims/s with 1 / 4 claimers (best of 3 rounds), server ms/claim"
    bench.add(f"3. JobManager.claim, budget {BUDGET_MB} MB", "queue", head)
    for case in CLAIM_CASES:
        bench.add(f"3. JobManager.claim, budget {BUDGET_MB} MB", case.label,
                  await claim_case(bench, sizes, manager_claim, case))  # fmt: skip
    async with bench.engine.begin() as conn:
        await conn.execute(text(NAIVE_INDEX))
    try:
        bench.add("3. naive claim (reference)", "queue", head)
        for case in CLAIM_CASES:
            bench.add(
                "3. naive claim (reference)", case.label, await claim_case(bench, sizes, naive_claim, case)
            )
    finally:
        async with bench.engine.begin() as conn:
            await conn.execute(text("DROP INDEX ix_bench_naive"))


# -- 4. relief --------------------------------------------------------------------------------


async def relief(bench: Bench, runs: int) -> None:
    """`python -m app.relief` on a 1000x1000 PNG at default parameters."""
    section = "4. relief, 1000x1000 PNG -> GLB"
    picture = bench.tmp / "relief-input.png"
    picture.write_bytes(png_bytes((1000, 1000)))
    times: list[tuple[float, float]] = []
    for run in range(runs):
        out = bench.tmp / f"relief-{run}"
        out.mkdir()
        argv = [sys.executable, "-m", "app.relief", "--input", str(picture), "--output-dir", str(out),
                "--format", "glb"]  # fmt: skip
        started = time.perf_counter()
        child = start_child(bench, argv, bench.tmp / f"relief-{run}.log")
        code = await child.reap(timeout_s=300)
        times.append(time.perf_counter() - started)
        if code != 0 or not (out / "mesh.glb").is_file():
            bench.add(section, "not runnable", f"exit {code}: {child.tail()}")
            return
    bench.add(
        section, f"seconds, min / median of {runs}", f"{min(times):.2f} / {statistics.median(times):.2f}"
    )
    bench.add(section, "GLB size", f"{(out / 'mesh.glb').stat().st_size / 1e6:.2f} MB")
    bench.add(section, "peak RSS of the relief process", f"{child.maxrss_kb / 1024:.0f} MB")


# -- the run ----------------------------------------------------------------------------------


def cpu_model() -> str:
    """The CPU's model name, from /proc/cpuinfo when there is one."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def load_average() -> str:
    """The 1-minute load average: other work on the machine skews every number."""
    return f"{os.getloadavg()[0]:.1f}"


async def machine(bench: Bench, source: str) -> None:
    """Cores, load, Python and PostgreSQL versions."""
    async with bench.engine.connect() as conn:
        version = await conn.scalar(text("SHOW server_version"))
        commit = await conn.scalar(text("SHOW synchronous_commit"))
    bench.add("0. machine", "cores (usable / total)", f"{len(os.sched_getaffinity(0))} / {os.cpu_count()}")
    bench.add("0. machine", "cpu", cpu_model())
    bench.add("0. machine", "load average (1 min) at start", load_average())
    bench.add("0. machine", "python", f"{platform.python_version()} ({platform.python_implementation()})")
    bench.add("0. machine", "postgresql", f"{version} ({source}), synchronous_commit={commit}")


def memory(bench: Bench) -> None:
    """Peak RSS of the worker processes and of this process; the load at the end."""
    if bench.worker_rss_kb:
        bench.add("5. memory", "peak RSS of one worker process", f"{bench.worker_rss_kb / 1024:.0f} MB")
    own_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    bench.add("5. memory", "peak RSS of this bench process", f"{own_kb / 1024:.0f} MB")
    bench.add("5. memory", "load average (1 min) at the end", load_average())


async def run_all(bench: Bench, sizes: Sizes, source: str) -> None:
    """Every benchmark, in order."""
    await machine(bench, source)
    for n_workers in (1, 4):
        await end_to_end(bench, sizes.jobs, n_workers)
    await latency(bench, sizes.latency_jobs)
    await claims(bench, sizes)
    await relief(bench, sizes.relief_runs)
    memory(bench)


async def bench_main(sizes: Sizes, tmp: Path) -> list[tuple[str, str, str]]:
    """Start PostgreSQL and the bench database, run everything, clean up (also after SIGTERM)."""
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    models_file = tmp / "bench-models.toml"
    models_file.write_text(NOOP_MODEL)
    with postgres_server(tmp) as (server_url, source):
        async with bench_database(server_url) as url:
            engine = db.create_engine(url, pool_size=8)
            bench = Bench(url, engine, tmp, models_file)
            try:
                await run_all(bench, sizes, source)
            finally:
                await asyncio.shield(reap_leftovers(bench))
                await engine.dispose()
    return bench.rows


def print_table(rows: list[tuple[str, str, str]]) -> None:
    """The results, one aligned line per number."""
    widths = [max(len(r[i]) for r in rows) for i in range(2)]
    last = ""
    for section, measure, value in rows:
        shown = section if section != last else ""
        print(f"{shown:<{widths[0]}}  {measure:<{widths[1]}}  {value}")
        last = section


def parse_args(argv: list[str] | None = None) -> Sizes:
    """--jobs N and --quick."""
    parser = argparse.ArgumentParser(
        prog="python -m tests.bench.bench_queue", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--jobs", type=int, default=None, help="jobs in the end-to-end run (default 1000)")
    parser.add_argument("--quick", action="store_true", help="smaller sizes: a smoke run of every benchmark")
    args = parser.parse_args(argv)
    if args.quick:
        return Sizes(args.jobs or 100, latency_jobs=30, claim_s=0.5, fitting_jobs=2000, relief_runs=1)
    return Sizes(args.jobs or 1000, latency_jobs=200, claim_s=3.0, fitting_jobs=20_000, relief_runs=3)


def compile_app() -> None:
    """Write the app's bytecode, as `make setup` does. Where PYTHONDONTWRITEBYTECODE is set, the
    workers and warm runners a bench starts would otherwise each compile the app's sources
    (the 33 modules a worker loads: 65 ms of CPU on the 2-core VM), as no deployed service does."""
    compileall.compile_dir(Path(app.__file__).parent, quiet=1)


def main(argv: list[str] | None = None) -> None:
    """Run the benchmarks and print the table."""
    sizes = parse_args(argv)
    compile_app()
    tmp = Path(tempfile.mkdtemp(prefix="gpujobs-bench-"))
    started = time.perf_counter()
    try:
        rows = asyncio.run(bench_main(sizes, tmp))
    except (KeyboardInterrupt, asyncio.CancelledError):
        sys.exit("interrupted; subprocesses reaped, database and temporary folder removed")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print_table(rows)
    print(f"(total {time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
