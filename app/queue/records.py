"""What the manager's observability, retention and bulk cancel methods return, and the advisory lock."""

from __future__ import annotations

import uuid
from collections import Counter
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from app.queue import sql


@dataclass(frozen=True, slots=True)
class Expired:
    """One batch of retention: the jobs marked expired and the inputs deleted with them."""

    job_ids: list[uuid.UUID]
    inputs_deleted: int
    input_bytes: int


@dataclass(frozen=True, slots=True)
class Canceled:
    """A bulk cancel: jobs ended `canceled`, running jobs asked to stop, and of the former those
    that had run before (waiting for a retry), as (id, attempt): their attempts' files may go."""

    canceled: int
    stopping: int
    ended_waiting: list[tuple[uuid.UUID, int]]


@dataclass(frozen=True, slots=True)
class Retried:
    """A bulk retry: jobs queued again, matching jobs it left (the queue was full, or another
    statement held them), and whether it stopped at the queue limit."""

    retried: int
    left: int
    queue_full: bool


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """A worker as its last heartbeat left it."""

    id: str
    host: str
    pid: int
    state: str
    started_at: datetime
    heartbeat_at: datetime
    heartbeat_age_s: float
    models: list[str]
    gpus: list[dict[str, Any]]
    running_jobs: list[uuid.UUID]

    @classmethod
    def from_row(cls, row: Any) -> WorkerInfo:
        """From a sql.WORKERS row."""
        data = dict(row._mapping)
        data["heartbeat_age_s"] = float(data["heartbeat_age_s"])
        data["running_jobs"] = list(data["running_jobs"] or [])
        return cls(**data)

    def is_live(self, dead_after_s: float) -> bool:
        """Running, with a heartbeat younger than `dead_after_s` (older: its jobs will be reaped)."""
        return self.state == "running" and self.heartbeat_age_s < dead_after_s


def serving(workers: list[WorkerInfo], dead_after_s: float) -> Counter[str]:
    """How many live workers serve each model (a model no live worker serves is absent: 0)."""
    return Counter(model for w in workers if w.is_live(dead_after_s) for model in set(w.models))


@dataclass(frozen=True, slots=True)
class FinishedStats:
    """Jobs that finished in a window: counts and p50 / p95 of wait and run (None: no job)."""

    finished: int
    succeeded: int
    failed: int
    recent: int
    wait_s: tuple[float, float] | None
    run_s: tuple[float, float] | None

    @classmethod
    def from_row(cls, row: Any) -> FinishedStats:
        """From a sql.FINISHED_STATS row."""

        def pair(value: Any) -> tuple[float, float] | None:
            return None if value is None else (float(value[0]), float(value[1]))

        return cls(row.finished, row.succeeded, row.failed, row.recent, pair(row.wait_s), pair(row.run_s))


class AdvisoryLock:
    """A session advisory lock held on its own AUTOCOMMIT connection (no transaction stays open)."""

    def __init__(self, engine: AsyncEngine, key: int) -> None:
        self._engine = engine
        self._key = key
        self._conn: AsyncConnection | None = None
        self.held = False

    async def __aenter__(self) -> bool:
        conn = await self._engine.connect()
        self._conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
        try:
            self.held = bool(await self._conn.scalar(sql.TRY_LOCK, {"key": self._key}))
        except BaseException:
            await self._conn.close()
            raise
        return self.held

    async def __aexit__(self, *exc: object) -> None:
        assert self._conn is not None
        try:
            if self.held:
                await self._conn.execute(sql.UNLOCK, {"key": self._key})
        finally:
            self.held = False
            await self._conn.close()
