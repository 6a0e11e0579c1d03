"""JobManager: the only code that runs queue SQL. Each method is one short transaction."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import logging
import math
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import exc as sa_exc
from sqlalchemy import select, tuple_
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from app import db, errors
from app.queue import batcher, records, sql
from app.queue.jobs import Claimed, Job, JobState, ResultFile, classes_up_to, vram_class

log = logging.getLogger("gpujobs.queue")

# `app.tables` (the ORM classes) is imported by the three reads that use it (get, list_jobs,
# input_by_id), not here: a worker seldom calls them, and building the classes cost each worker's
# start about 0.12 s of CPU on a 2-core VM (`import app.db`: 634 ms, with `app.tables` 752 ms).


# An aging step longer than this (100 years) is never reached by a queued job. Longer ones are
# out of PostgreSQL's interval and timestamp ranges, and AGE_QUEUED would fail on them.
AGE_STEP_NEVER_S = 100 * 365.25 * 86_400
# The reason in the `released` event of a job whose claim's answer was lost (sql.RELEASE_UNKNOWN).
LOST_CLAIM = "the answer of its claim was lost"


@dataclass(frozen=True, slots=True)
class NewInput:
    """A checked image, ready to store."""

    sha256: str
    media_type: str
    width: int
    height: int
    data: bytes | memoryview  # a view of the upload's buffer (app/api/limits.py), sent as it is

    @property
    def megapixels(self) -> float:
        """Width times height, in millions of pixels."""
        return self.width * self.height / 1e6

    def row_values(self) -> dict[str, Any]:
        """Its row of `inputs`, as bind parameters."""
        return {
            "sha256": self.sha256,
            "media_type": self.media_type,
            "width": self.width,
            "height": self.height,
            "bytes": len(self.data),
            "data": self.data,
        }


@dataclass(frozen=True, slots=True)
class NewJob:
    """Everything needed to queue a job; values are already validated."""

    owner: str
    model: str
    params: Mapping[str, Any]
    priority: int
    vram_mb: int
    max_attempts: int
    idempotency_key: str | None = None
    declared_vram_mb: int | None = None  # the registry's estimate, when vram_mb was learned
    request_sha256: str | None = None  # the request as sent, with an idempotency key (intake.fingerprint)


@dataclass(frozen=True, slots=True)
class Event:
    """One row of a job's history."""

    id: int
    at: datetime
    kind: str
    attempt: int
    worker_id: str | None
    detail: dict[str, Any]


@dataclass(frozen=True, slots=True)
class TakenBack:
    """A running job taken back from a lost worker."""

    id: uuid.UUID
    attempt: int
    worker_id: str | None
    state: JobState
    pid: int | None
    host: str | None


@dataclass(frozen=True, slots=True)
class Page:
    """One page of a job listing."""

    jobs: list[Job]
    next_cursor: str | None


def _cursor(job: Job) -> str:
    raw = f"{job.created_at.isoformat()}|{job.id}"
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def _parse_cursor(cursor: str) -> tuple[datetime, uuid.UUID]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        at, _, job_id = raw.partition("|")
        when = datetime.fromisoformat(at)
        if when.tzinfo is None:
            raise ValueError("a cursor's time has its offset")
        # In UTC, as cursors are made: 0001-01-01 at +14:00 is a date PostgreSQL cannot hold.
        return when.astimezone(UTC), uuid.UUID(job_id)
    except (ValueError, OverflowError, UnicodeDecodeError) as exc:
        raise errors.InvalidRequest("cursor: not a cursor from a previous page", field="cursor") from exc


def _success_values(items: Sequence[tuple[Job, str, str]]) -> dict[str, Any]:
    """SUCCEED's parameters for (job, results JSON, detail JSON) items: parallel arrays."""
    return {
        "ids": [job.id for job, _, _ in items],
        "attempts": [job.attempt for job, _, _ in items],
        "results": [results for _, results, _ in items],
        "details": [detail for _, _, detail in items],
    }


def _offers(
    gpu_ids: Sequence[int], limit: int, slots: Mapping[int, int] | None, ahead: Mapping[int, int] | None
) -> tuple[list[int], list[int]]:
    """Per GPU of a claim: the jobs it may take (its slots, at most `limit`), and of those the ones
    past its slots free now (its slots less `ahead`), which wait for a running job to end."""
    if slots is None:
        return [limit] * len(gpu_ids), [0] * len(gpu_ids)
    offered = [min(limit, slots[g]) for g in gpu_ids]
    ahead = ahead or {}
    return offered, [max(0, n - (slots[g] - ahead.get(g, 0))) for g, n in zip(gpu_ids, offered, strict=True)]


def _claimed(rows: Iterable[Any]) -> list[Claimed]:
    """Claimed jobs from CLAIM's rows, with their input images."""
    return [
        Claimed(
            Job.from_row(row),
            None if row["input_data"] is None else (str(row["input_media_type"]), bytes(row["input_data"])),
        )
        for row in rows
    ]


