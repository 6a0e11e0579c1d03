"""GET /jobs/{id}/stream: server-sent events of a job's state and progress until it ends.

Events, each `data:` a JSON object {job, kind, state, attempt, progress, ...}:

- `state`: the job moved (submitted, claimed, started, retry_scheduled, recovered, ..., succeeded).
  Its SSE `id` is the job_events id, so ids grow with every change of the job.
- `progress`: the model reported progress. Milestones written to the history carry an id; the
  frequent updates in between carry none (they are not kept, only the latest counts).

On connect the stream sends the current state (with the newest event id), then live events; after
a reconnect with `Last-Event-ID: n` it sends the events after `n` from the history instead, so
nothing is repeated or skipped (an `n` past the job's newest event is not the job's: the stream
starts as on a first connect). It closes after a final state. Live events come from the process's
one LISTEN connection (`notify.JobFeed`); the database is read only on connect and after the feed
lost notifications (RESYNC), never polled. A client that reconnects to a finished job having seen
its last event gets 204, which tells a browser's EventSource to stop reconnecting. When the server
is told to exit, or a read of the database fails, the stream ends its body at once (the client
reconnects with Last-Event-ID).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import datetime
from typing import Annotated, Any

import prometheus_client
import pydantic
from fastapi import APIRouter, Header, Request
from fastapi.responses import Response, StreamingResponse

from app import db, notify
from app.api.deps import CallerDep, ServicesDep
from app.api.schemas import ErrorPublic
from app.queue import manager as manager_
from app.queue import records
from app.queue.jobs import Job, JobState

log = logging.getLogger("gpujobs.api")

router = APIRouter(prefix="/jobs", tags=["jobs"])

RETRY_MS = 2000
# The state a job is in right after each kind of event (for history replayed from job_events).
KIND_STATE = {
    "submitted": "queued",
    "retried": "queued",
    "recovered": "queued",
    "released": "queued",
    "out_of_memory": "queued",
    "retry_scheduled": "scheduled",
    "claimed": "running",
    "started": "running",
    "progress": "running",
    "cancel_requested": "running",
}
FINAL = frozenset(s.value for s in JobState if s.final)
# Times as every other answer writes them (`...Z`, README "HTTP API"): the response schemas' own.
_TIME = pydantic.TypeAdapter(datetime)
EXITING = "exiting"  # JobStream._next: the server is exiting


def sse(event: str, data: dict[str, Any], event_id: int | None = None) -> str:
    """One server-sent event."""
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}event: {event}\ndata: {json.dumps(data, default=str)}\n\n"


def _replayed(events: list[records.Event]) -> list[float]:
    """Each event's progress: a progress event's own, one sending the job back to wait 0, any
    other's that of its attempt so far (a run's `started` is written after its first milestones:
    0.0 there took the bar back)."""
    progress, attempt, out = 0.0, None, []
    for event in events:
        if event.attempt != attempt:
            progress, attempt = 0.0, event.attempt
        if event.kind == "progress":
            progress = float(event.detail.get("progress", 0.0) or 0.0)
        out.append(progress if KIND_STATE.get(event.kind) not in ("queued", "scheduled") else 0.0)
    return out


def _of_event(job: Job, event: records.Event, progress: float, *, newest: bool) -> str:
    """An event from the history, with its attempt's `progress` then; the newest one carries the
    job's current state and progress."""
    state = job.state.value if newest else KIND_STATE.get(event.kind, event.kind)
    progress = job.progress if newest else progress
    data = {
        "job": str(job.id),
        "kind": event.kind,
        "state": state,
        "attempt": event.attempt,
        "progress": progress,
        "at": _TIME.dump_python(event.at, mode="json"),
    }
    if newest and job.state.final and job.error:
        data["error"] = job.error
    return sse("progress" if event.kind == "progress" else "state", data, event.id)


def _of_note(note: notify.Note) -> str:
    data: dict[str, Any] = {
        "job": str(note.job),
        "kind": note.kind,
        "state": note.state,
        "attempt": note.attempt,
        "progress": note.progress,
    }
    if note.message:
        data["message"] = note.message
    live_progress = note.kind == "progress" or (note.kind is None and note.state == "running")
    return sse("progress" if live_progress else "state", data, note.event)


