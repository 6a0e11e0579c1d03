"""Response and request bodies of the HTTP API."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from app import links as links_
from app.queue import records
from app.queue.jobs import Job, JobState, ResultFile


def storable(text: str) -> str:
    """`text`, if PostgreSQL can hold it: no NUL character, no half of a surrogate pair (a JSON
    escape can spell either); they would fail in the database as a 500."""
    if "\x00" in text:
        raise ValueError("must not contain NUL characters")
    try:
        text.encode()
    except UnicodeEncodeError:
        raise ValueError("must not contain half a UTF-16 surrogate pair (\\ud800-\\udfff alone)") from None
    return text


# A string from a request that reaches the database.
Text = Annotated[str, AfterValidator(storable)]


class FilePublic(BaseModel):
    """A result file and its signed download link."""

    name: str
    media_type: str
    bytes: int
    sha256: str
    url: str = Field(description="Signed link; expires, fetch the job again for a fresh one")

    @classmethod
    def of(cls, job_id: uuid.UUID, result: ResultFile, signer: links_.LinkSigner) -> FilePublic:
        """Build from one result of a job, signing its download link."""
        return cls(
            name=result.name,
            media_type=result.media_type,
            bytes=result.bytes,
            sha256=result.sha256,
            url=signer.url(job_id, result.name),
        )


class JobLinks(BaseModel):
    """Where to go next."""

    self: str
    input: str
    events: str
    cancel: str
    log: str | None = Field(None, description="Signed link to the latest attempt's log")


class JobPublic(BaseModel):
    """A job as the API shows it."""

    id: uuid.UUID
    state: JobState
    model: str
    params: dict[str, Any]
    priority: int
    vram_mb: int
    attempt: int
    max_attempts: int
    progress: float
    progress_message: str | None
    error: str | None
    declared_vram_mb: int = Field(description="The model's own estimate; vram_mb may be learned or raised")
    vram_peak_mb: int | None = Field(None, description="Most GPU memory a run was seen using (NVML)")
    next_run_at: datetime | None = Field(None, description="When a queued or scheduled job may start")
    worker_id: str | None
    gpu: int | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    expired_at: datetime | None = Field(None, description="When retention deleted its files (no links)")
    files: list[FilePublic]
    links: JobLinks

    @classmethod
    def of(cls, job: Job, signer: links_.LinkSigner) -> JobPublic:
        """Build from a job, signing its download links."""
        base = f"/jobs/{job.id}"
        files = [FilePublic.of(job.id, r, signer) for r in job.results if job.expired_at is None]
        log = signer.url(job.id, f"attempt-{job.attempt}.log") if job.attempt and not job.expired_at else None
        return cls(
            id=job.id,
            state=job.state,
            model=job.model,
            params=job.params,
            priority=job.priority,
            vram_mb=job.vram_mb,
            declared_vram_mb=job.declared_vram_mb,
            vram_peak_mb=job.vram_peak_mb,
            attempt=job.attempt,
            max_attempts=job.max_attempts,
            progress=job.progress,
            progress_message=job.progress_message,
            error=job.error,
            next_run_at=job.run_after if job.state in (JobState.queued, JobState.scheduled) else None,
            worker_id=job.worker_id,
            gpu=job.gpu,
            created_at=job.created_at,
            started_at=job.started_at,
            finished_at=job.finished_at,
            expired_at=job.expired_at,
            files=files,
            links=JobLinks(
                self=base, input=f"{base}/input", events=f"{base}/events", cancel=f"{base}/cancel", log=log
            ),
        )


class JobsPublic(BaseModel):
    """One page of jobs, newest first."""

    jobs: list[JobPublic]
    next_cursor: str | None = Field(None, description="Pass as `cursor` for the next page; null on the last")


class EventPublic(BaseModel):
    """One entry of a job's history."""

    id: int
    at: datetime
    kind: str
    attempt: int
    worker_id: str | None
    detail: dict[str, Any]

    @classmethod
    def of(cls, event: records.Event) -> EventPublic:
        """Build from a stored event."""
        return cls(
            id=event.id,
            at=event.at,
            kind=event.kind,
            attempt=event.attempt,
            worker_id=event.worker_id,
            detail=event.detail,
        )


class ErrorPublic(BaseModel):
    """Every error: a message that says what to fix."""

    detail: str


def _utc(moment: datetime) -> datetime:
    """The time in UTC, a time without a zone read as UTC (the database driver would read it in
    the host's zone); ValueError for one that is a date where it was written but past the
    calendar in UTC (after 9999-12-31, before 0001-01-01)."""
    try:
        return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)
    except OverflowError:
        raise ValueError("out of range: in UTC it falls outside the years 1 to 9999") from None


