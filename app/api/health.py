"""Liveness and readiness for load balancers."""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sqlalchemy import text

from app import errors, migrate

router = APIRouter(tags=["ops"])

READY_TIMEOUT_S = 5.0
GPU_FIELDS = ("index", "name", "total_mb", "free_mb", "reserved_mb", "running_jobs")
code_head = functools.cache(migrate.head)  # the revision this code needs (reads the scripts once)


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """The process is alive."""
    return {"status": "ok"}


@router.get(
    "/readyz", responses={503: {"description": "Not ready: database down, schema behind, or too few workers"}}
)
async def readyz(request: Request) -> Any:
    """Ready to take requests: the database answers at the current schema; live workers and GPUs."""
    settings = request.app.state.settings
    try:
        report = await asyncio.wait_for(_readiness(request), timeout=READY_TIMEOUT_S)
    except Exception as exc:
        why = str(exc)[:200] or type(exc).__name__
        if isinstance(exc, TimeoutError):  # a database that takes connections and never answers
            why = f"no answer within {READY_TIMEOUT_S:g} s"
        body = {"status": "unavailable", "detail": f"database: {why}"}
        return JSONResponse(body, status_code=503, headers={"Retry-After": "5"})
    problems = []
    if report["schema"]["current"] != report["schema"]["head"]:
        try:
            migrate.check_known(report["schema"]["current"])
        except errors.ConfigError as exc:  # a newer release migrated it: migrating cannot help
            problems.append(exc.message)
        else:
            problems.append("the database schema is not at the code's revision: run `gpujobs migrate`")
    if getattr(request.app.state, "worker_failed", False):
        problems.append("the in-process worker stopped after an error (see the log)")
    if report["workers"] < settings.ready_min_workers:
        problems.append(f"{report['workers']} live workers, {settings.ready_min_workers} needed")
    if problems:
        body = {"status": "unavailable", "detail": "; ".join(problems), **report}
        return JSONResponse(body, status_code=503, headers={"Retry-After": "5"})
    return {"status": "ready", **report}


async def _readiness(request: Request) -> dict[str, Any]:
    """What /readyz reports: schema revision, live workers and each of their GPUs' memory."""
    settings = request.app.state.settings
    async with request.app.state.engine.connect() as conn:
        await conn.execute(text("SELECT 1"))
    current = await migrate.current(request.app.state.engine)
    dead_after_s = settings.dead_worker_after_s
    workers = await request.app.state.services.manager.workers(recent_s=0)
    live = [w for w in workers if w.state == "running" and w.heartbeat_age_s < dead_after_s]
    gpus = [{"worker": w.id, **{k: g.get(k) for k in GPU_FIELDS}} for w in live for g in w.gpus]
    return {"schema": {"current": current, "head": code_head()}, "workers": len(live), "gpus": gpus}
