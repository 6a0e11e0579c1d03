"""Aging beside a long queue: the pass with nothing due, and claims while many jobs cross a step.

Run on demand, never by pytest: `.venv/bin/python -m tests.bench.bench_aging [--jobs N] [--quick]
[--database-url postgresql://user@host:port]`. It prints numbers and asserts nothing. PostgreSQL is
a fresh embedded server in a temporary folder, or the server at `--database-url`, where a database
`gpujobs_bench_aging_<pid>` is created, migrated and dropped at the end. It queues `--jobs` jobs
of one model (default 100,000; `--quick`: 10,000) in one INSERT, all created half an aging step
ago (none due), then VACUUM ANALYZE. The README's figures ("Aging costs nothing while nothing is
due") and tests/bench/README.md, sixth round, came from a throwaway script; this one stands for it.

What each line means (times are wall clock from this process, on its own asyncio loop):
- `nothing due, the aging pass`: `JobManager.age_queued(step_s, max_boost)` as the reaper calls it
  each round (AGE_QUEUED through ix_jobs_boost_due, chunks of 1,000); one warm-up, then `--rounds`.
  `rows read` is how many rows of `jobs` its plan read (EXPLAIN ANALYZE of one statement).
- `nothing due, a scan of every queued job`: the aging statement before migration 0006 (dfa7444),
  kept below as OLD_AGE_QUEUED: an UPDATE whose condition every queued job is read for. With
  nothing due it writes nothing; timed the same way (one warm-up, then `--rounds`, autocommit).
- `claims alone`: the worker's claim (sql.CLAIM with `claims.parameters`, on a connection of
  `db.create_queue_engine`, as a worker sends it) with no aging running: each in its own
  transaction, rolled back so that the queue stays as it was; the time is the statement's alone
  (BEGIN and ROLLBACK are not counted, nor a commit). One GPU of BUDGET_MB, `--claim-limit` jobs.
- Then three times a new queue (TRUNCATE, the same INSERT with the jobs created one and a half
  steps ago, VACUUM ANALYZE) whose jobs all cross a step together, each time raised by:
  - `chunked pass`: AGE_QUEUED statement after statement, as `age_queued` loops, until a chunk
    comes back short: total seconds, jobs raised, and ms per full chunk (median; first, last,
    max), then the short chunk that ended it;
  - `one AGE_QUEUED statement, chunk = the queue`: the same statement with a chunk as large as
    the queue (it locks every due row before it writes one);
  - `one old statement (pre-0006)`: OLD_AGE_QUEUED, as the pass raised them before 0006 (it
    locks the rows as it writes them).
  While each runs, a claim as above is made `CLAIM_AT_S` after its start; each shows its latency
  and how many jobs it took (rolled back). "after" marks a claim sent once the raise had ended.
  `boosts after`: the queued jobs at each age_boost once the raise ended; `still due`: those a
  next pass would read (not shown after the old statement, which does not move boost_base_at).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import socket
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import TextClause, text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.util import greenlet_spawn

from app import db, pgserver, settings
from app.queue import claims, sql
from app.queue import manager as manager_
from tests import dbadmin, plans
from tests.bench import bench_queue

MODEL = "aging-bench"
VRAM_MB = 1000
BUDGET_MB = 24_000  # the claiming worker's one GPU
STEP_S = 600.0  # GPUJOBS_AGE_STEP_S for this run: jobs are created half a step ago, so none is due
MAX_BOOST = 10  # GPUJOBS_AGE_MAX_BOOST (its default)
CHUNK = 1000  # JobManager.age_queued's default chunk
CLAIM_AT_S = (0.05, 1.0, 2.0)  # claims made this long after a raise starts
LEASE_S = 20.0

FILL = text(
    """
    WITH image AS (
        INSERT INTO inputs (sha256, media_type, width, height, bytes, data)
        VALUES (repeat('a', 64), 'image/png', 1, 1, 1, '\\x00'::bytea)
        RETURNING id
    )
    INSERT INTO jobs (owner, model, input_id, megapixels, vram_mb, declared_vram_mb, max_attempts,
                      created_at, run_after)
    SELECT 'bench', :model, image.id, 0.3, :vram_mb, :vram_mb, 3,
           now() - make_interval(secs => :age_s) + g * interval '1 microsecond', now()
    FROM image, generate_series(1, :count) AS g
    """
)
DUE = text(
    """
    SELECT count(*) FROM jobs WHERE state = 'queued'
      AND COALESCE(boost_base_at, created_at) <= now() - make_interval(secs => :step_s)
    """
)
BOOSTS = text("SELECT age_boost, count(*) AS jobs FROM jobs WHERE state = 'queued' GROUP BY 1 ORDER BY 1")
# The aging statement before migration 0006 (dfa7444), verbatim: every queued job is read to
# find those whose boost is behind their wait, and all of them are written in one statement.
OLD_AGE_QUEUED = text(
    """
    UPDATE jobs
    SET age_boost = LEAST(:max_boost, floor(extract(epoch FROM now() - created_at) / :step_s))
    WHERE state = 'queued'
      AND age_boost < LEAST(:max_boost, floor(extract(epoch FROM now() - created_at) / :step_s))
    """
)


@dataclass(frozen=True, slots=True)
class Claim:
    at_s: float  # when it was sent, after the raise started
    ms: float
    jobs: int
    after: bool  # the raise had ended when it was sent


@contextlib.asynccontextmanager
async def scratch_database(database_url: str | None) -> AsyncIterator[tuple[str, str]]:
    """(URL of a new database migrated to head, where it is); dropped on the way out, and an
    embedded server stopped and its folder removed."""
    tmp = Path(tempfile.mkdtemp(prefix="gpujobs-bench-aging-"))
    server = pgserver.EmbeddedPostgres(tmp / "pgdata")
    try:
        if database_url:
            server_url = settings.load_settings(database_url=database_url).database_url
            assert server_url is not None
            where = make_url(server_url).render_as_string(hide_password=True)
        else:
            server_url, where = await asyncio.to_thread(server.start), "embedded, in a temporary folder"
        async with bench_queue.bench_database(server_url) as url:
            yield url, where
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


class Claimer:
    """The worker's claim on one held connection of a queue engine, each in a transaction rolled back."""

    def __init__(self, engine: AsyncEngine, limit: int) -> None:
        compiled = sql.CLAIM.compile(dialect=engine.dialect)
        self._statement, self._engine, self.limit = compiled.string, engine, limit
        values = claims.parameters(
            [MODEL],
            {0: BUDGET_MB},
            [0],
            limit,
            slots=None,
            ahead=None,
            warm=frozenset(),
            min_priority=-(2**31),
        )
        values |= {"worker_id": "bench:aging", "host": socket.gethostname(), "lease_s": LEASE_S}
        self._args = [values[k] for k in compiled.positiontup or ()]
        self._pooled: Any = None

    async def __aenter__(self) -> Claimer:
        self._pooled = await self._engine.raw_connection()
        return self

    async def __aexit__(self, *_: object) -> None:
        await greenlet_spawn(self._pooled.close)

    async def claim(self) -> tuple[float, int]:
        """One claim: its statement's ms, and the jobs it took (then given back by the rollback)."""
        driver = self._pooled.driver_connection
        transaction = driver.transaction()
        await transaction.start()
        try:
            started = time.perf_counter()
            rows = await driver.fetch(self._statement, *self._args)
            return (time.perf_counter() - started) * 1000, len(rows)
        finally:
            await transaction.rollback()