class RetryFilter(BaseModel):
    """Which failed jobs to queue again."""

    model_config = ConfigDict(extra="forbid")  # a misspelt filter must not widen to every job

    # An empty filter is refused: "" in `error_contains` matched every error (an unset $PATTERN).
    model: Text | None = Field(None, min_length=1)
    error_contains: Text | None = Field(
        None, min_length=1, max_length=500, description="Leave out to match any error"
    )
    since: datetime | None = Field(None, description="Finished at or after")
    until: datetime | None = Field(None, description="Finished before")

    @field_validator("since", "until")
    @classmethod
    def _in_utc(cls, moment: datetime | None) -> datetime | None:
        return None if moment is None else _utc(moment)

    @model_validator(mode="after")
    def _a_range_that_holds_something(self) -> RetryFilter:
        if self.since is not None and self.until is not None and self.since >= self.until:
            raise ValueError("since must be before until (swapped dates match no job)")
        return self


class RetryCount(BaseModel):
    """How many jobs a bulk retry queued again, and how many matching ones it left."""

    retried: int
    left: int = Field(
        description="Matching jobs not queued again: the queue reached GPUJOBS_QUEUE_LIMIT, or another "
        "request held them; the same filter asked again takes them"
    )
    unserved: int = Field(
        description="Matching jobs not queued again because their model is not in this API's model "
        "registry (no worker of it would run them): add the model back to retry them"
    )
    queue_full: bool = Field(description="It stopped because the queue reached GPUJOBS_QUEUE_LIMIT")


# The states a cancel takes, and those a bulk cancel takes unless told.
Cancelable = Literal["queued", "scheduled", "running"]
WAITING: tuple[Cancelable, ...] = ("queued", "scheduled")


class CancelFilter(BaseModel):
    """Which unfinished jobs to cancel: those of a model, of an owner, or with `all`, every one."""

    model_config = ConfigDict(extra="forbid")  # a misspelt filter must not widen to every job

    # Empty, they matched nothing and answered 200 {"canceled": 0}: an unset $OWNER read as "none waiting".
    model: Text | None = Field(None, min_length=1, description="Also a model no longer in the registry")
    owner: Text | None = Field(None, min_length=1, description="The principal of the key that submitted them")
    states: list[Cancelable] = Field(
        default_factory=lambda: list(WAITING),
        min_length=1,
        description="Running jobs are asked to stop: their workers, told at once, kill them",
    )
    all: bool = Field(False, description="Without model or owner: every job in those states")

    @model_validator(mode="after")
    def _all_only_alone(self) -> CancelFilter:
        given = self.model is not None or self.owner is not None
        if not given and not self.all:
            raise ValueError("give a model or an owner, or all: true to cancel every job in those states")
        if given and self.all:
            raise ValueError("all: true cancels every job in those states: leave out model and owner")
        return self


class CancelCount(BaseModel):
    """How many jobs a bulk cancel ended, and how many running ones it asked to stop."""

    canceled: int
    stopping: int = Field(description="Running jobs asked to stop; each ends `canceled` when killed")
    left: int = Field(
        0,
        description="Matching jobs not canceled: other statements (a claim, a finishing run) held them "
        "for 5 s; the same filter asked again takes them",
    )


class CancelPublic(BaseModel):
    """The job's state after a cancel: `canceled`, or `running` while its process is being killed."""

    id: uuid.UUID
    state: JobState


class WarmRunnerPublic(BaseModel):
    """A warm runner: one process of a persistent model, kept loaded on this GPU between jobs."""

    model: str
    pid: int | None
    state: str = Field(description="starting (loading the model), idle, busy or closing")
    jobs: int = Field(description="Jobs it has answered")
    up_s: float = Field(description="Seconds since it was started")
    load_s: float | None = Field(
        description="Seconds its start took (loading the model); null while starting"
    )
    idle_s: float | None = Field(description="Seconds since its last job, while idle")
    vram_mb: int = Field(description="VRAM it holds while idle; while busy, its job's reservation covers it")


