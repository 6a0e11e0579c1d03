"""Job values: the state machine's states and a read-only view of a job row."""

from __future__ import annotations

import dataclasses
import enum
import math
import struct
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final

# What is kept of a model's progress message, in the job row and in its milestone events.
PROGRESS_MESSAGE_CHARS: Final = 200


class JobState(enum.StrEnum):
    """Where a job is in its life (DESIGN.md "Job lifecycle")."""

    queued = "queued"
    scheduled = "scheduled"  # waiting for its retry time (backoff); queued again when it comes
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    canceled = "canceled"
    quarantined = "quarantined"  # its runs kept dying abnormally: parked for an admin

    @property
    def final(self) -> bool:
        """True for the states a job leaves only by an admin retry."""
        return self in FINAL_STATES


FINAL_STATES = frozenset({JobState.succeeded, JobState.failed, JobState.canceled, JobState.quarantined})
RETRYABLE_STATES = frozenset({JobState.failed, JobState.canceled, JobState.quarantined})  # by an admin
# A cancel ends a waiting job, stops a running one, and dismisses a quarantined one (sql._CANCEL).
CANCELABLE_STATES = frozenset({JobState.queued, JobState.scheduled, JobState.running, JobState.quarantined})

# Jobs are grouped into size classes of an eighth of an octave (256 MB and below is class 0) so the
# claim can probe "the best job of each class that fits" through an index instead of walking
# past every queued job that fits nowhere (DESIGN.md: the fit-filter trap).
VRAM_CLASS_BASE_MB = 256
VRAM_CLASSES_PER_OCTAVE = 8
VRAM_CLASS_SQL = (
    f"GREATEST(0, floor({VRAM_CLASSES_PER_OCTAVE} * log(2.0, "
    f"GREATEST(vram_mb, 1)::numeric / {VRAM_CLASS_BASE_MB})))::smallint"
)


def vram_class(vram_mb: int) -> int:
    """The size class of a VRAM need; the same formula as the generated column."""
    return max(0, math.floor(VRAM_CLASSES_PER_OCTAVE * math.log2(max(vram_mb, 1) / VRAM_CLASS_BASE_MB)))


def classes_up_to(budget_mb: int) -> list[int]:
    """Every class that may hold a job fitting `budget_mb` (the formulas agree with SQL's exactly)."""
    return list(range(vram_class(max(budget_mb, 1)) + 1))


@dataclass(frozen=True, slots=True)
class ResultFile:
    """One output file of a succeeded job."""

    name: str
    bytes: int
    sha256: str
    media_type: str

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ResultFile:
        """From the `results` jsonb element."""
        return cls(data["name"], int(data["bytes"]), data["sha256"], data["media_type"])

    def to_json(self) -> dict[str, Any]:
        """To the `results` jsonb element."""
        return {"name": self.name, "bytes": self.bytes, "sha256": self.sha256, "media_type": self.media_type}


@dataclass(frozen=True, slots=True)
class Job:
    """A job as read from the database."""

    id: uuid.UUID
    owner: str
    model: str
    params: dict[str, Any]
    input_id: int | None
    megapixels: float
    priority: int
    vram_mb: int
    state: JobState
    attempt: int
    max_attempts: int
    run_after: datetime
    lease_expires_at: datetime | None
    worker_id: str | None
    host: str | None
    gpu: int | None
    pid: int | None
    age_boost: int
    declared_vram_mb: int
    vram_peak_mb: int | None
    abnormal_runs: int
    oom_retries: int
    progress: float
    progress_message: str | None
    error: str | None
    cancel_requested: bool
    idempotency_key: str | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    results: tuple[ResultFile, ...] = field(default=())
    expired_at: datetime | None = None
    request_sha256: str | None = None  # the request as sent, with an idempotency key (intake.fingerprint)

    @classmethod
    def from_row(cls, row: Any) -> Job:
        """From a `jobs` row mapping (all columns)."""
        data = dict(row._mapping) if hasattr(row, "_mapping") else dict(row)
        data = {k: v for k, v in data.items() if k in _JOB_FIELDS}  # e.g. vram_class, joined columns
        data["state"] = JobState(data["state"])
        data["results"] = tuple(ResultFile.from_json(r) for r in data.get("results") or ())
        if data.get("progress") is not None:  # the column is NOT NULL; a partial mapping may lack it
            data["progress"] = _shortest_real(data["progress"])
        return cls(**data)

    @property
    def ended_waiting(self) -> bool:
        """Whether the job ended while it waited for its next attempt (canceled during a retry's
        backoff), so its last attempt's run ended before the job did, at a time not kept. Every way
        from `running` back to a wait sets run_after to that moment or later, and a claim starts
        after run_after: a job ended in its run exactly when that run started at or after it."""
        return self.state.final and self.started_at is not None and self.started_at < self.run_after

    def result(self, name: str) -> ResultFile | None:
        """The result file with this name, if any."""
        return next((r for r in self.results if r.name == name), None)


_JOB_FIELDS = frozenset(f.name for f in dataclasses.fields(Job))


def _shortest_real(value: float) -> float:
    """The shortest decimal that a REAL (4-byte float) column's `value` stands for, as PostgreSQL
    writes it (in the NOTIFYs the streams relay): 0.1, where Python reads 0.10000000149011612."""
    as_real = struct.unpack("f", struct.pack("f", value))[0]
    for digits in range(1, 10):  # 9 significant digits tell every 4-byte float apart
        short = float(f"{value:.{digits}g}")
        if struct.unpack("f", struct.pack("f", short))[0] == as_real:
            return short
    return value


@dataclass(frozen=True, slots=True)
class Claimed:
    """A job just leased by a worker, with its input image (media type, bytes)."""

    job: Job
    input: tuple[str, bytes] | None
