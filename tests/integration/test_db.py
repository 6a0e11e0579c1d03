"""db.fetch_rows: hot statements on the pool's asyncpg connections, without SQLAlchemy around them."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest
from sqlalchemy import text

from app import db

NEXT = text("SELECT CAST(:n AS integer) + 1 AS next")
PID = text("SELECT pg_backend_pid() AS pid")
SLEEP = text("SELECT pg_sleep(:s) AS slept")


async def test_rows_come_back_as_mappings_and_the_connection_goes_back_to_the_pool(engine):
    [row] = await db.fetch_rows(engine, NEXT, {"n": 41})
    assert row["next"] == 42 and (await db.fetch_row(engine, NEXT, {"n": 1}))["next"] == 2
    assert await db.fetch_row(engine, text("SELECT 1 WHERE false"), {}) is None
    assert engine.pool.checkedout() == 0


async def test_autocommit_each_statement_stands_alone(engine):
    await db.fetch_rows(engine, text("CREATE TABLE seen (n integer)"), {})
    await db.fetch_rows(engine, text("INSERT INTO seen VALUES (CAST(:n AS integer)) RETURNING n"), {"n": 7})
    with pytest.raises(asyncpg.UndefinedTableError):  # a bad statement rolls back only itself...
        await db.fetch_rows(engine, text("SELECT * FROM nowhere"), {})
    async with engine.connect() as conn:  # ...and the insert before it was committed
        assert (await conn.execute(text("SELECT n FROM seen"))).scalar_one() == 7


async def test_a_statement_error_keeps_the_connection_and_a_cancel_discards_it(engine):
    first = (await db.fetch_row(engine, PID, {}))["pid"]
    with pytest.raises(asyncpg.DivisionByZeroError):
        await db.fetch_rows(engine, text("SELECT 1 / 0"), {})
    assert (await db.fetch_row(engine, PID, {}))["pid"] == first  # the same connection, reused
    sleeping = asyncio.create_task(db.fetch_rows(engine, SLEEP, {"s": 30}))
    await asyncio.sleep(0.3)
    sleeping.cancel()
    with pytest.raises(asyncio.CancelledError):
        await sleeping
    assert engine.pool.checkedout() == 0
    assert (await db.fetch_row(engine, PID, {}))["pid"] != first  # cut off mid-statement: replaced
    assert (await db.fetch_row(engine, NEXT, {"n": 1}))["next"] == 2


async def answer_starting_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answer a connection as a PostgreSQL still starting up does: no TLS, then FATAL 57P03."""
    length = int.from_bytes(await reader.readexactly(4), "big")
    body = await reader.readexactly(length - 4)
    if body[:4] == (80877103).to_bytes(4, "big"):  # SSLRequest: answer "no TLS", read the startup
        writer.write(b"N")
        length = int.from_bytes(await reader.readexactly(4), "big")
        await reader.readexactly(length - 4)  # the startup message
    fields = b"SFATAL\0VFATAL\0C57P03\0Mthe database system is starting up\0\0"
    writer.write(b"E" + (len(fields) + 4).to_bytes(4, "big") + fields)
    await writer.drain()
    writer.close()


async def test_a_server_still_starting_up_counts_as_unavailable():
    """A worker retries its final writes while the database is unavailable. A server that answered
    "starting up" to a new pooled connection raised an error it did not count as such, and the
    attempt gave up its success (the job ran again after its lease ran out)."""
    server = await asyncio.start_server(answer_starting_up, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    engine = db.create_engine(f"postgresql+asyncpg://nobody@127.0.0.1:{port}/nothing", pool_size=1)
    try:
        with pytest.raises(Exception, match="starting up") as refused:
            await db.fetch_rows(engine, NEXT, {"n": 1})
        assert db.is_unavailable(refused.value)
    finally:
        await engine.dispose()
        server.close()
        await server.wait_closed()
