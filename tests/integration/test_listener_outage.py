"""A worker's LISTEN connection lost while it subscribes is an outage like a failed connect: the
listener closes it, waits, connects again and hears the NOTIFYs sent after (app/queue/listener.py).

The server going away mid-LISTEN is stood in for by the LISTEN failing once with what asyncpg
raises then; asyncpg's `add_listener` is replaced for the test (a foreign library's method)."""

from __future__ import annotations

import asyncio
import errno
from typing import Any

import asyncpg
import pytest

from app import db
from app.queue import listener, sql, workerconfig

# Raised by asyncpg when the server goes away while a statement is on its way.
LOST_MID_LISTEN = [
    asyncpg.exceptions.InternalClientError(
        "cannot switch to state 11; another operation (None) is in progress"
    ),
    asyncpg.exceptions.ConnectionDoesNotExistError("connection was closed in the middle of operation"),
    OSError(errno.ENOTCONN, "Transport endpoint is not connected"),
]


def _failing_once(monkeypatch: pytest.MonkeyPatch, error: BaseException) -> list[asyncpg.Connection]:
    """Make the first LISTEN fail with `error`; the list then holds the connection it failed on."""
    original = asyncpg.Connection.add_listener
    failed: list[asyncpg.Connection] = []

    async def add_listener(conn: asyncpg.Connection, channel: str, callback: Any) -> None:
        if not failed:
            failed.append(conn)
            raise error
        await original(conn, channel, callback)

    monkeypatch.setattr(asyncpg.Connection, "add_listener", add_listener)
    return failed


def _listener(settings: Any, woken: asyncio.Queue[None]) -> listener.Listener:
    config = workerconfig.WorkerConfig(
        worker_id="listener-test", poll_interval_s=0.2, heartbeat_interval_s=0.2
    )
    dsn = db.asyncpg_dsn(settings.database_url)
    return listener.Listener(dsn, config, wake=lambda: woken.put_nowait(None), running={})


async def _woken(task: asyncio.Task[None], woken: asyncio.Queue[None]) -> None:
    """Wait for the listener's next wake; fail with its error where it ended instead."""
    wake = asyncio.ensure_future(woken.get())
    await asyncio.wait({task, wake}, timeout=10, return_when=asyncio.FIRST_COMPLETED)
    wake.cancel()
    if task.done():
        raise AssertionError(f"the listener ended: {task.exception()!r}")
    assert wake.done() and not wake.cancelled(), "no wake within 10 s"


@pytest.mark.parametrize("error", LOST_MID_LISTEN, ids=lambda error: type(error).__name__)
async def test_a_connection_lost_while_subscribing_is_reconnected_and_hears_later_notifies(
    settings, monkeypatch, error
):
    failed = _failing_once(monkeypatch, error)
    woken: asyncio.Queue[None] = asyncio.Queue()
    task = asyncio.create_task(_listener(settings, woken).run(), name="listener-under-test")
    try:
        await _woken(task, woken)  # subscribed, on a second connection
        assert failed and failed[0].is_closed()  # the first one, closed
        conn = await asyncpg.connect(db.asyncpg_dsn(settings.database_url))
        try:
            await conn.execute(f"NOTIFY {sql.QUEUED_CHANNEL}")
        finally:
            await conn.close()
        await _woken(task, woken)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_an_error_that_is_no_outage_still_ends_the_listener(settings, monkeypatch):
    """A LISTEN that fails for another reason (a bug) is not retried for ever: the worker stops."""
    _failing_once(monkeypatch, ValueError("not an outage"))
    woken: asyncio.Queue[None] = asyncio.Queue()
    with pytest.raises(ValueError, match="not an outage"):
        await asyncio.wait_for(_listener(settings, woken).run(), timeout=10)