async def timed_ms(go: Callable[[], Awaitable[object]], rounds: int) -> list[float]:
    """`go()` once to warm up (its statement prepared on the connection), then `rounds` times, in ms."""
    await go()
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        await go()
        times.append((time.perf_counter() - started) * 1000)
    return times


def spread(times: list[float]) -> str:
    """min / median / max, in ms."""
    return f"{min(times):.2f} / {statistics.median(times):.2f} / {max(times):.2f} ms"


async def scalar(engine: AsyncEngine, statement: TextClause, values: dict[str, Any]) -> Any:
    """The one value of `statement`."""
    async with engine.connect() as conn:
        return await conn.scalar(statement, values)


async def fill(url: str, engine: AsyncEngine, jobs: int, age_s: float) -> float:
    """A new queue: `jobs` queued jobs of MODEL, created `age_s` ago, then VACUUM ANALYZE; seconds taken."""
    started = time.perf_counter()
    async with engine.begin() as conn:
        await conn.execute(text("TRUNCATE jobs, inputs CASCADE"))
        await conn.execute(FILL, {"model": MODEL, "vram_mb": VRAM_MB, "age_s": age_s, "count": jobs})
    await dbadmin.admin(url, "VACUUM ANALYZE")
    return time.perf_counter() - started


async def nothing_due(engine: AsyncEngine, rounds: int) -> None:
    """The pass and the old statement beside a queue with nothing due."""
    manager = manager_.JobManager(engine)
    due = await scalar(engine, DUE, {"step_s": STEP_S})
    print(f"jobs due: {due:,}")
    values = {"step_s": STEP_S, "max_boost": MAX_BOOST}
    cases: list[tuple[str, TextClause, Callable[[], Awaitable[object]]]] = [
        (
            "the aging pass (age_queued)",
            sql.AGE_QUEUED,
            lambda: manager.age_queued(step_s=STEP_S, max_boost=MAX_BOOST),
        ),
        (
            "a scan of every queued job (pre-0006 aging)",
            OLD_AGE_QUEUED,
            lambda: db.fetch_rows(engine, OLD_AGE_QUEUED, values),
        ),
    ]
    for name, statement, go in cases:
        plan = await plans.explained(engine, statement, {**values, "chunk": CHUNK})
        times = await timed_ms(go, rounds)
        read = plans.rows_read(plan, "jobs")
        print(f"nothing due, {name:<44} min/median/max {spread(times)}  (rows read: {read:,.0f})")