class WorkerGpuPublic(BaseModel):
    """One GPU of a worker, as its last heartbeat saw it (MB = MiB)."""

    index: int
    name: str
    virtual: bool
    total_mb: int
    free_mb: int = Field(description="Free memory reported by NVML (virtual GPUs: total)")
    error: str | None = Field(
        None,
        description="Why NVML could not read it at the last heartbeat (fallen off the bus, say): it is "
        "shown full and takes no jobs meanwhile; null when read",
    )
    offered_mb: int | None = Field(
        None,
        description="The most one job may be given on it: its size less the worker's "
        "GPUJOBS_VRAM_BUFFER_MB (null from a worker of an earlier version)",
    )
    reserved_mb: int = Field(
        description="VRAM promised to the jobs running on it and held by its idle warm runners"
    )
    running_jobs: int
    warm: list[WarmRunnerPublic] = Field(default_factory=list, description="Its warm runners, oldest first")
    warm_starts: dict[str, int] = Field(
        default_factory=dict,
        description="Warm runners started on it since the worker started, by model: a count that climbs "
        "while jobs do not is a runner that keeps dying, or keeps being evicted for another model",
    )

    @classmethod
    def of(cls, gpu: dict[str, Any]) -> WorkerGpuPublic:
        """From a heartbeat snapshot entry."""
        return cls(
            index=int(gpu.get("index", 0)),
            name=str(gpu.get("name", "")),
            virtual=bool(gpu.get("virtual", False)),
            total_mb=int(gpu.get("total_mb", 0)),
            free_mb=int(gpu.get("free_mb", 0)),
            error=gpu.get("error"),
            offered_mb=None if gpu.get("offered_mb") is None else int(gpu["offered_mb"]),
            reserved_mb=int(gpu.get("reserved_mb", 0)),
            running_jobs=int(gpu.get("running_jobs", 0)),
            warm=[WarmRunnerPublic.model_validate(runner) for runner in gpu.get("warm") or ()],
            warm_starts=gpu.get("warm_starts") or {},
        )


class WorkerPublic(BaseModel):
    """A worker: where it runs, whether it is alive, its GPUs and its jobs."""

    id: str
    host: str
    pid: int
    state: str = Field(description="running, stopping, stopped or dead")
    live: bool = Field(description="Running and heartbeating within the dead-worker limit")
    paused: str | None = Field(
        description="Why the worker claims nothing now (its storage folder takes no file: a full disk, "
        "a folder gone read-only), as of its last heartbeat; null while it claims"
    )
    shares_storage: bool | None = Field(
        description="Whether the worker writes to this API's storage folder (false: its results and "
        "logs cannot be downloaded here); null unless live"
    )
    started_at: datetime
    heartbeat_at: datetime
    heartbeat_age_s: float
    models: list[str]
    gpus: list[WorkerGpuPublic] = Field(
        description="As of its last heartbeat: of a worker that is not live, what it last reported, "
        "not what it holds"
    )
    running_jobs: list[uuid.UUID]


class QueueDepthPublic(BaseModel):
    """How many unfinished jobs of one model and priority are in one state."""

    state: str
    model: str
    priority: int
    jobs: int
    live_workers: int = Field(description="Live workers that serve the model (0: none will take these jobs)")


class PercentilesPublic(BaseModel):
    """Median and 95th percentile, in seconds."""

    p50: float
    p95: float


class StatsPublic(BaseModel):
    """The service at a glance."""

    queue: list[QueueDepthPublic]
    live_workers: int
    window_s: float = Field(description="Finished counts, failure rate and percentiles cover this window")
    finished: int
    succeeded: int
    failed: int = Field(description="Failed or quarantined")
    failure_rate: float | None = Field(description="failed / (succeeded + failed); null without either")
    wait_s: PercentilesPublic | None = Field(description="Submission to the start of the last attempt")
    run_s: PercentilesPublic | None = Field(description="Start to end of the last attempt")
    throughput_window_s: float
    throughput_per_min: float = Field(description="Jobs finished per minute over throughput_window_s")
    storage_bytes: dict[str, int] = Field(
        description="Bytes below storage/: each part (results, logs, scratch, pgdata; one that is a "
        "link to another disk measured there), other (the rest), and total (all of them)"
    )
    storage_free_bytes: dict[str, int] = Field(
        description="Free bytes on the disk of each part of storage/ (results, logs, scratch, pgdata), now"
    )


class PruneRequest(BaseModel):
    """What to prune."""

    model_config = ConfigDict(extra="forbid")  # a misspelt `dry_run` must not delete for real

    older_than_s: float | None = Field(
        default=None,
        ge=0,
        le=100 * 365 * 86_400,
        allow_inf_nan=False,  # else NaN is refused as "should be less than or equal to ..."
        description="Finished longer ago than this; default: the retention_days setting",
    )
    dry_run: bool = Field(default=False, description="Only report what would be deleted")


class PrunePublic(BaseModel):
    """What a prune deleted (or would delete)."""

    cutoff: datetime
    dry_run: bool
    jobs: int
    files_bytes: int
    inputs_deleted: int | None = Field(description="Null in a dry run (not estimated)")
    inputs_bytes: int
    leftovers_removed: int = Field(
        description="Jobs already expired whose files were found and removed (a dry run: would be)"
    )
    job_ids: list[uuid.UUID] = Field(description="The first 1000 jobs expired")
