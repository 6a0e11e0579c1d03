"""db.fetch_rows: hot statements on the pool's asyncpg connections, without SQLAlchemy around them."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest
from sqlalchemy import text

from app import db
from tests.conftest import lock_waiter

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


def _message(kind: bytes, body: bytes) -> bytes:
    """One message of PostgreSQL's wire protocol."""
    return kind + (len(body) + 4).to_bytes(4, "big") + body


def _fatal(code: str, text: str) -> bytes:
    return _message(b"E", f"SFATAL\0VFATAL\0C{code}\0M{text}\0\0".encode())


def fatal_server(code: str, text: str, *, after_startup: bool):
    """A server that answers a connection as PostgreSQL does in trouble: no TLS, then FATAL `code`
    at once (refused at the door) or, `after_startup`, at the first query (a session cut off)."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        length = int.from_bytes(await reader.readexactly(4), "big")
        body = await reader.readexactly(length - 4)
        if body[:4] == (80877103).to_bytes(4, "big"):  # SSLRequest: answer "no TLS", read the startup
            writer.write(b"N")
            length = int.from_bytes(await reader.readexactly(4), "big")
            await reader.readexactly(length - 4)  # the startup message
        if after_startup:
            settings = [
                (b"server_version", b"18.0"),
                (b"client_encoding", b"UTF8"),
                (b"integer_datetimes", b"on"),
            ]
            writer.write(_message(b"R", (0).to_bytes(4, "big")))  # no password asked
            writer.writelines(_message(b"S", name + b"\0" + value + b"\0") for name, value in settings)
            writer.write(_message(b"K", (1).to_bytes(4, "big") * 2) + _message(b"Z", b"I"))
            await reader.read(1)  # the first query
        writer.write(_fatal(code, text))
        await writer.drain()
        writer.close()

    return answer


@pytest.mark.parametrize(
    ("code", "text", "after_startup"),
    [
        ("57P03", "the database system is starting up", False),
        ("53300", "sorry, too many clients already", False),
        ("57P02", "terminating connection because of crash of another server process", True),
    ],
    ids=["starting up", "too many clients", "another backend crashed"],
)
async def test_a_server_in_trouble_for_a_while_counts_as_unavailable(
    code: str, text: str, after_startup: bool
):
    """A worker retries its final writes while the database is unavailable. Errors PostgreSQL
    gives for a while, then not, were not counted as such (starting up; every connection taken, as
    when every process reconnects after a restart), and the attempt gave up its success: its
    results deleted and an attempt spent, or the job run again after its lease ran out. (A
    backend's crash, which ends every session, was counted: asyncpg reports the closed connection.)"""
    server = await asyncio.start_server(fatal_server(code, text, after_startup=after_startup), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    engine = db.create_engine(f"postgresql+asyncpg://nobody@127.0.0.1:{port}/nothing", pool_size=1)
    try:
        with pytest.raises(Exception, match=text.split(",")[0]) as refused:
            await db.fetch_rows(engine, NEXT, {"n": 1})
        assert db.is_unavailable(refused.value)
        with pytest.raises(Exception, match=text.split(",")[0]) as refused:  # and through SQLAlchemy
            async with engine.connect() as conn:
                await conn.execute(NEXT, {"n": 1})
        assert db.is_unavailable(refused.value)
    finally:
        await engine.dispose()
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize("path", ["fetch_rows", "sqlalchemy"])
async def test_a_statement_rolled_back_to_break_a_deadlock_counts_as_passing_trouble(engine, settings, path):
    """PostgreSQL ends a deadlock by failing one of its statements (40P01), which wrote nothing and
    succeeds when sent again. It was taken for a bad statement: a worker whose heartbeat lost such
    a draw stopped (its side task died), and an attempt whose final write lost it failed the job
    instead of writing its outcome again."""
    async with engine.begin() as conn:
        await conn.execute(text("CREATE TABLE pair (id int PRIMARY KEY)"))
        await conn.execute(text("INSERT INTO pair VALUES (1), (2)"))
        # A waiting session looks for a deadlock once, deadlock_timeout into its wait: the taker 3 s
        # in (time for the holder to close the cycle on a busy machine), the holder a minute in. So
        # the taker is the one PostgreSQL fails.
        name = await conn.scalar(text("SELECT current_database()"))
        await conn.execute(text(f"ALTER DATABASE \"{name}\" SET deadlock_timeout = '3s'"))
    both = text("SELECT id FROM pair ORDER BY id DESC FOR UPDATE")  # 2, then waits for 1
    taking = db.create_engine(settings.database_url, pool_size=1)  # new sessions: the 3 s

    async def take_both() -> None:
        if path == "fetch_rows":
            await db.fetch_rows(taking, both, {})
        else:
            async with taking.begin() as conn:
                await conn.execute(both)

    try:
        async with engine.connect() as holder:
            await holder.execute(text("SET deadlock_timeout = '60s'"))
            await holder.execute(text("SELECT id FROM pair WHERE id = 1 FOR UPDATE"))
            taker = asyncio.create_task(take_both())
            await lock_waiter(engine, "%DESC FOR UPDATE")
            await holder.execute(text("SELECT id FROM pair WHERE id = 2 FOR UPDATE"))  # the cycle
            await holder.rollback()
        with pytest.raises(Exception, match="deadlock") as failed:
            await taker
        assert db.is_unavailable(failed.value)
        [row] = await db.fetch_rows(taking, text("SELECT count(*) AS n FROM pair"), {})  # sent again, it goes
        assert row["n"] == 2
    finally:
        await taking.dispose()


async def test_a_socket_folder_written_as_libpq_writes_it_in_the_host_connects(database_url):
    """postgresql://%2Fsocket%2Ffolder/db, libpq's form: the engine (SQLAlchemy's asyncpg dialect)
    and LISTEN's connection (asyncpg's own URL parser) both reach the server through the socket."""
    from urllib.parse import quote

    from sqlalchemy.engine import make_url

    from app.settings import Settings

    given = make_url(database_url)
    folder = str(given.query.get("host", ""))
    if not folder.startswith("/"):
        pytest.skip("the tests' server is not reached through a socket folder")
    libpq = f"postgresql://{given.username}@{quote(folder, safe='')}/{given.database}"
    url = Settings(database_url=libpq).database_url
    engine = db.create_engine(url, pool_size=1)
    try:
        assert (await db.fetch_row(engine, NEXT, {"n": 1}))["next"] == 2
    finally:
        await engine.dispose()
    listening = await asyncpg.connect(db.asyncpg_dsn(url))
    try:
        assert await listening.fetchval("SELECT 1") == 1
    finally:
        await listening.close()