async def claims_during(claimer: Claimer, started: float, ended: asyncio.Event) -> list[Claim]:
    """A claim at each of CLAIM_AT_S after `started`."""
    made = []
    for at_s in CLAIM_AT_S:
        await asyncio.sleep(max(0.0, started + at_s - time.perf_counter()))
        sent_s, after = time.perf_counter() - started, ended.is_set()
        ms, jobs = await claimer.claim()
        made.append(Claim(sent_s, ms, jobs, after))
    return made


async def under_claims(claimer: Claimer, raise_: Callable[[], Awaitable[str]]) -> tuple[str, list[Claim]]:
    """Run `raise_` (it returns its line) with claims made meanwhile."""
    ended = asyncio.Event()
    task = asyncio.create_task(claims_during(claimer, time.perf_counter(), ended), name="bench-aging-claims")
    try:
        line = await raise_()
    except BaseException:
        task.cancel()
        raise
    finally:
        ended.set()
    return line, await task


async def chunked_pass(engine: AsyncEngine) -> str:
    """AGE_QUEUED chunk after chunk until one comes back short, as `JobManager.age_queued` loops."""
    values = {"step_s": STEP_S, "max_boost": MAX_BOOST, "chunk": CHUNK}
    times: list[float] = []  # of the full chunks; the short one that ends the pass apart
    raised, started = 0, time.perf_counter()
    while True:
        t = time.perf_counter()
        row = await db.fetch_row(engine, sql.AGE_QUEUED, values)
        took_ms = (time.perf_counter() - t) * 1000
        raised += int(row["raised"])
        if row["seen"] < CHUNK:
            break
        times.append(took_ms)
    chunks = (
        f"median {statistics.median(times):.1f} ms (first {times[0]:.1f}, last {times[-1]:.1f},"
        f" max {max(times):.1f})"
        if times
        else "none full"
    )
    return (
        f"{time.perf_counter() - started:.2f} s, {raised:,} raised; {len(times)} full chunks of {CHUNK:,}:"
        f" {chunks}, then one of {row['seen']:,} in {took_ms:.1f} ms"
    )


async def one_statement(engine: AsyncEngine, statement: TextClause, chunk: int) -> str:
    """`statement` once, raising every due job."""
    values = {"step_s": STEP_S, "max_boost": MAX_BOOST, "chunk": chunk}
    started = time.perf_counter()
    await db.fetch_rows(engine, statement, values)
    return f"{time.perf_counter() - started:.2f} s in one statement"


@dataclass(frozen=True, slots=True)
class Bench:
    url: str
    engine: AsyncEngine
    claimer: Claimer
    jobs: int


