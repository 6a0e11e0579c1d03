"""Teller: the queue's NOTIFYs, sent in the background after the commits they tell of."""

from __future__ import annotations

import asyncio
import itertools
import logging

from sqlalchemy.ext.asyncio import AsyncEngine

from app import db
from app.queue import sql

log = logging.getLogger("gpujobs.queue")


class Teller:
    """NOTIFYs sent in the background after the commits they tell of, many per statement (sql.TELL).

    `tell` returns at once; one statement is in flight at a time, and what is told meanwhile goes
    out together in the next. A database that fails the statement loses those notes (logged): the
    workers' poll finds the jobs, and a job's stream reads the database first."""

    MAX_NOTES = 500  # per statement

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine
        self._pending: dict[tuple[str, str], None] = {}  # ordered; a note told twice goes once
        self._sender: asyncio.Task[None] | None = None
        self._sending = 0  # notes in the statement in flight
        self.statements = 0  # sent (tests, benchmarks)

    def tell(self, channel: str, payload: str) -> None:
        self._pending[(channel, payload)] = None
        if self._sender is None or self._sender.done():
            self._sender = asyncio.get_running_loop().create_task(self._send(), name="gpujobs-teller")

    async def flush(self, timeout_s: float | None = None) -> None:
        """Wait until everything told so far was sent (or given up); after `timeout_s`, give up
        what is left (logged): a statement waiting behind another notifier's commit, which can
        wait for ever, must not hold a shutdown."""
        try:
            async with asyncio.timeout(timeout_s):
                while self._sender is not None and not self._sender.done():
                    await asyncio.shield(self._sender)
        except TimeoutError:
            assert self._sender is not None
            left = len(self._pending) + self._sending
            self._pending.clear()
            self._sender.cancel()
            await asyncio.wait({self._sender})
            log.warning(
                "%d NOTIFYs not sent within %.1f s; workers find their jobs on their poll", left, timeout_s,
                extra={"action": "notify_lost"},
            )  # fmt: skip

    async def _send(self) -> None:
        while self._pending:
            notes = list(itertools.islice(self._pending, self.MAX_NOTES))
            for note in notes:
                del self._pending[note]
            values = {"channels": [c for c, _ in notes], "payloads": [p for _, p in notes]}
            self._sending = len(notes)
            try:
                await db.fetch_row(self._engine, sql.TELL, values)
                self.statements += 1
            except Exception as exc:
                unavailable = db.is_unavailable(exc)
                log.warning(
                    "%d NOTIFYs not sent (%s); workers find their jobs on their poll", len(notes), exc,
                    exc_info=not unavailable, extra={"action": "notify_lost"},
                )  # fmt: skip
            finally:
                self._sending = 0
