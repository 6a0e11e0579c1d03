"""Liveness and readiness for load balancers."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sqlalchemy import text

router = APIRouter(tags=["ops"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """The process is alive."""
    return {"status": "ok"}


@router.get("/readyz", responses={503: {"description": "The database is unreachable"}})
async def readyz(request: Request) -> Any:
    """The database answers: this process can take requests."""
    try:
        async with request.app.state.engine.connect() as conn:
            await conn.execute(text("SELECT 1"))
    except Exception as exc:
        return JSONResponse(
            {"status": "unavailable", "detail": str(exc)[:200]}, status_code=503, headers={"Retry-After": "5"}
        )
    return {"status": "ready"}