async def crossing(
    bench: Bench, name: str, raise_: Callable[[], Awaitable[str]], *, sets_base: bool = True
) -> None:
    """A new queue whose jobs all cross a step at once; `raise_` raises them while claims are made."""
    engine = bench.engine
    await fill(bench.url, engine, bench.jobs, 1.5 * STEP_S)
    due = await scalar(engine, DUE, {"step_s": STEP_S})
    await bench.claimer.claim()  # planned again after the TRUNCATE and ANALYZE, not in a timed claim
    line, made = await under_claims(bench.claimer, raise_)
    print(f"{name} ({due:,} due): {line}")
    for c in made:
        after = ", after" if c.after else ""
        print(f"    claim at {c.at_s:.2f} s: {c.ms:6.1f} ms ({c.jobs} taken{after})")
    async with engine.connect() as conn:
        boosts = ", ".join(f"{r.age_boost}: {r.jobs:,}" for r in await conn.execute(BOOSTS))
    # The old statement leaves boost_base_at as it was: by it, every job stays due.
    left = f"; still due: {await scalar(engine, DUE, {'step_s': STEP_S}):,}" if sets_base else ""
    print(f"    boosts after: {boosts}{left}")


async def claims_alone(claimer: Claimer, rounds: int) -> None:
    """The claim with no aging running."""
    times = await timed_ms(claimer.claim, rounds)
    print(f"claims alone (limit {claimer.limit}, rolled back), min/median/max {spread(times)}")


async def bench_main(args: argparse.Namespace) -> None:
    """Build the queue, measure, print."""
    async with scratch_database(args.database_url) as (url, where):
        engine, queue_engine = db.create_engine(url), db.create_queue_engine(url)
        try:
            version = await scalar(engine, text("SHOW server_version"), {})
            print(f"PostgreSQL {version} ({where})")
            print(
                f"jobs {args.jobs:,} (one model, {VRAM_MB} MB each); aging step {STEP_S:g} s, max boost"
                f" {MAX_BOOST}, chunk {CHUNK:,}; {args.rounds} rounds; claims: one GPU of {BUDGET_MB:,} MB,"
                f" limit {args.claim_limit}, at {', '.join(f'{s:g}' for s in CLAIM_AT_S)} s into a raise"
            )
            took_s = await fill(url, engine, args.jobs, STEP_S / 2)
            print(f"queued {args.jobs:,} jobs of one model, then VACUUM ANALYZE: {took_s:.1f} s")
            await nothing_due(engine, args.rounds)
            async with Claimer(queue_engine, args.claim_limit) as claimer:
                await claims_alone(claimer, args.rounds)
                bench = Bench(url, engine, claimer, args.jobs)
                await crossing(bench, "chunked pass", lambda: chunked_pass(engine))
                whole = "one AGE_QUEUED statement, chunk = the queue"
                await crossing(bench, whole, lambda: one_statement(engine, sql.AGE_QUEUED, args.jobs))
                old = "one old statement (pre-0006)"
                await crossing(bench, old, lambda: one_statement(engine, OLD_AGE_QUEUED, 0), sets_base=False)
        finally:
            await engine.dispose()
            await queue_engine.dispose()


def main() -> None:
    """Parse the arguments, measure, print."""
    parser = argparse.ArgumentParser(
        prog="python -m tests.bench.bench_aging", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--jobs", type=int, default=100_000, help="queued jobs (default 100,000)")
    parser.add_argument("--quick", action="store_true", help="10,000 jobs")
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds of each nothing-due line")
    parser.add_argument("--claim-limit", type=int, default=1, help="jobs each claim may take")
    parser.add_argument(
        "--database-url", help="postgresql://user@host:port of a server to use (default: embedded)"
    )
    args = parser.parse_args()
    if args.quick:
        args.jobs = 10_000
    print(f"load average (1 min) at start: {os.getloadavg()[0]:.2f}; cores: {os.cpu_count()}")
    started = time.perf_counter()
    asyncio.run(bench_main(args))
    print(
        f"load average (1 min) at end: {os.getloadavg()[0]:.2f}; total {time.perf_counter() - started:.0f} s"
    )


if __name__ == "__main__":
    main()
