"""Fleet: the workers' rows, and the running jobs taken back from workers lost, stopped or restarted."""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import exc as sa_exc
from sqlalchemy.ext.asyncio import AsyncEngine

from app.queue import records, sql
from app.queue.jobs import JobState

# The reason in the `released` event of a job whose claim's answer was lost (sql.RELEASE_UNKNOWN).
LOST_CLAIM = "the answer of its claim was lost"


class Fleet:
    """The workers' side of the queue that is not one attempt's: registration, death, and recovery."""

    def __init__(self, auto: AsyncEngine, *, quarantine_after: int) -> None:
        self._auto = auto
        self.quarantine_after = quarantine_after  # abnormal deaths (signals, lost workers) allowed

    async def release_unknown(
        self, *, worker_id: str, in_hand: Sequence[uuid.UUID]
    ) -> list[records.TakenBack]:
        """Hand back, unspent, the jobs running under `worker_id` that it does not hold and that
        never started a model: a claim of it whose answer was lost took them (sql.RELEASE_UNKNOWN).
        Each is queued again, or canceled if a cancel was asked for."""
        values = {"worker_id": worker_id, "in_hand": list(in_hand), "reason": LOST_CLAIM}
        async with self._auto.connect() as conn:
            rows = (await conn.execute(sql.RELEASE_UNKNOWN, values)).all()
        return [records.TakenBack(r.id, r.attempt, r.worker_id, JobState(r.state), None, None) for r in rows]

    async def release_stopped(self, *, worker_id: str, reason: str) -> list[records.TakenBack]:
        """Hand back, unspent, every job running under `worker_id`, a worker stopped at once whose
        models are dead (sql.RELEASE_STOPPED); each job, its attempt and its new state (queued, or
        canceled)."""
        async with self._auto.connect() as conn:
            rows = (await conn.execute(sql.RELEASE_STOPPED, {"worker_id": worker_id, "reason": reason})).all()
        return [records.TakenBack(r.id, r.attempt, r.worker_id, JobState(r.state), None, None) for r in rows]

    async def _take_back(self, statement: Any, values: Mapping[str, Any]) -> list[records.TakenBack]:
        async with self._auto.connect() as conn:
            values = {"limit": 1000, "quarantine_after": self.quarantine_after, **values}
            rows = (await conn.execute(statement, values)).all()
        return [
            records.TakenBack(r.id, r.attempt, r.worker_id, JobState(r.state), r.pid, r.host) for r in rows
        ]

    async def leftovers_on_host(
        self, *, host: str, worker_id: str | None = None, lease_s: float = 0.0
    ) -> list[records.TakenBack]:
        """Running jobs with a process on `host` whose lease expired (or, given, of `worker_id`);
        `lease_s` as in `recover_expired`."""
        values = {"host": host, "worker_id": worker_id, "lease_s": lease_s}
        async with self._auto.connect() as conn:
            rows = (await conn.execute(sql.LEFTOVERS_ON_HOST, values)).all()
        return [
            records.TakenBack(r.id, r.attempt, r.worker_id, JobState(r.state), r.pid, r.host) for r in rows
        ]

    async def recover_expired(
        self,
        *,
        by_worker: str,
        in_hand: Sequence[uuid.UUID] = (),
        host: str | None = None,
        cleared: Sequence[uuid.UUID] = (),
        lease_s: float = 0.0,
    ) -> list[records.TakenBack]:
        """Queue again (or fail) running jobs whose lease ran out, except those `by_worker` runs.

        With `host`, a job on that host is taken only if it is in `cleared`: its leftover
        processes were looked for (and killed) after its lease ran out (`leftovers_on_host`); one
        on another host where a worker is live is left to that worker for `lease_s` more.
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

    async def requeue_own(self, *, worker_id: str) -> list[records.TakenBack]:
        """On start: take back this worker identity's running jobs from its previous life."""
        values = {"worker_id": worker_id, "by_worker": worker_id, "reason": "worker restarted"}
        return await self._take_back(sql.REQUEUE_OWN, values)

    async def database_id(self) -> str:
        """The database's identity: its server's system identifier (a new one for each initdb, so
        a restored copy's differs) and its name; the name alone where the server does not tell
        its identifier to this user."""
        async with self._auto.connect() as conn:
            try:
                return str((await conn.execute(sql.DATABASE_ID)).scalar_one())
            except sa_exc.DBAPIError as exc:
                if getattr(exc.orig, "sqlstate", None) != "42501":  # insufficient_privilege
                    raise
        async with self._auto.connect() as conn:
            return str((await conn.execute(sql.DATABASE_NAME)).scalar_one())

    async def heartbeat_age_s(self, worker_id: str) -> float | None:
        """Seconds since `worker_id`'s row took its last beat, by the database's clock (None: no row)."""
        async with self._auto.connect() as conn:
            age = (await conn.execute(sql.HEARTBEAT_AGE, {"id": worker_id})).scalar()
        return None if age is None else float(age)

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
