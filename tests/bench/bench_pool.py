"""What one hot statement costs the caller, by the way it reaches its pooled connection.

Run on demand: `.venv/bin/python -m tests.bench.bench_pool [--statements N]`. It prints, asserts
nothing. PostgreSQL: embedded, or the server in DATABASE_URL. Each line runs N times a one-row
`SELECT` one after another and gives the CPU of this process per statement (getrusage) and the
wall time per statement:

- SQLAlchemy Connection: `async with engine.connect()`, then the driver's fetch on it (how
  `db.fetch_rows` reached the driver before);
- pooled raw connection: `db.fetch_rows`, the pool's connection without SQLAlchemy's `Connection`;
- asyncpg pool: `asyncpg.create_pool`, `acquire()` and fetch (a second pool, for comparison);
- one held connection: the driver's fetch on one asyncpg connection (no pool at all: the floor).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import asyncpg
from sqlalchemy import text

from app import db
from tests.bench import bench_queue as bq

STATEMENT = text("SELECT CAST(:n AS integer) + 1 AS next")


async def _timed(name: str, count: int, one: Callable[[int], Awaitable[object]]) -> None:
    for n in range(min(count, 200)):  # warm: connections made, statements prepared
        await one(n)
    cpu, wall = bq.own_cpu_s(), time.perf_counter()
    for n in range(count):
        await one(n)
    cpu_us, wall_us = (bq.own_cpu_s() - cpu) / count * 1e6, (time.perf_counter() - wall) / count * 1e6
    print(f"{name:<28} {cpu_us:6.1f} us CPU, {wall_us:6.1f} us wall per statement")


async def measure(url: str, count: int) -> None:
    """Each way in turn, on the same server."""
    engine = db.create_engine(url, pool_size=2)
    auto = engine.execution_options(isolation_level="AUTOCOMMIT")
    compiled = db._driver_sql(STATEMENT, engine.dialect)

    async def connection(n: int) -> object:
        async with auto.connect() as conn:
            driver = (await conn.get_raw_connection()).driver_connection
            assert driver is not None
            return await driver.fetch(compiled.string, n)

    pool = await asyncpg.create_pool(db.asyncpg_dsn(url), min_size=1, max_size=2)
    held = await asyncpg.connect(db.asyncpg_dsn(url))
    try:

        async def from_pool(n: int) -> object:
            async with pool.acquire() as conn:
                return await conn.fetch(compiled.string, n)

        await _timed("SQLAlchemy Connection", count, connection)
        await _timed("pooled raw connection", count, lambda n: db.fetch_rows(engine, STATEMENT, {"n": n}))
        await _timed("asyncpg pool", count, from_pool)
        await _timed("one held connection", count, lambda n: held.fetch(compiled.string, n))
    finally:
        await held.close()
        await pool.close()
        await engine.dispose()


async def main_async(count: int, tmp: Path) -> None:
    with bq.postgres_server(tmp) as (server_url, source):
        async with bq.bench_database(server_url) as url:
            print(f"PostgreSQL: {source}; {count} statements each")
            await measure(url, count)


def main() -> None:
    """Parse the arguments, run, clean up."""
    parser = argparse.ArgumentParser(
        prog="python -m tests.bench.bench_pool", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--statements", type=int, default=5000)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="gpujobs-pool-"))
    try:
        asyncio.run(main_async(args.statements, tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
