"""An upload's commit does not queue behind other transactions' NOTIFYs.

PostgreSQL serializes the commits of every transaction that notifies, under one lock held until
the commit is durable. Here another session holds that lock for as long as the test wants: its
commit waits for a synchronous standby that does not exist. This needs a server of its own
(`synchronous_standby_names` is server-wide), so the test starts one, whatever DATABASE_URL says.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import asyncpg

from app import db, migrate, pgserver
from app.api.main import create_app
from app.queue import sql
from app.queue.manager import JobManager
from tests.integration.test_worker import enqueue


@contextlib.asynccontextmanager
async def own_server(folder: Path) -> AsyncIterator[str]:
    """A private embedded server, migrated; its asyncpg (not SQLAlchemy) URL."""
    server = pgserver.EmbeddedPostgres(folder)
    url = await asyncio.to_thread(server.start)
    try:
        await asyncio.to_thread(migrate.upgrade, url)
        yield url
    finally:
        await asyncio.to_thread(server.stop)
    assert not (folder / "postmaster.pid").exists(), "the private server is still running"


async def until(check, timeout_s: float = 10) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def notify_lock_held(raw: str) -> AsyncIterator[Callable[[], Awaitable[None]]]:
    """Another session holds PostgreSQL's notify lock, stuck in its commit: it waits for a
    synchronous standby that does not exist (the database's own sessions commit with
    `synchronous_commit = local`, so they do not). Yields `release()`, which ends the wait."""
    admin = await asyncpg.connect(raw)
    await admin.execute("ALTER SYSTEM SET synchronous_standby_names = 'nobody'")
    await admin.execute("ALTER DATABASE postgres SET synchronous_commit = local")
    await admin.execute("SELECT pg_reload_conf()")
    # A session reads the configuration when it starts: connect once the reload has taken, or its
    # commit may not wait at all.
    while True:
        stuck = await asyncpg.connect(raw, server_settings={"synchronous_commit": "on"})
        if await stuck.fetchval("SHOW synchronous_standby_names") == "nobody":
            break
        await stuck.close()
        await asyncio.sleep(0.05)
    holder = asyncio.create_task(
        stuck.execute("BEGIN; CREATE TEMP TABLE held (x int); SELECT pg_notify('other', 'x'); COMMIT")
    )  # the table: a transaction id, so the commit waits for the standby

    async def holding() -> bool:
        query = "SELECT wait_event FROM pg_stat_activity WHERE pid = $1"
        return await admin.fetchval(query, stuck.get_server_pid()) == "SyncRep"

    async def release() -> None:
        await admin.execute("SELECT pg_cancel_backend($1)", stuck.get_server_pid())
        with contextlib.suppress(Exception):
            await asyncio.wait_for(holder, timeout=10)  # committed locally; the wait was cancelled

    try:
        await until(holding)
        yield release
    finally:
        await release()
        # Else the temporary table's drop when `stuck` closes waits for the standby, and the
        # server's shutdown waits for it (the server was left running).
        await stuck.execute("SET synchronous_commit = local")
        await admin.execute("ALTER SYSTEM RESET synchronous_standby_names")
        await admin.execute("SELECT pg_reload_conf()")
        await stuck.close()
        await admin.close()


async def test_an_upload_commits_while_another_notifier_is_stuck_in_its_commit(tmp_path):
    """With its NOTIFYs inside, ENQUEUE waited on the notify lock for as long as any other notifier
    took to commit (here, for ever). Now the job is stored at once, and its NOTIFYs follow when the
    lock is free."""
    async with own_server(tmp_path / "pg") as url:
        raw = url.replace("postgresql+asyncpg://", "postgresql://")
        listener = await asyncpg.connect(raw)
        engine = db.create_engine(url)
        try:
            notes: asyncio.Queue[str] = asyncio.Queue()
            await listener.add_listener(sql.QUEUED_CHANNEL, lambda *args: notes.put_nowait(args[3]))
            async with notify_lock_held(raw) as release:
                manager = JobManager(engine)
                job_id = await asyncio.wait_for(enqueue(manager), timeout=10)
                stored = await listener.fetchval("SELECT state FROM jobs WHERE id = $1", job_id)
                assert stored == "queued"
                assert notes.empty()  # its wake-up waits for the lock, in the background
                await release()
                assert await asyncio.wait_for(notes.get(), timeout=10) == "toy"
                await manager.teller.flush()
        finally:
            await listener.close()
            await engine.dispose()


async def test_the_api_stops_while_a_notifier_is_stuck_in_its_commit(settings, tmp_path):
    """The API's shutdown sends the NOTIFYs still due (Teller.flush). One stuck behind another
    notifier's commit held the shutdown for ever: SIGTERM never ended the process (before, uvicorn
    cut the stuck upload off after its graceful timeout). Now the shutdown gives them up after a
    few seconds; the workers' poll finds the jobs."""
    async with own_server(tmp_path / "pg") as url:
        raw = url.replace("postgresql+asyncpg://", "postgresql://")
        async with notify_lock_held(raw):
            app = create_app(settings.model_copy(update={"database_url": url, "run_worker": False}))

            async def serve_one_upload() -> None:
                async with app.router.lifespan_context(app):
                    await asyncio.wait_for(enqueue(app.state.services.manager), timeout=10)

            started = time.monotonic()
            await asyncio.wait_for(serve_one_upload(), timeout=30)
            assert time.monotonic() - started < 15
