"""Admin routes: retry failed or canceled jobs, cancel in bulk; workers, stats and retention on demand."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import Iterable
from typing import Annotated

from fastapi import APIRouter, Body, Depends, Request

from app import errors, retention, storage
from app.api import forms
from app.api.deps import CallerDep, InvalidPublic, ServicesDep, require_admin
from app.api.schemas import (
    CancelCount,
    CancelFilter,
    ErrorPublic,
    JobPublic,
    PercentilesPublic,
    PrunePublic,
    PruneRequest,
    QueueDepthPublic,
    RetryCount,
    RetryFilter,
    StatsPublic,
    WorkerGpuPublic,
    WorkerPublic,
)
from app.queue import manager as manager_
from app.queue import records
from app.queue.jobs import RETRYABLE_STATES, JobState
from app.settings import Settings

# Admin keys only: 401 without a key, 403 with a user's (also enforced by `security.Authenticate`).
router = APIRouter(
    prefix="/admin",
    tags=["admin"],
    route_class=forms.JsonRoute,  # a body that is not JSON: one sentence on how to send it
    dependencies=[Depends(require_admin)],
    responses={
        401: {"model": ErrorPublic, "description": "Missing, invalid or revoked API key"},
        403: {"model": ErrorPublic, "description": "Not an admin key"},
        422: {"model": InvalidPublic, "description": "A parameter is not valid (the message names it)"},
    },
)


@router.post(
    "/jobs/{job_id}/retry",
    response_model=JobPublic,
    responses={404: {"model": ErrorPublic}, 409: {"model": ErrorPublic}},
)
async def retry_job(job_id: uuid.UUID, services: ServicesDep, caller: CallerDep) -> JobPublic:
    """Queue a failed, canceled or quarantined job again with a fresh budget of attempts."""
    # Not held to the queue limit: an admin chose this one job (README, "HTTP API").
    job = await services.manager.get(job_id)
    if job.expired_at is not None:
        raise _expired(job_id)
    if job.state not in RETRYABLE_STATES:  # before the model: adding it back would not help
        raise manager_.not_retryable(job_id, job.state.value)
    spec = services.models.models.get(job.model)
    if spec is None:  # no worker of this registry would run it; queued, it would wait for good
        raise _unserved(job_id, job.model, services.models.models)
    # 410 if retention expired it since the read above
    await services.manager.retry(job_id, by=caller.principal, attempts=spec.max_attempts)
    return JobPublic.of(await services.manager.get(job_id), services.signer)


def _expired(job_id: uuid.UUID) -> errors.Gone:
    return errors.Gone(f"job {job_id} expired: retention deleted its input and files")


def _unserved(job_id: uuid.UUID, model: str, known: Iterable[str]) -> errors.Conflict:
    # About the job: the registry's own UnknownModel named a `model` field the admin never sent.
    names = ", ".join(sorted(known)) or "none"
    return errors.Conflict(
        f"job {job_id} is of model {model!r}, which this API's model registry does not have "
        f"(known: {names}): add the model back (GPUJOBS_MODELS_FILE) to retry the job"
    )


@router.post("/jobs/retry", response_model=RetryCount)
async def retry_jobs(
    services: ServicesDep, caller: CallerDep, body: Annotated[RetryFilter | None, Body()] = None
) -> RetryCount:
    """Queue again the failed jobs matching the filter, up to the queue limit; how many, how many left."""
    body = body or RetryFilter.model_validate({})  # no body: as `{}`, every failed job (README)
    # Jobs of models this registry lacks are never queued again (no worker of it would run them):
    # counted apart, as `unserved`, so the answer never reads "none left" while they stay failed.
    names = [body.model] if body.model is not None else list(services.models.models)
    unserved = 0
    if body.model is None:  # a `model` this registry lacks is 422 below (UnknownModel)
        unserved = await services.manager.bulk.count_unserved(
            known=names, error_contains=body.error_contains, since=body.since, until=body.until
        )
    retried, left, full = 0, 0, False
    for name in names:
        spec = services.models.get(name)
        done = await services.manager.bulk.retry_matching(
            by=caller.principal,
            attempts=spec.max_attempts,
            queue_limit=services.limits.queue_limit,
            model=name,
            error_contains=body.error_contains,
            since=body.since,
            until=body.until,
        )
        retried, left, full = retried + done.retried, left + done.left, full or done.queue_full
    return RetryCount(retried=retried, left=left, unserved=unserved, queue_full=full)


@router.post("/jobs/cancel", response_model=CancelCount)
async def cancel_jobs(body: CancelFilter, services: ServicesDep, caller: CallerDep) -> CancelCount:
    """Cancel every job of the filter's states (queued and scheduled unless told) that matches it."""
    done = await services.manager.bulk.cancel_matching(
        by=caller.principal,
        states={JobState(s) for s in body.states},
        model=body.model,
        owner=body.owner,
    )
    if done.ended_waiting:  # their lost attempts' files go, as a single cancel's do
        await asyncio.to_thread(_drop_attempts, services.store, done.ended_waiting)
    return CancelCount(canceled=done.canceled, stopping=done.stopping, left=done.left)


