"""JobManager: the only code that runs queue SQL. Each method is one short transaction.

It holds the job's lifecycle (intake, reads of one job, the claim and the lease, cancel and retry)
and composes the rest over the same engine: `fleet` (workers and the jobs taken back from them),
`listing`, `inputs`, `reports`, `bulk` and `expiry`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import time
import uuid
from collections.abc import Mapping, Sequence, Set
from datetime import datetime
from typing import Any

from sqlalchemy import exc as sa_exc
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from app import db, errors
from app.queue import (
    batcher,
    bulk,
    claims,
    expiry,
    fleet,
    inputs,
    listing,
    records,
    reports,
    sql,
    teller,
    waiting,
)
from app.queue.jobs import Claimed, Job, JobState, ResultFile

# `app.tables` (the ORM classes) is imported by the reads that use it (get here, Listing.page,
# Inputs.by_id and Inputs.sha256), not here: a worker seldom calls them, and building the classes
# cost each worker's start about 0.12 s of CPU on a 2-core VM (`import app.db`: 634 ms, with
# `app.tables` 752 ms).

# An aging step longer than this (100 years) is never reached by a queued job. Longer ones are
# out of PostgreSQL's interval and timestamp ranges, and AGE_QUEUED would fail on them.
AGE_STEP_NEVER_S = 100 * 365.25 * 86_400


# How far the database's clock may seem to run ahead of a worker's steady clock between two of its
# beats (a statement's own time, its trip) before it counts as a step of the database's clock.
CLOCK_TOLERANCE_S = 1.0

# An upload into a full queue, or by an owner whose share is full, may try again in this long.
FULL_RETRY_AFTER_S = 30


def queue_full(queue_limit: int) -> errors.QueueFull:
    """The refusal of an upload into a queue with `queue_limit` jobs waiting."""
    return errors.QueueFull(
        f"the queue is full ({queue_limit} jobs waiting); try again later", retry_after_s=FULL_RETRY_AFTER_S
    )


def owner_full(owner_limit: int) -> errors.QueueFull:
    """The refusal of an upload by an owner with `owner_limit` jobs waiting."""
    return errors.QueueFull(
        f"you have {owner_limit} jobs waiting, the most one key may queue; try again once some have started",
        retry_after_s=FULL_RETRY_AFTER_S,
    )


def not_retryable(job_id: uuid.UUID, state: str) -> errors.Conflict:
    """The 409 of a retry of a job in a state no retry takes."""
    return errors.Conflict(
        f"job {job_id} is {state}; only failed, canceled or quarantined jobs can be retried"
    )


class JobManager:
    """Queue operations over one engine. Domain errors come out as `errors.AppError`."""

    def __init__(
        self, engine: AsyncEngine, *, queue_engine: AsyncEngine | None = None, quarantine_after: int = 3
    ) -> None:
        self._engine = engine
        self._queue_engine = engine if queue_engine is None else queue_engine  # claims, successes
        # Every unit here and in the parts below that is one statement, atomic on its own, runs on
        # this: autocommit saves the BEGIN and COMMIT round trips a transaction would add around it.
        self._auto = engine.execution_options(isolation_level="AUTOCOMMIT")
        self.quarantine_after = quarantine_after  # abnormal deaths (signals, lost workers) allowed
        self.waiting = waiting.WaitingCount()  # for the queue limit of enqueue()
        self._successes: batcher.Batcher[tuple[Job, str, str], bool] = batcher.Batcher(self._succeed_many)
        self.teller = teller.Teller(engine)
        self.fleet = fleet.Fleet(self._auto, quarantine_after=quarantine_after)
        self.listing = listing.Listing(self._auto)
        self.inputs = inputs.Inputs(self._auto)
        self.reports = reports.Reports(engine, self._auto)
        self.bulk = bulk.BulkActions(engine, self._auto, now=self.now)
        self.expiry = expiry.Expiry(engine, self._auto)

    # -- intake ---------------------------------------------------------------------------

    async def enqueue(
        self, job: records.NewJob, image: records.NewInput, *, queue_limit: int, owner_limit: int = 0
    ) -> tuple[Job, bool]:
        """Store the image (once per content) and queue the job, in one statement; (job, created).

        A repeated idempotency key gives back the owner's earlier job. QueueFull, with nothing
        written, when `queue_limit` jobs wait, or `owner_limit` of the owner's (0: no limit).
        """
        values = job.enqueue_values(image, queue_limit=queue_limit, owner_limit=owner_limit)
        values["count_waiting"] = counting = self.waiting.must_count(queue_limit)
        row = await db.fetch_row(self._engine, sql.ENQUEUE, values)  # the hot path of every upload
        if counting:
            self.waiting.counted(row["jobs_waiting"])
        if row["outcome"] == "queued":
            self.waiting.added()
        if row["outcome"] == "revoked":
            raise errors.KeyRevoked()  # the route answers it as any request with that key: 401
        if row["outcome"] == "queue_full":
            raise queue_full(queue_limit)
        if row["outcome"] == "owner_full":
            raise owner_full(owner_limit)
        if row["id"] is None:  # a concurrent request with the same idempotency key won
            if row["stored_input"] is not None:  # the image it stored is nobody's
                async with self._auto.connect() as conn:
                    with contextlib.suppress(sa_exc.IntegrityError):  # a job took it meanwhile
                        await conn.execute(sql.DROP_UNUSED_INPUT, {"id": row["stored_input"]})
            existing = await self.find_idempotent(job.owner, job.idempotency_key or "")
            assert existing is not None
            return existing, False
        stored = Job.from_row(row)
        if row["outcome"] == "queued":
            self._tell_queued(stored, row["submitted_event"])
        return stored, row["outcome"] == "queued"

    async def room(
        self, *, queue_limit: int | None, owner: str | None = None, owner_limit: int = 0
    ) -> tuple[int | None, int | None]:
        """The jobs waiting, counted up to `queue_limit` (None: not counted), and `owner`'s, up to
        `owner_limit` (None unless both are given), as enqueue() counts them: one statement."""
        values = {
            "count_all": queue_limit is not None, "queue_limit": queue_limit or 0,
            "count_owner": owner is not None and owner_limit > 0, "owner": owner, "owner_limit": owner_limit,
        }  # fmt: skip
        row = await db.fetch_row(self._engine, sql.ROOM, values)
        return row["waiting"], row["owner_waiting"]

    def _tell_queued(self, job: Job, event: int) -> None:
        """Have the queued job's NOTIFYs sent (after ENQUEUE's commit: sql.TELL says why)."""
        note: dict[str, object] = {"job": str(job.id), "state": job.state.value, "attempt": job.attempt}
        note |= {"progress": job.progress, "event": event, "kind": "submitted"}
        self.teller.tell(sql.JOB_CHANNEL, json.dumps(note))
        self.teller.tell(sql.QUEUED_CHANNEL, job.model)

    async def find_idempotent(self, owner: str, key: str) -> Job | None:
        """The owner's job queued with this idempotency key, if any. Straight on asyncpg, like the
        enqueue (db.fetch_row): its `SELECT *`, cached by SQLAlchemy's driver layer, failed once
        per connection after a migration added a column to `jobs`; asyncpg prepares it again."""
        row = await db.fetch_row(self._engine, sql.FIND_IDEMPOTENT, {"owner": owner, "key": key})
        return None if row is None else Job.from_row(row)

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

    async def events(self, job_id: uuid.UUID, *, owner: str | None = None) -> list[records.Event]:
        """The job's history, oldest first."""
        async with self._auto.connect() as conn:
            rows = (await conn.execute(sql.EVENTS, {"id": job_id, "owner": owner})).all()
        if not rows:
            await self.get(job_id, owner=owner)  # 404 if not visible; every job has events
        return [records.Event(r.id, r.at, r.kind, r.attempt, r.worker_id, r.detail) for r in rows]

    async def job_and_events(
        self, job_id: uuid.UUID, *, owner: str | None = None
    ) -> tuple[Job, list[records.Event]]:
        """The job and its history as they were at one moment (one snapshot): read apart, a job
        that ended in between was read running with its final event already in its history."""
        async with self._engine.connect() as conn:
            await conn.execution_options(isolation_level="REPEATABLE READ")
            async with conn.begin():
                job = await self._get(conn, job_id, owner)
                rows = (await conn.execute(sql.EVENTS, {"id": job_id, "owner": owner})).all()
        return job, [records.Event(r.id, r.at, r.kind, r.attempt, r.worker_id, r.detail) for r in rows]

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
        values = claims.parameters(
            models, budgets, gpu_ids, limit, slots=slots, ahead=ahead, warm=warm, min_priority=min_priority
        )
        values |= {"worker_id": worker_id, "host": host, "lease_s": lease_s}
        return await self._successes.carried_by(
            functools.partial(self._claim_carrying, values), functools.partial(self._claim_alone, values)
        )

    async def _claim_alone(self, values: Mapping[str, Any]) -> list[Claimed]:
        """The claim, in CLAIM, when no success waits to ride it."""
        return claims.claimed(await db.fetch_rows(self._queue_engine, sql.CLAIM, values))  # wide rows

    async def _claim_carrying(
        self, values: Mapping[str, Any], items: Sequence[tuple[Job, str, str]]
    ) -> tuple[list[bool], list[Claimed]]:
        """The claim carrying the successes waiting for it (SUCCEED_AND_CLAIM); whether each still owned
        its job, and the jobs claimed."""
        rows = await db.fetch_rows(
            self._queue_engine, sql.SUCCEED_AND_CLAIM, {**values, **claims.success_values(items)}
        )
        done = set(rows[0]["succeeded"])
        return [job.id in done for job, _, _ in items], claims.claimed(r for r in rows if r["id"] is not None)

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
        rows = await db.fetch_rows(self._queue_engine, sql.SUCCEED, claims.success_values(items))
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
        paused: str | None = None,
        last_beat: float | None = None,
    ) -> records.Beat:
        """Renew the leases of `job_ids` and store the worker's state (`paused`: why it claims
        nothing now, None while it claims); returns those still owned: id -> (attempt, cancel
        requested), by how much the database's clock stepped forward since the worker's last beat
        (at `last_beat` by time.monotonic(); None: not known, nothing stepped), and when this
        statement was sent. Stamped with a connection in hand: a wait for one read as a step."""
        values = {
            "worker_id": worker_id,
            "ids": list(job_ids),
            "lease_s": lease_s,
            "gpus": json.dumps(list(gpus)),
            "state": state,
            "paused": paused,
            "tolerance_s": CLOCK_TOLERANCE_S,
        }
        async with self._auto.connect() as conn:
            sent = time.monotonic()
            values["since_s"] = float("inf") if last_beat is None else sent - last_beat
            rows = (await conn.execute(sql.HEARTBEAT, values)).all()
        owned = {r.id: (r.attempt, r.cancel_requested) for r in rows if r.id is not None}
        return records.Beat(owned, float(rows[0].stepped_s) if rows else 0.0, sent)

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
                f"job {job_id} is {row.seen_state}; only queued, scheduled, running or quarantined jobs"
                " can be canceled"
            )
        return JobState(row.state), row.attempt

    async def retry(self, job_id: uuid.UUID, *, by: str, attempts: int) -> None:
        """Queue a failed, canceled or quarantined job again with a fresh budget of attempts."""
        async with self._auto.connect() as conn:
            row = (await conn.execute(sql.RETRY_ONE, {"id": job_id, "by": by, "attempts": attempts})).first()
        if row is None:
            raise errors.JobNotFound(f"no job {job_id}")
        if row.expired:
            raise errors.Gone(f"job {job_id} expired: retention deleted its input and files")
        if row.id is None:  # worded from the state that refused it (sql.RETRY_ONE)
            raise not_retryable(job_id, row.seen_state)

    # -- the database's clock and locks ------------------------------------------------

    def advisory_lock(self, key: int) -> records.AdvisoryLock:
        """`async with manager.advisory_lock(key) as held:` one holder at a time across processes."""
        return records.AdvisoryLock(self._engine, key)

    async def now(self) -> datetime:
        """The database's clock, by which every time of a job is written."""
        async with self._auto.connect() as conn:
            return (await conn.execute(sql.NOW)).one().now  # type: ignore[no-any-return]

    # -- scheduling -----------------------------------------------------------------------

    async def requeue_oom(self, job: Job, *, vram_mb: int, error: str, detail: Mapping[str, Any]) -> None:
        """Queue an out-of-memory run again with a larger estimate, spending no attempt (fenced)."""
        values = {"vram_mb": vram_mb, "error": error, "detail": json.dumps(dict(detail))}
        await self._fenced(sql.REQUEUE_OOM, job, values)

    async def record_peak(self, job: Job, peak_mb: int) -> None:
        """Record the most GPU memory this attempt was seen using (fenced)."""
        await self._fenced(sql.RECORD_PEAK, job, {"peak_mb": peak_mb})
