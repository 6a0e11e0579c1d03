"""What a NOTIFY inside a transaction costs concurrent commits, and what sending it after costs.

Run on demand: `.venv/bin/python -m tests.bench.bench_notify [--clients N] [--commits N] [--row-kb N]`.
It prints, asserts nothing. PostgreSQL: embedded, or the server in DATABASE_URL. N clients, each
on its own connection, commit one-row inserts as fast as they can, three ways in turn, for
`--rounds` rounds; commits per second for each:

- plain: the insert alone;
- notify inside: the insert and a `pg_notify` in one statement (as ENQUEUE sent its NOTIFYs
  before, and as the worker's statements still do). PostgreSQL takes one lock for every
  notifying commit and holds it until the commit is on disk, so these commits take turns;
- notify after: the insert, then the `pg_notify` in a statement of its own whose commit does not
  wait for the disk (sql.TELL: how uploads send theirs now). Two round trips per commit.

`--row-kb 1024` gives each row a megabyte, as an upload's image.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import tempfile
import time
from pathlib import Path

import asyncpg

from app import db
from tests.bench import bench_queue as bq

INSERT = "INSERT INTO bench_notify (data) VALUES ($1) RETURNING id"
NOTIFY_INSIDE = (
    "WITH i AS (INSERT INTO bench_notify (data) VALUES ($1) RETURNING id) "
    "SELECT pg_notify('bench_notify', id::text) FROM i"
)
NOTIFY_AFTER = "SELECT set_config('synchronous_commit', 'off', true), pg_notify('bench_notify', $1)"


async def one_way(conns: list[asyncpg.Connection], way: str, commits: int, row: bytes) -> float:
    """Commits per second of `way` over all the connections."""

    async def client(conn: asyncpg.Connection) -> None:
        for _ in range(commits):
            if way == "notify inside":
                await conn.fetch(NOTIFY_INSIDE, row)
            else:
                job = await conn.fetchval(INSERT, row)
                if way == "notify after":
                    await conn.fetch(NOTIFY_AFTER, str(job))

    started = time.perf_counter()
    await asyncio.gather(*(client(conn) for conn in conns))
    return len(conns) * commits / (time.perf_counter() - started)


async def measure(url: str, clients: int, commits: int, row_kb: int, rounds: int) -> None:
    dsn = db.asyncpg_dsn(url)
    conns = [await asyncpg.connect(dsn) for _ in range(clients)]
    try:
        await conns[0].execute(
            "CREATE TABLE bench_notify (id bigserial PRIMARY KEY, data bytea);"
            "ALTER TABLE bench_notify ALTER data SET STORAGE EXTERNAL"
        )
        row = os.urandom(row_kb * 1024)
        for n in range(rounds):
            rates = []
            for way in ("plain", "notify inside", "notify after"):
                await conns[0].execute("TRUNCATE bench_notify")
                rates.append(f"{way} {await one_way(conns, way, commits, row):,.0f}")
            print(f"round {n + 1}: commits/s: " + "; ".join(rates), flush=True)
    finally:
        for conn in conns:
            await conn.close()


async def main_async(args: argparse.Namespace, tmp: Path) -> None:
    with bq.postgres_server(tmp) as (server_url, source):
        async with bq.bench_database(server_url) as url:
            print(
                f"PostgreSQL: {source}; {args.clients} clients, {args.commits} commits each, "
                f"rows of {args.row_kb} kB; cores: {os.cpu_count()}"
            )
            await measure(url, args.clients, args.commits, args.row_kb, args.rounds)


def main() -> None:
    """Parse the arguments, run, clean up."""
    parser = argparse.ArgumentParser(
        prog="python -m tests.bench.bench_notify", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--commits", type=int, default=300, help="per client and way")
    parser.add_argument("--row-kb", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="gpujobs-notify-"))
    try:
        asyncio.run(main_async(args, tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