class WaitingCount:
    """What this process knows of the number of jobs waiting (queued or scheduled), so that an
    enqueue counts them only when the queue may be near its limit.

    Counting reads one index entry per job waiting: 1.6 ms of PostgreSQL per upload beside 9,900
    queued jobs. In the limit's last tenth (at least MARGIN jobs) every enqueue counts (uploads
    written at the same moment each see the count before the others, so a burst may still pass it
    by as many). Below that, a count at most REFRESH_S old, plus the jobs this process queued since,
    decides; jobs other processes queued in that time go unseen, so the limit can be passed only by
    more than a tenth of it (MARGIN at least) queued within REFRESH_S."""

    REFRESH_S = 1.0
    MARGIN = 100

    def __init__(self) -> None:
        self._count: int | None = None
        self._at = -math.inf

    def must_count(self, limit: int) -> bool:
        """Whether the next enqueue must count the jobs waiting, for a queue limit of `limit`."""
        if self._count is None or time.monotonic() - self._at > self.REFRESH_S:
            return True
        return self._count >= limit - max(self.MARGIN, limit // 10)

    def counted(self, count: int) -> None:
        """An enqueue counted `count` jobs waiting (at most the limit)."""
        self._count, self._at = count, time.monotonic()

    def added(self) -> None:
        """This process queued one more job."""
        if self._count is not None:
            self._count += 1

    @property
    def known(self) -> int | None:
        """The jobs waiting as this process knows them: the last count, plus what it queued since."""
        return self._count


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


class JobManager:
    """Queue operations over one engine. Domain errors come out as `errors.AppError`."""

    def __init__(
        self, engine: AsyncEngine, *, queue_engine: AsyncEngine | None = None, quarantine_after: int = 3
    ) -> None:
        self._engine = engine
        self._queue_engine = engine if queue_engine is None else queue_engine  # claims, successes
        # Every unit below but expire is one statement, atomic on its own: autocommit
        # saves the BEGIN and COMMIT round trips a transaction would add around it.
        self._auto = engine.execution_options(isolation_level="AUTOCOMMIT")
        self.quarantine_after = quarantine_after  # abnormal deaths (signals, lost workers) allowed
        self.waiting = WaitingCount()  # for the queue limit of enqueue()
        self._successes: batcher.Batcher[tuple[Job, str, str], bool] = batcher.Batcher(self._succeed_many)
        self.teller = Teller(engine)

    # -- intake ---------------------------------------------------------------------------

    async def enqueue(
        self, job: NewJob, image: NewInput, *, queue_limit: int, owner_limit: int = 0
    ) -> tuple[Job, bool]:
        """Store the image (once per content) and queue the job, in one statement; (job, created).

        A repeated idempotency key gives back the owner's earlier job. QueueFull, with nothing
        written, when `queue_limit` jobs wait, or `owner_limit` of the owner's (0: no limit).
        """
        values = self._job_values(job, image, queue_limit=queue_limit, owner_limit=owner_limit)
        values["count_waiting"] = counting = self.waiting.must_count(queue_limit)
        row = await db.fetch_row(self._engine, sql.ENQUEUE, values)  # the hot path of every upload
        if counting:
            self.waiting.counted(row["jobs_waiting"])
        if row["outcome"] == "queued":
            self.waiting.added()
        if row["outcome"] == "queue_full":
            raise errors.QueueFull(f"the queue is full ({queue_limit} jobs waiting); try again later")
        if row["outcome"] == "owner_full":
            raise errors.QueueFull(
                f"you have {owner_limit} jobs waiting, the most one key may queue; "
                "try again once some have started",
                retry_after_s=30,
            )
        if row["id"] is None:  # a concurrent request with the same idempotency key won
            async with self._auto.connect() as conn:
                if row["stored_input"] is not None:  # the image it stored is nobody's
                    with contextlib.suppress(sa_exc.IntegrityError):  # a job took it meanwhile
                        await conn.execute(sql.DROP_UNUSED_INPUT, {"id": row["stored_input"]})
                existing = await self._idempotent(conn, job.owner, job.idempotency_key)
            assert existing is not None
            return existing, False
        stored = Job.from_row(row)
        if row["outcome"] == "queued":
            self._tell_queued(stored, row["submitted_event"])
        return stored, row["outcome"] == "queued"

    def _tell_queued(self, job: Job, event: int) -> None:
        """Have the queued job's NOTIFYs sent (after ENQUEUE's commit: sql.TELL says why)."""
        note: dict[str, object] = {"job": str(job.id), "state": job.state.value, "attempt": job.attempt}
        note |= {"progress": job.progress, "event": event, "kind": "submitted"}
        self.teller.tell(sql.JOB_CHANNEL, json.dumps(note))
        self.teller.tell(sql.QUEUED_CHANNEL, job.model)

    async def find_idempotent(self, owner: str, key: str) -> Job | None:
        """The owner's job queued with this idempotency key, if any."""
        async with self._auto.connect() as conn:
            return await self._idempotent(conn, owner, key)

    @staticmethod
    async def _idempotent(conn: AsyncConnection, owner: str, key: str | None) -> Job | None:
        row = (await conn.execute(sql.FIND_IDEMPOTENT, {"owner": owner, "key": key})).first()
        return None if row is None else Job.from_row(row)

    @staticmethod
    def _job_values(job: NewJob, image: NewInput, *, queue_limit: int, owner_limit: int) -> dict[str, Any]:
        return {
            "owner": job.owner,
            "model": job.model,
            "params": json.dumps(dict(job.params)),
            "megapixels": image.megapixels,
            "priority": job.priority,
            "vram_mb": job.vram_mb,
            "declared_vram_mb": job.vram_mb if job.declared_vram_mb is None else job.declared_vram_mb,
            "max_attempts": job.max_attempts,
            "idempotency_key": job.idempotency_key,
            "request_sha256": job.request_sha256,
            "queue_limit": queue_limit,
            "owner_limit": max(owner_limit, 0),
            **image.row_values(),
        }

    # -- reading --------------------------------------------------------------------------

    async def get(self, job_id: uuid.UUID, *, owner: str | None = None) -> Job:
        """One job; JobNotFound if it does not exist or belongs to someone else."""
        async with self._auto.connect() as conn:
            return await self._get(conn, job_id, owner)

    @staticmethod
    async def _get(conn: AsyncConnection, job_id: uuid.UUID, owner: str | None) -> Job:
        from app import tables  # late, as the note at the imports says

        query = select(tables.JobRow.__table__).where(tables.JobRow.id == job_id)
        if owner is not None:
            query = query.where(tables.JobRow.owner == owner)
        row = (await conn.execute(query)).first()
        if row is None:
            raise errors.JobNotFound(f"no job {job_id}")
        return Job.from_row(row)

    async def list_jobs(
        self,
        *,
        owner: str | None = None,
        state: JobState | None = None,
        model: str | None = None,
        cursor: str | None = None,
        limit: int = 50,
    ) -> Page:
        """Jobs newest first, filtered, one page at a time."""
        from app import tables

        t = tables.JobRow
        query = select(t.__table__).order_by(t.created_at.desc(), t.id.desc()).limit(limit + 1)
        if owner is not None:
            query = query.where(t.owner == owner)
        if state is not None:
            query = query.where(t.state == state)
        if model is not None:
            query = query.where(t.model == model)
        if cursor is not None:
            at, job_id = _parse_cursor(cursor)
            # A row comparison: the list's indexes (created_at DESC, id DESC) start at the cursor.
            # Spelt as `created_at < at OR (created_at = at AND id < job_id)` every older row was
            # read and sorted, however deep the page.
            query = query.where(tuple_(t.created_at, t.id) < tuple_(at, job_id))
        async with self._auto.connect() as conn:
            jobs = [Job.from_row(r) for r in (await conn.execute(query)).all()]
        more = len(jobs) > limit
        jobs = jobs[:limit]
        return Page(jobs, _cursor(jobs[-1]) if more else None)

    async def input_image(self, job_id: uuid.UUID, *, owner: str | None = None) -> tuple[str, bytes]:
        """The job's uploaded image: (media type, bytes)."""
        job = await self.get(job_id, owner=owner)
        return await self.input_by_id(job.input_id)

    async def input_by_id(self, input_id: int | None) -> tuple[str, bytes]:
        """An uploaded image by its id: (media type, bytes)."""
        if input_id is None:
            raise errors.Gone("the job's input image was deleted by retention")
        from app import tables

        t = tables.Input
        async with self._auto.connect() as conn:
            row = (await conn.execute(select(t.media_type, t.data).where(t.id == input_id))).first()
        if row is None:  # retention deleted it after the job was read
            raise errors.Gone("the job's input image was deleted by retention")
        return str(row.media_type), bytes(row.data)

    async def input_sha256(self, input_id: int) -> str | None:
        """The SHA-256 of a stored image (images are stored once per digest); None if deleted."""
        from app import tables

        t = tables.Input
        async with self._auto.connect() as conn:
            return await conn.scalar(select(t.sha256).where(t.id == input_id))

    async def events(self, job_id: uuid.UUID, *, owner: str | None = None) -> list[Event]:
        """The job's history, oldest first."""
        async with self._auto.connect() as conn:
            rows = (await conn.execute(sql.EVENTS, {"id": job_id, "owner": owner})).all()
        if not rows:
            await self.get(job_id, owner=owner)  # 404 if not visible; every job has events
        return [Event(r.id, r.at, r.kind, r.attempt, r.worker_id, r.detail) for r in rows]

    async def job_and_events(self, job_id: uuid.UUID, *, owner: str | None = None) -> tuple[Job, list[Event]]:
        """The job and its history as they were at one moment (one snapshot): read apart, a job
        that ended in between was read running with its final event already in its history."""
        async with self._engine.connect() as conn:
            await conn.execution_options(isolation_level="REPEATABLE READ")
            async with conn.begin():
                job = await self._get(conn, job_id, owner)
                rows = (await conn.execute(sql.EVENTS, {"id": job_id, "owner": owner})).all()
        return job, [Event(r.id, r.at, r.kind, r.attempt, r.worker_id, r.detail) for r in rows]

    # -- the worker's side ----------------------------------------------------------------

    async def claim(
        self,
        *,
        worker_id: str,
        host: str,
        models: Sequence[str] | Mapping[str, float],
        budgets: Mapping[int, int],
        lease_s: float,
        limit: int = 1,
        slots: Mapping[int, int] | None = None,
        ahead: Mapping[int, int] | None = None,
        min_priority: int = -(2**31),
        warm: Set[tuple[str, int | None]] = frozenset(),
    ) -> list[Claimed]:
        """Lease up to `limit` of the best queued jobs that fit `budgets` (GPU index -> free MB), in
        one statement, best first.

        Each job is placed on the GPU that fits it most tightly after those placed before it;
        `slots` (GPU index -> jobs it may still start; default no cap) bounds the jobs per GPU;
        up to `ahead[gpu]` of those are beyond its cap (claimed ahead: the job waits for a running
        one to end), and a GPU with a slot free now takes a job first.
        `models` may map each model to the largest input (megapixels) to take (backfill), and
        `min_priority` keeps out jobs whose effective priority is lower (reservations). Among
        jobs of equal effective priority, those whose model has a warm runner (`warm` pairs) on a
        GPU of `budgets` with room for the job come first, and go to that GPU. Successes waiting
        to be written (`hold_successes`) go out in the same statement.
        """
        gpu_ids = [g for g in budgets if (slots is None or slots.get(g, 0) > 0) and budgets[g] > 0]
        if not gpu_ids or not models or limit < 1:
            self._successes.release()  # no statement goes out to carry them
            return []
        limits = dict(models) if isinstance(models, Mapping) else dict.fromkeys(models, math.inf)
        budget = max(budgets[g] for g in gpu_ids)
        offered, waits = _offers(gpu_ids, limit, slots, ahead)
        values = {
            "models": list(limits),
            "max_megapixels": list(limits.values()),
            "warm_mb": [  # per model: the most free MB of a GPU where it has a warm runner
                max((budgets[g] for m, g in warm if m == model and g in gpu_ids), default=0)
                for model in limits
            ],
            "warm_pairs": sorted(f"{model}:{gpu}" for model, gpu in warm),
            "min_priority": min_priority,
            "max_class": vram_class(budget),
            "budget": budget,
            "limit": limit,
            "gpu_ids": gpu_ids,
            "gpu_budgets": [budgets[g] for g in gpu_ids],
            "gpu_slots": offered,
            "gpu_waits": waits,
            "worker_id": worker_id,
            "host": host,
            "lease_s": lease_s,
        }

        async def alone() -> list[Claimed]:
            return _claimed(await db.fetch_rows(self._queue_engine, sql.CLAIM, values))  # wide rows

        async def carrying(items: Sequence[tuple[Job, str, str]]) -> tuple[list[bool], list[Claimed]]:
            rows = await db.fetch_rows(
                self._queue_engine, sql.SUCCEED_AND_CLAIM, {**values, **_success_values(items)}
            )
            done = set(rows[0]["succeeded"])
            return [job.id in done for job, _, _ in items], _claimed(r for r in rows if r["id"] is not None)

        return await self._successes.carried_by(carrying, alone)

    def hold_successes(self, seconds: float) -> None:
        """Successes reported in the next `seconds` wait for this manager's next claim, which
        writes them in its own statement (a worker whose job just ended is about to fill its
        slot); if no claim comes by then, they are written on their own."""
        self._successes.hold(seconds)

    async def _fenced(self, statement: Any, job: Job, values: Mapping[str, Any]) -> Any:
        async with self._auto.connect() as conn:
            row = (await conn.execute(statement, {"id": job.id, "attempt": job.attempt, **values})).first()
        if row is None:
            raise errors.LeaseLost(f"job {job.id} attempt {job.attempt} no longer owns the job")
        return row

    async def set_pid(self, job: Job, pid: int) -> bool:
        """Record the model's pid (for restart recovery); returns whether a cancel is pending."""
        return bool((await self._fenced(sql.SET_PID, job, {"pid": pid})).cancel_requested)

    async def progress(self, job: Job, fraction: float, message: str) -> bool:
        """Record progress (`message` kept to PROGRESS_MESSAGE_CHARS by the attempt, which writes
        it to the milestone events too); returns whether a cancel is pending."""
        row = await self._fenced(sql.PROGRESS, job, {"progress": fraction, "message": message})
        return bool(row.cancel_requested)

    async def add_event(self, job: Job, kind: str, detail: Mapping[str, Any]) -> None:
        """Write an event for this attempt (fenced)."""
        await self._fenced(sql.RUN_EVENT, job, {"kind": kind, "detail": json.dumps(dict(detail))})

    async def succeed(self, job: Job, results: Sequence[ResultFile], detail: Mapping[str, Any]) -> None:
        """Mark this attempt's job succeeded with its result files (fenced).

        Successes reported while another is being written go out together in one statement.
        """
        item = (job, json.dumps([r.to_json() for r in results]), json.dumps(dict(detail)))
        if not await self._successes.submit(item):
            raise errors.LeaseLost(f"job {job.id} attempt {job.attempt} no longer owns the job")

    async def _succeed_many(self, items: Sequence[tuple[Job, str, str]]) -> list[bool]:
        """One SUCCEED statement for several attempts; whether each still owned its job."""
        rows = await db.fetch_rows(self._queue_engine, sql.SUCCEED, _success_values(items))
        done = {row["id"] for row in rows}
        return [job.id in done for job, _, _ in items]

    async def fail(
        self,
        job: Job,
        *,
        error: str,
        retryable: bool,
        delay_s: float,
        detail: Mapping[str, Any],
        abnormal: bool = False,
    ) -> JobState:
        """End this attempt unsuccessfully; returns the job's new state (fenced).

        `abnormal`: the process died by a signal nobody sent it (segfault, host OOM killer);
        enough of those park the job in `quarantined`.
        """
        values = {
            "error": error,
            "retryable": retryable,
            "delay_s": delay_s,
            "detail": json.dumps(dict(detail)),
            "abnormal": abnormal,
            "quarantine_after": self.quarantine_after,
        }
        return JobState((await self._fenced(sql.FAIL, job, values)).state)

    async def release(self, job: Job, *, reason: str) -> None:
        """Hand a running job back to the queue without spending an attempt (fenced)."""
        await self._fenced(sql.RELEASE, job, {"reason": reason})

    async def release_storage(self, job: Job, *, reason: str, error: str, most: int) -> bool:
        """Hand a running job back to the queue without spending an attempt, for files this host
        could not write, unless it went back for that (`reason`) `most` times already; whether it
        did (fenced: LeaseLost, as for release, also while a cancel is pending)."""
        first_line = (error.splitlines() or [""])[0]
        values = {"reason": reason, "error": error, "first_line": first_line, "most": most}
        return bool((await self._fenced(sql.RELEASE_STORAGE, job, values)).released)

    async def release_unknown(self, *, worker_id: str, in_hand: Sequence[uuid.UUID]) -> list[TakenBack]:
        """Hand back, unspent, the jobs running under `worker_id` that it does not hold and that
        never started a model: a claim of it whose answer was lost took them (sql.RELEASE_UNKNOWN).
        Each is queued again, or canceled if a cancel was asked for."""
        values = {"worker_id": worker_id, "in_hand": list(in_hand), "reason": LOST_CLAIM}
        async with self._auto.connect() as conn:
            rows = (await conn.execute(sql.RELEASE_UNKNOWN, values)).all()
        return [TakenBack(r.id, r.attempt, r.worker_id, JobState(r.state), None, None) for r in rows]

    async def release_stopped(self, *, worker_id: str, reason: str) -> list[TakenBack]:
        """Hand back, unspent, every job running under `worker_id`, a worker stopped at once whose
        models are dead (sql.RELEASE_STOPPED); each job, its attempt and its new state (queued, or
        canceled)."""
        async with self._auto.connect() as conn:
            rows = (await conn.execute(sql.RELEASE_STOPPED, {"worker_id": worker_id, "reason": reason})).all()
        return [TakenBack(r.id, r.attempt, r.worker_id, JobState(r.state), None, None) for r in rows]

    async def promote_due(self) -> int:
        """Queue the scheduled retries whose time has come; returns how many."""
        async with self._auto.connect() as conn:
            return int((await conn.execute(sql.PROMOTE_DUE)).one().promoted)

    async def age_queued(self, *, step_s: float, max_boost: int, chunk: int = 1000) -> int:
        """Raise the effective priority of jobs that have waited, `chunk` jobs per statement (each
        its own transaction, so no lock is held for long); returns how many were raised."""
        if not step_s < AGE_STEP_NEVER_S:  # inf or NaN too: no job ever gains a point
            return 0
        values = {"step_s": step_s, "max_boost": max_boost, "chunk": chunk}
        raised = 0
        while True:
            row = await db.fetch_row(self._engine, sql.AGE_QUEUED, values)
            raised += int(row["raised"])
            if row["seen"] < chunk:
                return raised

    async def heartbeat(
        self,
        *,
        worker_id: str,
        job_ids: Sequence[uuid.UUID],
        lease_s: float,
        gpus: Sequence[Mapping[str, Any]],
        state: str = "running",
    ) -> dict[uuid.UUID, tuple[int, bool]]:
        """Renew the leases of `job_ids`; returns those still owned: id -> (attempt, cancel requested)."""
        values = {
            "worker_id": worker_id,
            "ids": list(job_ids),
            "lease_s": lease_s,
            "gpus": json.dumps(list(gpus)),
            "state": state,
        }
        async with self._auto.connect() as conn:
            rows = (await conn.execute(sql.HEARTBEAT, values)).all()
        return {r.id: (r.attempt, r.cancel_requested) for r in rows}

    async def _take_back(self, statement: Any, values: Mapping[str, Any]) -> list[TakenBack]:
        async with self._auto.connect() as conn:
            values = {"limit": 1000, "quarantine_after": self.quarantine_after, **values}
            rows = (await conn.execute(statement, values)).all()
        return [TakenBack(r.id, r.attempt, r.worker_id, JobState(r.state), r.pid, r.host) for r in rows]

    async def leftovers_on_host(
        self, *, host: str, worker_id: str | None = None, lease_s: float = 0.0
    ) -> list[TakenBack]:
        """Running jobs with a process on `host` whose lease expired (or, given, of `worker_id`);
        `lease_s` as in `recover_expired`."""
        values = {"host": host, "worker_id": worker_id, "lease_s": lease_s}
        async with self._auto.connect() as conn:
            rows = (await conn.execute(sql.LEFTOVERS_ON_HOST, values)).all()
        return [TakenBack(r.id, r.attempt, r.worker_id, JobState(r.state), r.pid, r.host) for r in rows]

    async def recover_expired(
        self,
        *,
        by_worker: str,
        in_hand: Sequence[uuid.UUID] = (),
        host: str | None = None,
        cleared: Sequence[uuid.UUID] = (),
        lease_s: float = 0.0,
    ) -> list[TakenBack]:
        """Queue again (or fail) running jobs whose lease ran out, except those `by_worker` runs.

        With `host`, a job on that host is taken only if it is in `cleared`: its leftover
        processes were looked for (and killed) after its lease ran out (`leftovers_on_host`).
        Within `lease_s` (a worker's lease) of PostgreSQL's start no lease counts as run out: no
        worker could renew one while the database was away (sql._LEASE_RAN_OUT)."""
        values = {
            "lease_s": lease_s,
            "by_worker": by_worker,
            "reason": "lease expired",
            "in_hand": list(in_hand),
            "host": host,
            "cleared": list(cleared),
        }
        return await self._take_back(sql.RECOVER_EXPIRED, values)

    async def requeue_own(self, *, worker_id: str) -> list[TakenBack]:
        """On start: take back this worker identity's running jobs from its previous life."""
        values = {"worker_id": worker_id, "by_worker": worker_id, "reason": "worker restarted"}
        return await self._take_back(sql.REQUEUE_OWN, values)

    async def mark_dead_workers(self, *, dead_after_s: float) -> list[str]:
        """Mark workers whose heartbeat stopped as dead."""
        async with self._auto.connect() as conn:
            rows = (await conn.execute(sql.MARK_DEAD_WORKERS, {"dead_after_s": dead_after_s})).all()
        return [r.id for r in rows]

    async def register_worker(
        self, *, worker_id: str, host: str, pid: int, models: Sequence[str], gpus: Sequence[Mapping[str, Any]]
    ) -> None:
        """Insert or refresh this worker's row."""
        values = {
            "id": worker_id,
            "host": host,
            "pid": pid,
            "models": json.dumps(list(models)),
            "gpus": json.dumps(list(gpus)),
        }
        async with self._auto.connect() as conn:
            await conn.execute(sql.REGISTER_WORKER, values)

    async def set_worker_state(self, worker_id: str, state: str) -> None:
        """Record that a worker is stopping or stopped."""
        async with self._auto.connect() as conn:
            await conn.execute(sql.SET_WORKER_STATE, {"id": worker_id, "state": state})

    # -- user and admin actions -----------------------------------------------------------

    async def cancel(self, job_id: uuid.UUID, *, owner: str | None, by: str) -> tuple[JobState, int]:
        """Cancel a queued job now, or ask the worker to kill a running one; the job's state after
        it, and its attempt."""
        async with self._auto.connect() as conn:
            row = (await conn.execute(sql.CANCEL, {"id": job_id, "owner": owner, "by": by})).first()
        if row is None:
            raise errors.JobNotFound(f"no job {job_id}")
        if row.state is None:  # worded from the state that refused it (sql.CANCEL says why)
            raise errors.Conflict(
                f"job {job_id} is {row.seen_state}; only queued, scheduled or running jobs can be canceled"
            )
        return JobState(row.state), row.attempt

    async def cancel_matching(
        self,
        *,
        by: str,
        states: Set[JobState],
        model: str | None = None,
        owner: str | None = None,
        batch: int = 1000,
        patience_s: float = 5.0,
    ) -> records.Canceled:
        """Cancel, as `cancel` does, every job in `states` (queued, scheduled, running) of `model` and
        `owner` (None: any) submitted by now, in batches of `batch` (sql.CANCEL_MATCHING)."""
        values = {"by": by, "model": model, "owner": owner, "before": await self.now(), "limit": batch}
        rows: list[Any] = []
        # In the order a job moves through them: one promoted or claimed meanwhile is met again
        # in its next state, when that is asked for too.
        for state in (JobState.scheduled, JobState.queued, JobState.running):
            if state in states:
                rows += await self._cancel_batches({**values, "state": state.value}, patience_s)
        stopping = sum(r.state == JobState.running for r in rows)
        waited = [(r.id, r.attempt) for r in rows if r.state == JobState.canceled and r.attempt > 0]
        return records.Canceled(canceled=len(rows) - stopping, stopping=stopping, ended_waiting=waited)

    async def _cancel_batches(self, values: Mapping[str, Any], patience_s: float) -> list[Any]:
        """Batches of sql.CANCEL_MATCHING until no job is left, or none could be taken (others held
        them: sql.CANCEL_MATCHING skips them) for `patience_s`."""
        rows: list[Any] = []
        deadline = time.monotonic() + patience_s
        while True:
            async with self._auto.connect() as conn:
                taken = (await conn.execute(sql.CANCEL_MATCHING, values)).all()
                full = len(taken) == values["limit"]
                left = full or (await conn.execute(sql.CANCELABLE_LEFT, values)).scalar_one()
            rows += taken
            if not left:
                return rows
            if taken:
                deadline = time.monotonic() + patience_s
            elif time.monotonic() > deadline:
                log.warning(
                    "bulk cancel gave up on jobs held by other statements",
                    extra={"action": "cancel_matching_held", "state": values["state"]},
                )
                return rows
            if not full:
                await asyncio.sleep(0.02)  # the holders are short statements

    async def retry(self, job_id: uuid.UUID, *, by: str, attempts: int) -> None:
        """Queue a failed, canceled or quarantined job again with a fresh budget of attempts."""
        async with self._auto.connect() as conn:
            row = (await conn.execute(sql.RETRY_ONE, {"id": job_id, "by": by, "attempts": attempts})).first()
        if row is None:
            raise errors.JobNotFound(f"no job {job_id}")
        if row.expired:
            raise errors.Gone(f"job {job_id} expired: retention deleted its input and files")
        if row.id is None:  # worded from the state that refused it (sql.RETRY_ONE)
            raise errors.Conflict(
                f"job {job_id} is {row.seen_state}; only failed, canceled or quarantined jobs can be retried"
            )

    async def retry_matching(
        self,
        *,
        by: str,
        attempts: int,
        queue_limit: int,
        model: str | None = None,
        error_contains: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        batch: int = 1000,
    ) -> records.Retried:
        """Queue again, as `retry` does, the failed and quarantined jobs matching the filter that
        finished by now: in batches of at most `batch` (sql.RETRY_BATCH), each at most the room left
        under `queue_limit` jobs waiting, until none is left or the queue is full. A batch counts and
        fills the room under a lock every bulk retry takes (sql.XACT_LOCK)."""
        values = {
            "by": by,
            "attempts": attempts,
            "model": model,
            "error_contains": error_contains,
            "since": since,
            "until": until,
            "before": await self.now(),
        }
        retried, room = 0, 0
        while True:
            async with self._engine.begin() as conn:  # one batch: its count and its retry, locked
                await conn.execute(sql.XACT_LOCK, {"key": sql.BULK_RETRY_LOCK_KEY})
                waiting = (await conn.execute(sql.WAITING_UP_TO, {"queue_limit": queue_limit})).scalar_one()
                room = queue_limit - waiting
                if room <= 0:
                    break
                limit = min(batch, room)
                taken = len((await conn.execute(sql.RETRY_BATCH, {**values, "limit": limit})).all())
            retried += taken
            if taken < limit:  # none left that another statement does not hold
                break
        async with self._auto.connect() as conn:
            left = (await conn.execute(sql.RETRYABLE_LEFT, values)).scalar_one()
        return records.Retried(retried=retried, left=left, queue_full=left > 0 and room <= 0)

    async def count_unserved(
        self,
        *,
        known: Sequence[str],
        error_contains: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
    ) -> int:
        """How many failed and quarantined jobs matching the filter are of none of the `known`
        models (sql.RETRYABLE_UNSERVED), which a bulk retry over those models leaves."""
        values = {
            "known": list(known),
            "model": None,
            "error_contains": error_contains,
            "since": since,
            "until": until,
            "before": await self.now(),
        }
        async with self._auto.connect() as conn:
            return int((await conn.execute(sql.RETRYABLE_UNSERVED, values)).scalar_one())

    # -- observability --------------------------------------------------------------------

    async def events_for_metrics(self, *, after: int, limit: int) -> list[Any]:
        """Events after id `after`, oldest first, with what the metrics need (sql.EVENTS_FOR_METRICS)."""
        values = {"after": after, "limit": limit, "kinds": list(sql.LIFECYCLE_KINDS)}
        async with self._auto.connect() as conn:
            return list((await conn.execute(sql.EVENTS_FOR_METRICS, values)).all())

    async def event_groups_for_metrics(
        self, *, older_than_s: float, final: Iterable[str], bucket_starts: Sequence[float], timeout_s: float
    ) -> tuple[int, list[Any]]:
        """The cut-off id (sql.EVENTS_CUTOFF_FOR_METRICS; 0: no event that old) and the lifecycle
        events up to it counted in groups (sql.EVENT_GROUPS_FOR_METRICS), each within `timeout_s`."""
        async with self._engine.begin() as conn:
            await conn.execute(sql.STATEMENT_TIMEOUT_LOCAL, {"ms": str(round(timeout_s * 1000))})
            cutoff = await conn.scalar(sql.EVENTS_CUTOFF_FOR_METRICS, {"older_than_s": older_than_s})
            if cutoff is None:
                return 0, []
            await conn.execute(sql.SCAN_WHOLE_TABLES)
            values = {
                "upto": cutoff,
                "kinds": list(sql.LIFECYCLE_KINDS),
                "final": sorted(final),
                "bucket_starts": list(bucket_starts),
            }
            return cutoff, list((await conn.execute(sql.EVENT_GROUPS_FOR_METRICS, values)).all())

    async def queue_depth(self) -> list[tuple[str, str, int, int]]:
        """Unfinished jobs counted by (state, model, priority)."""
        async with self._auto.connect() as conn:
            rows = (await conn.execute(sql.QUEUE_DEPTH)).all()
        return [(r.state, r.model, r.priority, r.jobs) for r in rows]

    async def workers(self, *, recent_s: float = 86_400) -> list[records.WorkerInfo]:
        """Workers alive or seen within `recent_s`, with their last GPU snapshot and running jobs."""
        async with self._auto.connect() as conn:
            rows = (await conn.execute(sql.WORKERS, {"recent_s": recent_s})).all()
        return [records.WorkerInfo.from_row(r) for r in rows]

    async def finished_stats(self, *, window_s: float, recent_s: float) -> records.FinishedStats:
        """Counts and wait / run percentiles of the jobs that finished within `window_s`."""
        async with self._auto.connect() as conn:
            row = (await conn.execute(sql.FINISHED_STATS, {"window_s": window_s, "recent_s": recent_s})).one()
        return records.FinishedStats.from_row(row)

    def advisory_lock(self, key: int) -> records.AdvisoryLock:
        """`async with manager.advisory_lock(key) as held:` one holder at a time across processes."""
        return records.AdvisoryLock(self._engine, key)

    async def now(self) -> datetime:
        """The database's clock, by which every time of a job is written."""
        async with self._auto.connect() as conn:
            return (await conn.execute(sql.NOW)).one().now  # type: ignore[no-any-return]

    async def expirable(self, *, cutoff: datetime, limit: int) -> list[uuid.UUID]:
        """Finished jobs whose files retention would delete (finished before `cutoff`), oldest first."""
        async with self._auto.connect() as conn:
            rows = (await conn.execute(sql.EXPIRABLE, {"cutoff": cutoff, "limit": limit})).all()
        return [r.id for r in rows]

    async def expire(self, *, cutoff: datetime, limit: int) -> records.Expired:
        """Mark up to `limit` jobs that finished before `cutoff` expired; delete inputs left unused."""
        async with self._engine.begin() as conn:
            rows = (await conn.execute(sql.EXPIRE, {"cutoff": cutoff, "limit": limit})).all()
            ids = [r.id for r in rows]
            if ids:  # first, so uploads of these images wait, or are waited for (sql.ENQUEUE)
                await conn.execute(sql.LOCK_INPUTS, {"ids": ids})
            detached = (await conn.execute(sql.DETACH_UNUSED_INPUTS, {"ids": ids})).all() if ids else []
            inputs = [r.input_id for r in detached]
            deleted = (await conn.execute(sql.DELETE_INPUTS, {"ids": inputs})).all() if inputs else []
        return records.Expired(ids, len(deleted), sum(int(r.bytes) for r in deleted))

    async def expired_among(self, job_ids: Sequence[uuid.UUID]) -> set[uuid.UUID]:
        """Which of `job_ids` are expired."""
        async with self._auto.connect() as conn:
            rows = (await conn.execute(sql.EXPIRED_AMONG, {"ids": list(job_ids)})).all()
        return {r.id for r in rows}

    # -- scheduling -----------------------------------------------------------------------

    async def requeue_oom(self, job: Job, *, vram_mb: int, error: str, detail: Mapping[str, Any]) -> None:
        """Queue an out-of-memory run again with a larger estimate, spending no attempt (fenced)."""
        values = {"vram_mb": vram_mb, "error": error, "detail": json.dumps(dict(detail))}
        await self._fenced(sql.REQUEUE_OOM, job, values)

    async def record_peak(self, job: Job, peak_mb: int) -> None:
        """Record the most GPU memory this attempt was seen using (fenced)."""
        await self._fenced(sql.RECORD_PEAK, job, {"peak_mb": peak_mb})

    async def waiting_head(
        self, *, models: Sequence[str], budget: int, capacity: int
    ) -> tuple[uuid.UUID, int, int, float] | None:
        """The best queued job over `budget` but within `capacity`: (id, MB, priority, waited s)."""
        if capacity <= budget or not models:
            return None
        classes = [c for c in classes_up_to(capacity) if c >= vram_class(budget + 1)]
        values = {"models": list(models), "classes": classes, "budget": budget, "capacity": capacity}
        async with self._auto.connect() as conn:
            row = (await conn.execute(sql.WAITING_HEAD, values)).first()
        return None if row is None else (row.id, row.vram_mb, row.effective, float(row.waited_s))

    async def run_times(self) -> dict[str, tuple[int, float, float | None, float | None]]:
        """Per model: (samples, mean s, intercept s, s per megapixel) of recent successes."""
        async with self._auto.connect() as conn:
            rows = (await conn.execute(sql.RUN_TIMES)).all()
        return {r.model: (r.samples, float(r.mean_s), r.intercept_s, r.slope_s) for r in rows}

    async def largest_gpus(self, *, buffer_mb: int, recent_s: float = 86_400) -> dict[str, int]:
        """Per model: the most one job may be given on a GPU of the workers that serve it, alive or
        seen within `recent_s` (a model no such worker serves is left out): what each worker's
        heartbeat says its GPU offers (its size less that worker's buffer), or for a worker of an
        earlier version, its size less `buffer_mb`."""
        values = {"recent_s": recent_s, "buffer_mb": buffer_mb}
        async with self._auto.connect() as conn:
            rows = (await conn.execute(sql.LARGEST_GPUS, values)).all()
        return {r.model: max(0, int(r.offered_mb)) for r in rows if r.offered_mb is not None}

    async def vram_ratios(self) -> dict[str, tuple[list[float], int]]:
        """Per model: observed peak ÷ declared estimate of recent successes, and the largest peak."""
        async with self._auto.connect() as conn:
            rows = (await conn.execute(sql.VRAM_RATIOS)).all()
        return {r.model: (list(r.ratios), int(r.max_peak_mb)) for r in rows}
