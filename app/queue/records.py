"""Values the queue takes and returns: a new job and its image, a job's history and listing, jobs
taken back from lost workers, what observability, retention and bulk actions report, and the
advisory lock."""

from __future__ import annotations

import json
import uuid
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from app.queue import sql
from app.queue.jobs import Job, JobState


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
    key_id: int | None = None  # the API key it came with: still unrevoked when it is written, or nothing is

    def enqueue_values(self, image: NewInput, *, queue_limit: int, owner_limit: int) -> dict[str, Any]:
        """ENQUEUE's parameters for this job and its image, under these limits (0: no owner limit)."""
        return {
            "owner": self.owner,
            "model": self.model,
            "params": json.dumps(dict(self.params)),
            "megapixels": image.megapixels,
            "priority": self.priority,
            "vram_mb": self.vram_mb,
            "declared_vram_mb": self.vram_mb if self.declared_vram_mb is None else self.declared_vram_mb,
            "max_attempts": self.max_attempts,
            "idempotency_key": self.idempotency_key,
            "request_sha256": self.request_sha256,
            "key_id": self.key_id,
            "queue_limit": queue_limit,
            "owner_limit": max(owner_limit, 0),
            **image.row_values(),
        }


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
class Beat:
    """A heartbeat's answer: the jobs still owned (id -> attempt, cancel requested), and how many
    seconds the database's clock stepped forward since the worker's beat before (0: none seen)."""

    owned: dict[uuid.UUID, tuple[int, bool]]
    stepped_s: float
    sent: float  # when the statement was sent, by time.monotonic(): the worker's new last beat


@dataclass(frozen=True, slots=True)
class Page:
    """One page of a job listing."""

    jobs: list[Job]
    next_cursor: str | None


@dataclass(frozen=True, slots=True)
class Expired:
    """One batch of retention: the jobs marked expired and the inputs deleted with them."""

    job_ids: list[uuid.UUID]
    inputs_deleted: int
    input_bytes: int


@dataclass(frozen=True, slots=True)
class Canceled:
    """A bulk cancel: jobs ended `canceled`, running jobs asked to stop, and of the former those
    that had run before (waiting for a retry), as (id, attempt): their attempts' files may go;
    `left`: matching jobs other statements held past its patience, not canceled."""

    canceled: int
    stopping: int
    ended_waiting: list[tuple[uuid.UUID, int]]
    left: int = 0


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
    paused: str | None  # why it claims nothing now (its storage folder takes no file); None: it claims
    running_jobs: list[uuid.UUID]

    @classmethod
    def from_row(cls, row: Any) -> WorkerInfo:
        """From a sql.WORKERS row."""
        data = dict(row._mapping)
        data["heartbeat_age_s"] = float(data["heartbeat_age_s"])
        data["running_jobs"] = list(data["running_jobs"] or [])
        return cls(**data)

    def can_take(self, need_mb: int) -> bool:
        """Whether this worker's largest GPU, as it last reported, offers `need_mb` to one job (a
        snapshot without `offered_mb`, an earlier version's: its size; one with no GPUs: yes)."""
        sizes = [int(g.get("offered_mb", g.get("total_mb")) or 0) for g in self.gpus]
        return not sizes or max(sizes) >= need_mb

    def is_live(self, dead_after_s: float) -> bool:
        """Running, with a heartbeat younger than `dead_after_s` (older: its jobs will be reaped)."""
        return self.state == "running" and self.heartbeat_age_s < dead_after_s


def serving(workers: list[WorkerInfo], dead_after_s: float, needs_mb: Mapping[str, int]) -> Counter[str]:
    """How many live workers serve each model (a model no live worker serves is absent: 0): those
    not paused (they claim nothing now) that have it and a GPU offering its `needs_mb` (for the
    smallest input; a worker lists every model of its registry, those its GPUs are too small for
    included, and never claims their jobs)."""
    return Counter(
        model for w in workers if w.is_live(dead_after_s) and w.paused is None
        for model in set(w.models) if w.can_take(needs_mb.get(model, 0))
    )  # fmt: skip


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
