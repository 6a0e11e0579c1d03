"""The database tables. Schema changes go through Alembic migrations only."""

from __future__ import annotations

import builtins
import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import (
    REAL,
    BigInteger,
    Boolean,
    CheckConstraint,
    Computed,
    DateTime,
    Enum,
    ForeignKey,
    Identity,
    Index,
    Integer,
    LargeBinary,
    SmallInteger,
    Text,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB, UUID
from sqlalchemy.orm import Mapped, mapped_column

from app.db import Base
from app.queue.jobs import VRAM_CLASS_SQL, JobState

job_state = Enum(
    JobState,
    name="job_state",
    values_callable=lambda states: [s.value for s in states],
    validate_strings=True,
)

TIMESTAMP = DateTime(timezone=True)


class Input(Base):
    """An uploaded image, stored once per distinct content."""

    __tablename__ = "inputs"

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    sha256: Mapped[str] = mapped_column(Text, unique=True)
    media_type: Mapped[str] = mapped_column(Text)
    width: Mapped[int] = mapped_column(Integer)
    height: Mapped[int] = mapped_column(Integer)
    bytes: Mapped[int] = mapped_column(BigInteger)
    # Stored EXTERNAL (migration 0004): images are compressed already, PostgreSQL need not try.
    data: Mapped[builtins.bytes] = mapped_column(LargeBinary)
    created_at: Mapped[datetime] = mapped_column(TIMESTAMP, server_default=func.now())


class JobRow(Base):
    """One job: what to run, on what, and where it is in its life."""

    __tablename__ = "jobs"

    id: Mapped[uuid.UUID] = mapped_column(
        UUID(as_uuid=True), primary_key=True, server_default=func.gen_random_uuid()
    )
    owner: Mapped[str] = mapped_column(Text, server_default="anonymous")
    model: Mapped[str] = mapped_column(Text)
    params: Mapped[dict[str, Any]] = mapped_column(JSONB, server_default=text("'{}'::jsonb"))
    # NULL once retention deleted an input no other job uses.
    input_id: Mapped[int | None] = mapped_column(BigInteger, ForeignKey("inputs.id"))
    megapixels: Mapped[float] = mapped_column(REAL)
    priority: Mapped[int] = mapped_column(Integer, server_default="0")
    vram_mb: Mapped[int] = mapped_column(Integer)
    vram_class: Mapped[int] = mapped_column(SmallInteger, Computed(VRAM_CLASS_SQL, persisted=True))
    # The registry's estimate; vram_mb may differ (learned from observed peaks, raised after OOM).
    declared_vram_mb: Mapped[int] = mapped_column(Integer, server_default="0")
    vram_peak_mb: Mapped[int | None] = mapped_column(Integer)  # largest GPU memory seen (NVML)
    # Added to priority as the job waits (bounded), so the claim orders by priority + age_boost.
    age_boost: Mapped[int] = mapped_column(SmallInteger, server_default="0")
    # The time the current boost counts from (NULL: created_at; 'infinity' once at the most): the
    # next boost is due one step after it.
    boost_base_at: Mapped[datetime | None] = mapped_column(TIMESTAMP)
    abnormal_runs: Mapped[int] = mapped_column(Integer, server_default="0")  # signals, lost workers
    oom_retries: Mapped[int] = mapped_column(Integer, server_default="0")
    state: Mapped[JobState] = mapped_column(job_state, server_default=JobState.queued.value)
    attempt: Mapped[int] = mapped_column(Integer, server_default="0")
    max_attempts: Mapped[int] = mapped_column(Integer)
    run_after: Mapped[datetime] = mapped_column(TIMESTAMP, server_default=func.now())
    lease_expires_at: Mapped[datetime | None] = mapped_column(TIMESTAMP)
    worker_id: Mapped[str | None] = mapped_column(Text)
    host: Mapped[str | None] = mapped_column(Text)
    gpu: Mapped[int | None] = mapped_column(Integer)
    pid: Mapped[int | None] = mapped_column(Integer)
    progress: Mapped[float] = mapped_column(REAL, server_default="0")
    progress_message: Mapped[str | None] = mapped_column(Text)
    error: Mapped[str | None] = mapped_column(Text)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, server_default=text("false"))
    idempotency_key: Mapped[str | None] = mapped_column(Text)
    # With an idempotency key: SHA-256 of the model, params and priority as the client sent them
    # (intake.fingerprint), so a repeat is known after the registry changed; NULL before 0008.
    request_sha256: Mapped[str | None] = mapped_column(Text)
    results: Mapped[list[dict[str, Any]]] = mapped_column(JSONB, server_default=text("'[]'::jsonb"))
    created_at: Mapped[datetime] = mapped_column(TIMESTAMP, server_default=func.now())
    started_at: Mapped[datetime | None] = mapped_column(TIMESTAMP)
    finished_at: Mapped[datetime | None] = mapped_column(TIMESTAMP)
    # Set when retention deleted the job's files: links then answer 410 Gone.
    expired_at: Mapped[datetime | None] = mapped_column(TIMESTAMP)

    __table_args__ = (
        CheckConstraint("progress >= 0 AND progress <= 1", name="progress_range"),
        CheckConstraint("attempt >= 0 AND max_attempts >= 1", name="attempts"),
        CheckConstraint("vram_mb >= 0", name="vram_positive"),
        # The claim: best job per (model, size class), probed in priority order.
        Index(
            "ix_jobs_claim",
            "model",
            "vram_class",
            text("(priority + age_boost) DESC"),
            "created_at",
            postgresql_where=text("state = 'queued'"),
        ),
        # Aging: queued jobs by the time their boost counts from, so a pass reads only those due.
        Index(
            "ix_jobs_boost_due",
            text("COALESCE(boost_base_at, created_at)"),
            postgresql_where=text("state = 'queued'"),
        ),
        # Retention: is an input still used by another job?
        Index("ix_jobs_input", "input_id"),
        # Retries waiting for their time (promoted back to queued when due).
        Index("ix_jobs_scheduled", "run_after", postgresql_where=text("state = 'scheduled'")),
        # The reaper: running jobs by lease expiry.
        Index("ix_jobs_lease", "lease_expires_at", postgresql_where=text("state = 'running'")),
        # Heartbeats and restart recovery: a worker's running jobs.
        Index("ix_jobs_worker", "worker_id", postgresql_where=text("state = 'running'")),
        # The per-owner queue limit: an owner's waiting jobs, counted on every upload.
        Index(
            "ix_jobs_owner_waiting",
            "owner",
            "state",
            postgresql_where=text("state IN ('queued', 'scheduled')"),
        ),
        # Listing a caller's jobs newest first, with a (created_at, id) cursor.
        Index("ix_jobs_owner_created", "owner", text("created_at DESC"), text("id DESC")),
        # Listing everyone's jobs (admins, the web UI) in the same order: all, of a state, of a model.
        Index("ix_jobs_created", text("created_at DESC"), text("id DESC")),
        Index("ix_jobs_state_created", "state", text("created_at DESC"), text("id DESC")),
        Index("ix_jobs_model_created", "model", text("created_at DESC"), text("id DESC")),
        # Retention: finished jobs whose files are still on disk, oldest first.
        Index(
            "ix_jobs_retention",
            "finished_at",
            postgresql_where=text("expired_at IS NULL AND state IN ('succeeded', 'failed', 'canceled')"),
        ),
        # Recent finished jobs: admin stats, run-time estimates (newest first, never the whole table).
        Index("ix_jobs_finished", "finished_at", postgresql_where=text("finished_at IS NOT NULL")),
        # Recent recorded VRAM peaks, for learned estimates.
        Index(
            "ix_jobs_peaks",
            "finished_at",
            postgresql_where=text(
                "state = 'succeeded' AND vram_peak_mb IS NOT NULL AND declared_vram_mb > 0"
            ),
        ),
        Index(
            "uq_jobs_idempotency",
            "owner",
            "idempotency_key",
            unique=True,
            postgresql_where=text("idempotency_key IS NOT NULL"),
        ),
    )