def _drop_attempts(store: storage.ResultStore, jobs: list[tuple[uuid.UUID, int]]) -> None:
    for job_id, attempt in jobs:
        store.drop_attempts(job_id, upto=attempt)


# -- observability ------------------------------------------------------------------------------

STATS_WINDOW_S = 3600.0
THROUGHPUT_WINDOW_S = 300.0


def _worker_public(w: records.WorkerInfo, dead_after: float, store: storage.ResultStore) -> WorkerPublic:
    live = w.is_live(dead_after)
    return WorkerPublic(
        id=w.id,
        host=w.host,
        pid=w.pid,
        state=w.state,
        live=live,
        paused=w.paused,
        # A live worker holds its lock file in its storage folder (app/presence.py): absent from
        # this API's, the worker writes its results and logs where this API cannot serve them.
        shares_storage=store.lanes.lock_file(w.id).exists() if live else None,
        started_at=w.started_at,
        heartbeat_at=w.heartbeat_at,
        heartbeat_age_s=round(w.heartbeat_age_s, 3),
        models=list(w.models),
        gpus=[WorkerGpuPublic.of(g) for g in w.gpus],
        running_jobs=w.running_jobs,
    )


@router.get("/workers", response_model=list[WorkerPublic])
async def list_workers(request: Request, services: ServicesDep) -> list[WorkerPublic]:
    """Workers seen in the last day: host, state, heartbeat age, GPUs with their VRAM, running jobs."""
    dead_after = request.app.state.settings.dead_worker_after_s
    workers = await services.manager.reports.workers()
    return [_worker_public(w, dead_after, services.store) for w in workers]


@router.get("/stats", response_model=StatsPublic)
async def get_stats(request: Request, services: ServicesDep) -> StatsPublic:
    """Queue depth by model and priority, wait and run p50/p95, throughput, failure rate, storage."""
    manager = services.manager
    dead_after = request.app.state.settings.dead_worker_after_s
    storage_dir = request.app.state.settings.storage_dir
    depth = await manager.reports.queue_depth()
    seen = await manager.reports.workers(recent_s=0)
    done = await manager.reports.finished_stats(window_s=STATS_WINDOW_S, recent_s=THROUGHPUT_WINDOW_S)
    judged = done.succeeded + done.failed
    # A model dropped from the registry, or served only by workers that are down: its jobs wait.
    serving = records.serving(seen, dead_after, services.models.smallest_needs_mb())
    return StatsPublic(
        queue=[
            QueueDepthPublic(state=s, model=m, priority=p, jobs=n, live_workers=serving[m])
            for s, m, p, n in depth
        ],
        live_workers=sum(w.is_live(dead_after) for w in seen),
        window_s=STATS_WINDOW_S,
        finished=done.finished,
        succeeded=done.succeeded,
        failed=done.failed,
        failure_rate=round(done.failed / judged, 4) if judged else None,
        wait_s=None if done.wait_s is None else PercentilesPublic(p50=done.wait_s[0], p95=done.wait_s[1]),
        run_s=None if done.run_s is None else PercentilesPublic(p50=done.run_s[0], p95=done.run_s[1]),
        throughput_window_s=THROUGHPUT_WINDOW_S,
        throughput_per_min=round(done.recent / (THROUGHPUT_WINDOW_S / 60), 3),
        storage_bytes=await request.app.state.disk_usage.read(),
        storage_free_bytes={part: free for part, (_size, free) in retention.disk_space(storage_dir).items()},
    )


@router.post("/prune", response_model=PrunePublic, responses={409: {"model": ErrorPublic}})
async def prune(request: Request, body: Annotated[PruneRequest | None, Body()] = None) -> PrunePublic:
    """Delete the files, logs and unused inputs of finished jobs older than the retention age, now."""
    body = body or PruneRequest()  # no body: as `{}`, every field at its default
    settings: Settings = request.app.state.settings
    older_than_s = body.older_than_s
    if older_than_s is None:
        if settings.retention_days <= 0:
            raise errors.InvalidRequest("retention is off (retention_days = 0): give older_than_s")
        older_than_s = settings.retention_days * 86_400
    pruner: retention.Pruner = request.app.state.pruner
    report = await pruner.prune(older_than_s=older_than_s, dry_run=body.dry_run)
    return PrunePublic(**dataclasses.asdict(report))
