"""Admin routes: retry failed or canceled jobs."""

from __future__ import annotations

import uuid

from fastapi import APIRouter

from app.api.deps import CallerDep, ServicesDep
from app.api.schemas import ErrorPublic, JobPublic, RetryCount, RetryFilter

router = APIRouter(prefix="/admin", tags=["admin"])


@router.post(
    "/jobs/{job_id}/retry",
    response_model=JobPublic,
    responses={404: {"model": ErrorPublic}, 409: {"model": ErrorPublic}},
)
async def retry_job(job_id: uuid.UUID, services: ServicesDep, caller: CallerDep) -> JobPublic:
    """Queue a failed or canceled job again with a fresh budget of attempts."""
    job = await services.manager.get(job_id)
    attempts = services.models.get(job.model).max_attempts
    await services.manager.retry(job_id, by=caller.principal, attempts=attempts)
    return JobPublic.of(await services.manager.get(job_id), services.signer)


@router.post("/jobs/retry", response_model=RetryCount)
async def retry_jobs(body: RetryFilter, services: ServicesDep, caller: CallerDep) -> RetryCount:
    """Queue again every failed job that matches the filter; returns how many."""
    names = [body.model] if body.model is not None else list(services.models.models)
    total = 0
    for name in names:
        spec = services.models.get(name)
        total += await services.manager.retry_matching(
            by=caller.principal,
            attempts=spec.max_attempts,
            model=name,
            error_contains=body.error_contains,
            since=body.since,
            until=body.until,
        )
    return RetryCount(retried=total)