class JobEvent(Base):
    """One transition or milestone in a job's history."""

    __tablename__ = "job_events"

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    job_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), ForeignKey("jobs.id", ondelete="CASCADE"))
    at: Mapped[datetime] = mapped_column(TIMESTAMP, server_default=func.clock_timestamp())
    kind: Mapped[str] = mapped_column(Text)
    attempt: Mapped[int] = mapped_column(Integer, server_default="0")
    worker_id: Mapped[str | None] = mapped_column(Text)
    detail: Mapped[dict[str, Any]] = mapped_column(JSONB, server_default=text("'{}'::jsonb"))

    __table_args__ = (Index("ix_job_events_job", "job_id", "id"),)


class WorkerRow(Base):
    """A worker process: its host, liveness and GPU snapshot."""

    __tablename__ = "workers"

    id: Mapped[str] = mapped_column(Text, primary_key=True)
    host: Mapped[str] = mapped_column(Text)
    pid: Mapped[int] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(Text, server_default="running")
    started_at: Mapped[datetime] = mapped_column(TIMESTAMP, server_default=func.now())
    heartbeat_at: Mapped[datetime] = mapped_column(TIMESTAMP, server_default=func.now())
    models: Mapped[list[str]] = mapped_column(JSONB, server_default=text("'[]'::jsonb"))
    gpus: Mapped[list[dict[str, Any]]] = mapped_column(JSONB, server_default=text("'[]'::jsonb"))
    paused: Mapped[str | None] = mapped_column(Text)  # why it claims nothing now; NULL: it claims

    __table_args__ = (CheckConstraint("state IN ('running', 'stopping', 'stopped', 'dead')", name="state"),)


class ApiKey(Base):
    """An API key: only its hash is stored. `principal` owns the jobs submitted with it."""

    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    principal: Mapped[str] = mapped_column(Text)
    prefix: Mapped[str] = mapped_column(Text)
    key_hash: Mapped[str] = mapped_column(Text, unique=True)
    role: Mapped[str] = mapped_column(Text, server_default="user")
    created_at: Mapped[datetime] = mapped_column(TIMESTAMP, server_default=func.now())
    revoked_at: Mapped[datetime | None] = mapped_column(TIMESTAMP)
    last_used_at: Mapped[datetime | None] = mapped_column(TIMESTAMP)

    __table_args__ = (CheckConstraint("role IN ('user', 'admin')", name="role"),)
