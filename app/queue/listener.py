"""A worker's LISTEN side: NOTIFYs of new jobs wake its claims, those of cancels stop the attempt.

A slow poll of the claim loop covers the time the connection is lost."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import asyncpg

from app import db
from app.queue import attempt as attempt_
from app.queue import sql, workerconfig

# The first wait before the listener connects again; it doubles, up to the poll interval.
LISTEN_RETRY_S = 0.5


class Listener:
    """One LISTEN connection, made again with backoff after it is lost."""

    def __init__(
        self,
        dsn: str | None,
        config: workerconfig.WorkerConfig,
        *,
        wake: Callable[[], None],
        running: Mapping[uuid.UUID, tuple[attempt_.Attempt, asyncio.Task[None]]],
    ) -> None:
        self._dsn = dsn  # None: nothing is listened to (the claims poll)
        self._config = config
        self._wake = wake  # jobs may have been queued: look for work
        self._running = running  # the worker's attempts in hand, by job: a canceled one stops

    async def run(self) -> None:
        """LISTEN for new jobs and cancels; reconnect with backoff after losing the connection."""
        if self._dsn is None:
            await asyncio.Event().wait()
        # The backoff stops at the poll interval: the reconnect wakes the claims, whose own backoff
        # grows further. Up to 30 s, as before, an idle worker left the jobs queued once the
        # database was back waiting that long.
        most_s = max(LISTEN_RETRY_S, self._config.poll_interval_s)
        delay = LISTEN_RETRY_S
        while True:
            # A server that goes away while the LISTENs are sent fails them with a connection
            # error (InternalClientError, ConnectionDoesNotExistError, OSError): an outage like a
            # failed connect, not a reason to stop the worker.
            try:
                conn = await asyncpg.connect(self._dsn)
                await self._listen_on(conn)
            except Exception as exc:
                if not db.is_unavailable(exc):
                    raise
                await asyncio.sleep(delay)
                delay = min(delay * 2, most_s)
                continue
            delay = LISTEN_RETRY_S  # it listened until the connection was lost

    async def _listen_on(self, conn: asyncpg.Connection) -> None:
        """Subscribe on `conn` and listen until it is lost; closed however this ends."""
        lost = asyncio.Event()
        conn.add_termination_listener(lambda _: lost.set())
        try:  # closed however this ends, a cancel while subscribing included
            await conn.add_listener(sql.QUEUED_CHANNEL, lambda *_: self._wake())
            await conn.add_listener(sql.CANCEL_CHANNEL, self._on_cancel)
            self._wake()  # jobs may have been queued while we were not listening
            while not lost.is_set() and not conn.is_closed():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(lost.wait(), timeout=self._config.heartbeat_interval_s)
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(conn.close(), timeout=2)
            if not conn.is_closed():
                conn.terminate()

    def _on_cancel(self, _conn: Any, _pid: int, _channel: str, payload: str) -> None:
        with contextlib.suppress(ValueError):
            entry = self._running.get(uuid.UUID(payload))
            if entry is not None:
                entry[0].stop(attempt_.CANCELED)
