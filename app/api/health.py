"""Liveness and readiness for load balancers."""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sqlalchemy import text

from app import errors, migrate

router = APIRouter(tags=["ops"])
log = logging.getLogger("gpujobs.health")

READY_TIMEOUT_S = 5.0
GPU_FIELDS = ("index", "name", "total_mb", "free_mb", "reserved_mb", "running_jobs")
code_head = functools.cache(migrate.head)  # the revision this code needs (reads the scripts once)


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """The process is alive."""
    return {"status": "ok"}


@router.get(
    "/readyz",
    responses={
        503: {"description": "Not ready: database down, schema behind, worker stopped, or too few workers"}
    },
)
async def readyz(request: Request) -> Any:
    """Ready to take requests: the database answers at the current schema; live workers and GPUs."""
    settings = request.app.state.settings
    try:
        report = await asyncio.wait_for(_readiness(request), timeout=READY_TIMEOUT_S)
    except Exception as exc:
        body = {"status": "unavailable", "detail": f"database: {_unready(request, exc)}"}
        return JSONResponse(body, status_code=503, headers={"Retry-After": "5"})
    request.app.state.readyz_failing = False
    problems = []
    schema_ok = migrate.runs_on(report["schema"]["current"], report["schema"]["oldest_code"])
    if not schema_ok:
        try:
            migrate.check_known(report["schema"]["current"])
        except errors.ConfigError as exc:  # a newer release migrated it: migrating cannot help
            problems.append(exc.message)
        else:
            problems.append("the database schema is not at the code's revision: run `gpujobs migrate`")
    if getattr(request.app.state, "worker_failed", False):
        problems.append("the in-process worker stopped after an error (see the log)")
    if schema_ok and report["workers"] < settings.ready_min_workers:  # at another schema, not read
        problems.append(f"{report['workers']} live workers, {settings.ready_min_workers} needed")
    if problems:
        body = {"status": "unavailable", "detail": "; ".join(problems), **report}
        return JSONResponse(body, status_code=503, headers={"Retry-After": "5"})
    return {"status": "ready", **report}


def _unready(request: Request, error: Exception) -> str:
    """Why the database check failed, for anyone to read: its error's class, never its text (which
    names the database's address). The whole error is logged, once until a check passes again."""
    if not getattr(request.app.state, "readyz_failing", False):
        request.app.state.readyz_failing = True
        log.warning("readyz: the database check failed", exc_info=error, extra={"action": "db_down"})
    if isinstance(error, TimeoutError):  # a database that takes connections and never answers
        return f"no answer within {READY_TIMEOUT_S:g} s"
    orig = getattr(error, "orig", None)  # through SQLAlchemy's wrapper and the dialect's own error
    return f"unreachable ({type(getattr(orig, '__cause__', None) or orig or error).__name__})"


async def _readiness(request: Request) -> dict[str, Any]:
    """What /readyz reports: schema revision, live workers and each of their GPUs' memory."""
    settings = request.app.state.settings
    async with request.app.state.engine.connect() as conn:
        await conn.execute(text("SELECT 1"))
    current, oldest_code = await migrate.schema(request.app.state.engine)
    schema = {"current": current, "head": code_head(), "oldest_code": oldest_code}
    if not migrate.runs_on(current, oldest_code):  # this code reads workers at schemas it runs on
        return {"schema": schema, "workers": 0, "gpus": []}
    workers = await request.app.state.services.manager.reports.workers(recent_s=0)
    live = [w for w in workers if w.is_live(settings.dead_worker_after_s)]
    gpus = [{"worker": w.id, **{k: g.get(k) for k in GPU_FIELDS}} for w in live for g in w.gpus]
    return {"schema": schema, "workers": len(live), "gpus": gpus}


# HEAD where GET answers (RFC 9110): uptime monitors and load balancers' health checks send it.
router.add_api_route("/healthz", healthz, methods=["HEAD"], include_in_schema=False)
router.add_api_route("/readyz", readyz, methods=["HEAD"], include_in_schema=False)