class JobStream:
    """One client's stream of one job (see the module doc)."""

    def __init__(
        self,
        manager: manager_.JobManager,
        feed: notify.JobFeed,
        job_id: uuid.UUID,
        *,
        owner: str | None,
        keepalive_s: float,
        open_streams: prometheus_client.Gauge,
        exiting: asyncio.Event,
        key_stands: Callable[[], Awaitable[bool]] | None = None,
    ) -> None:
        self._manager = manager
        # Whether the caller's key is still unrevoked: asked at most once a keepalive interval,
        # since a stream opened with it may be followed for hours (auth.KeyStore.unrevoked).
        self._key_stands = key_stands
        self._key_checked_s = time.monotonic()
        self._exiting = exiting  # set when the server is told to exit: the stream ends
        self._feed = feed
        self._open_streams = open_streams  # gpujobs_stream_subscribers
        self._job_id = job_id
        self._owner = owner
        self._keepalive_s = keepalive_s
        self.last_id = 0  # the newest event id sent
        self._progress = (0, -1.0)  # (attempt, progress) last sent
        self.done = False

    async def catch_up(self, after: int | None) -> list[str]:
        """From the database: the current state (after=None), or every event after `after`."""
        job, events = await self._manager.job_and_events(self._job_id, owner=self._owner)
        after = _known(after, events)
        replayed = list(zip(events, _replayed(events), strict=True))
        if after is None:
            replayed = replayed[-1:]
        else:  # the client has seen up to `after`: a later RESYNC must not send those again
            self.last_id = max(after, self.last_id)
            replayed = [(e, p) for e, p in replayed if e.id > self.last_id]
        events = [e for e, _ in replayed]
        out = [_of_event(job, e, p, newest=e is events[-1]) for e, p in replayed]
        if events:
            self.last_id = events[-1].id
        if (
            job.state is JobState.running
            and job.progress > 0
            and (job.attempt, job.progress) != self._progress
        ):
            self._progress = (job.attempt, job.progress)
            note = notify.Note(
                job.id, job.state.value, job.attempt, job.progress, None, None, job.progress_message
            )
            out.append(_of_note(note))
        self.done = job.state.final
        return out

    def on_note(self, note: notify.Note, *, stale: bool = False) -> str | None:
        """A live note as an event, or None when it repeats or predates what was sent.

        A `stale` note was waiting before the database was last read: its progress is news only
        above what that read sent. A later one is the model's newest word, lower or not (a model
        may report each of its stages from 0 to 1), unless it is of an earlier attempt."""
        if note.event is not None:
            if note.event <= self.last_id:
                return None
            self.last_id = note.event
        elif note.state == "running" and (
            (note.attempt, note.progress) < self._progress if stale else note.attempt < self._progress[0]
        ):
            return None
        if note.state == "running":
            self._progress = (note.attempt, note.progress)
        self.done = note.state in FINAL
        return _of_note(note)

    async def events(self, after: int | None) -> AsyncIterator[str]:
        """The whole stream: catch up, then live notes until a final state."""
        subscription = self._feed.subscribe(self._job_id)  # before reading: nothing falls in between
        self._open_streams.inc()  # a gauge the processes' files can sum: a count kept as the feed keeps it
        exiting = asyncio.create_task(self._exiting.wait(), name=f"stream-exit:{self._job_id}")
        try:
            yield f"retry: {RETRY_MS}\n\n"
            caught_up = await self._read(after)
            if caught_up is None:
                return
            for chunk in caught_up:
                yield chunk
            stale = subscription.pending  # notes that came before (or while) the database was read
            while not self.done:
                item = await self._next(subscription, exiting)
                if item is EXITING or not await self._key_still_stands():
                    return
                if item is None:
                    yield ": keepalive\n\n"
                    continue
                stale -= 1
                if isinstance(item, notify.Note):
                    live = self.on_note(item, stale=stale >= 0)
                    if live is not None:
                        yield live
                else:  # RESYNC: notes may have been lost; the history has them
                    caught_up = await self._read(self.last_id)
                    if caught_up is None:
                        return
                    for chunk in caught_up:
                        yield chunk
                    stale = subscription.pending
        finally:
            exiting.cancel()
            self._feed.unsubscribe(subscription)
            self._open_streams.dec()

    async def _key_still_stands(self) -> bool:
        """False once the caller's key was revoked (the stream then ends, and its client, asking
        again, is refused); asked of the database at most once per keepalive interval."""
        if self._key_stands is None or time.monotonic() - self._key_checked_s < self._keepalive_s:
            return True
        self._key_checked_s = time.monotonic()
        try:
            return await self._key_stands()
        except db.ERRORS:
            return True  # the database away: the stream's own reads end it if it stays away

    async def _read(self, after: int | None) -> list[str] | None:
        """`catch_up`, or None when the database failed the read: the stream then ends its body,
        and the client reconnects with Last-Event-ID. An error let out of the body cut the response
        mid-chunk, with an ERROR and its traceback in the log, for an outage the client rides out."""
        try:
            return await self.catch_up(after)
        except db.ERRORS as exc:
            log.warning(
                "event stream ended: its read of the database failed: %s",
                exc,
                extra={"action": "stream_db_error", "job_id": str(self._job_id)},
            )
            return None

    async def _next(
        self, subscription: notify.Subscription, exiting: asyncio.Task[Any]
    ) -> notify.Note | str | None:
        """The subscription's next item (None: time for a keepalive), or EXITING once the server is
        told to exit. The stream then ends its body at once, and the client reconnects with
        Last-Event-ID to another process or this one's successor: held open, it kept the shutdown
        waiting for uvicorn's 5 s, then was cut with an error in the log and a truncated body."""
        if exiting.done():
            return EXITING
        item = asyncio.create_task(subscription.next(self._keepalive_s), name=f"stream:{self._job_id}")
        await asyncio.wait([item, exiting], return_when=asyncio.FIRST_COMPLETED)
        if not item.done():
            item.cancel()  # a note it would have taken is not sent: the stream ends here
            return EXITING
        return item.result()


