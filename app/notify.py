"""JobFeed: one LISTEN connection per process, fanned out in memory to the subscribers of each job.

Every statement that changes a job's state or progress sends a NOTIFY on `sql.JOB_CHANNEL` with a
small JSON payload: {job, state, attempt, progress, event, kind[, message]} (`event` is the
job_events id it wrote, null for plain progress). The feed parses each notification once and hands
it to the subscribers of that job; nobody polls the database.

Notifications sent while the connection is down are lost. So on every (re)connect, and whenever a
slow subscriber's buffer overflows, the subscriber receives `RESYNC` and re-reads what it missed
from the database (job_events are durable and ordered), then goes on with live notes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Final

import asyncpg

from app.queue import sql

log = logging.getLogger("gpujobs.notify")

RESYNC: Final = "resync"  # queue marker: notes may have been lost, read the database again
_PING_S: Final = 15.0  # how often an idle LISTEN connection is checked


@dataclass(frozen=True, slots=True)
class Note:
    """One change of a job, as told by NOTIFY."""

    job: uuid.UUID
    state: str
    attempt: int
    progress: float
    event: int | None = None
    kind: str | None = None
    message: str | None = None

    @classmethod
    def parse(cls, payload: str) -> Note | None:
        """The note in a NOTIFY payload; None if it is not one of ours."""
        try:
            data = json.loads(payload)
            return cls(
                job=uuid.UUID(str(data["job"])),
                state=str(data["state"]),
                attempt=int(data.get("attempt") or 0),
                progress=float(data.get("progress") or 0.0),
                event=None if data.get("event") is None else int(data["event"]),
                kind=data.get("kind"),
                message=data.get("message"),
            )
        except (ValueError, KeyError, TypeError):
            return None


class Subscription:
    """What one stream receives: notes about its job, or `RESYNC`."""

    def __init__(self, job_id: uuid.UUID, *, limit: int = 256) -> None:
        self.job_id = job_id
        self._limit = limit
        self._queue: asyncio.Queue[Note | str] = asyncio.Queue()

    def push(self, item: Note | str) -> None:
        """Deliver a note; a full buffer is dropped and replaced by one RESYNC."""
        if self._queue.qsize() >= self._limit:
            while not self._queue.empty():
                self._queue.get_nowait()
            item = RESYNC
        self._queue.put_nowait(item)

    @property
    def pending(self) -> int:
        """How many notes (or RESYNC) wait to be taken."""
        return self._queue.qsize()

    async def next(self, timeout_s: float) -> Note | str | None:
        """The next note or RESYNC; None when nothing came within `timeout_s`."""
        try:
            return await asyncio.wait_for(self._queue.get(), timeout=timeout_s)
        except TimeoutError:
            return None


class JobFeed:
    """The process's LISTEN connection on the job channel and its subscribers."""

    # The reconnect backoff stops at 2 s: its streams show nothing of their jobs until it is back
    # (up to 30 s after the database's return, when it stopped at 30 s).
    def __init__(self, dsn: str | None, *, max_backoff_s: float = 2.0) -> None:
        self._dsn = dsn
        self._max_backoff_s = max_backoff_s
        self._subscribers: defaultdict[uuid.UUID, set[Subscription]] = defaultdict(set)
        self.connected = asyncio.Event()

    def subscribe(self, job_id: uuid.UUID) -> Subscription:
        """Start receiving notes about a job (subscribe before reading its state)."""
        subscription = Subscription(job_id)
        self._subscribers[job_id].add(subscription)
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        """Stop receiving notes."""
        found = self._subscribers.get(subscription.job_id)
        if found is not None:
            found.discard(subscription)
            if not found:
                del self._subscribers[subscription.job_id]

    @property
    def subscribers(self) -> int:
        """How many streams are open in this process."""
        return sum(len(s) for s in self._subscribers.values())

    def deliver(self, note: Note) -> None:
        """Hand a note to every subscriber of its job."""
        for subscription in list(self._subscribers.get(note.job, ())):
            subscription.push(note)

    def _resync_all(self) -> None:
        for subscriptions in list(self._subscribers.values()):
            for subscription in list(subscriptions):
                subscription.push(RESYNC)

    def _on_notify(self, _conn: Any, _pid: int, _channel: str, payload: str) -> None:
        note = Note.parse(payload)
        if note is not None:
            self.deliver(note)

    async def run(self) -> None:
        """LISTEN until cancelled, reconnecting with backoff; never gives up."""
        if self._dsn is None:
            await asyncio.Event().wait()
        delay = 0.2
        while True:
            try:
                conn = await asyncpg.connect(self._dsn)
            except Exception as exc:  # any failure to connect: wait and try again
                log.warning("job feed cannot connect: %s", exc, extra={"action": "feed_down"})
                await asyncio.sleep(delay)
                delay = min(delay * 2, self._max_backoff_s)
                continue
            delay = 0.2
            await self._listen_on(conn)

    async def _listen_on(self, conn: asyncpg.Connection) -> None:
        lost = asyncio.Event()
        conn.add_termination_listener(lambda _: lost.set())
        try:
            await conn.add_listener(sql.JOB_CHANNEL, self._on_notify)
            self.connected.set()
            self._resync_all()  # anything sent while we were not listening is read from the database
            log.info("job feed listening", extra={"action": "feed_up"})
            while not lost.is_set() and not conn.is_closed():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(lost.wait(), timeout=_PING_S)
                if not lost.is_set():
                    await asyncio.wait_for(conn.execute("SELECT 1"), timeout=_PING_S)
        except Exception as exc:  # a broken connection: reconnect
            log.warning("job feed lost its connection: %s", exc, extra={"action": "feed_down"})
        finally:
            self.connected.clear()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(conn.close(), timeout=2)
            if not conn.is_closed():
                conn.terminate()