def _known(after: int | None, events: list[records.Event]) -> int | None:
    """`after`, or None (a fresh start) when it is past the job's newest event. Ids come from one
    sequence for every job, so a client may bring another job's: taken as seen, it dropped every
    later event of this job as already sent, the final one too, and the stream never ended."""
    newest = events[-1].id if events else 0
    return None if after is None or after > newest else after


PG_BIGINT_MAX = 2**63 - 1


def _last_event_id(value: str | None) -> int | None:
    # Header bytes arrive as latin-1: '²' passes str.isdigit() and int() refuses it, so ASCII only
    digits = (value or "").strip()
    if not (digits.isascii() and digits.isdigit()) or len(digits) > 19:  # int() of 4,300 digits raises
        return None
    number = int(digits)
    return number if number <= PG_BIGINT_MAX else None  # past any event id PostgreSQL can hold


@router.get(
    "/{job_id}/stream",
    response_class=StreamingResponse,
    responses={
        200: {"content": {"text/event-stream": {}}, "description": "state and progress events"},
        204: {"description": "The job has ended and Last-Event-ID is its last event: nothing to follow"},
        404: {"model": ErrorPublic, "description": "No such job"},
    },
)
async def stream_job(
    job_id: uuid.UUID,
    request: Request,
    services: ServicesDep,
    caller: CallerDep,
    last_event_id: Annotated[str | None, Header()] = None,  # any length: what is no id is ignored
) -> Response:
    """Server-sent events of the job's state and progress until it ends; resumes after Last-Event-ID."""
    job = await services.manager.get(job_id, owner=caller.owner_filter)  # 404 before the stream starts
    after = _last_event_id(last_event_id)
    if after is not None and job.state.final:
        events = await services.manager.events(job_id, owner=caller.owner_filter)
        if after == (events[-1].id if events else 0):  # it has seen the end: an EventSource stops on 204
            return Response(status_code=204)
    stands = None if caller.key_id is None else functools.partial(services.keys.unrevoked, caller.key_id)
    stream = JobStream(
        services.manager,
        request.app.state.feed,
        job_id,
        owner=caller.owner_filter,
        keepalive_s=request.app.state.settings.stream_keepalive_s,
        open_streams=request.app.state.metrics.streams,
        exiting=request.app.state.exiting,
        key_stands=stands,
    )
    return StreamingResponse(
        stream.events(after),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
