"""The model catalog: which models can run, their parameters, and how many live workers serve them."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request

from app.api.deps import ServicesDep, get_caller
from app.queue import records

router = APIRouter(
    tags=["models"],
    dependencies=[Depends(get_caller)],
    responses={401: {"description": "Missing, invalid or revoked API key"}},
)


@router.get("/models")
async def list_models(request: Request, services: ServicesDep) -> dict[str, Any]:
    """Every registered model: parameters, VRAM declared and observed, timeout, outputs, and the
    live workers that serve it (0: its jobs wait until one starts)."""
    dead_after = request.app.state.settings.dead_worker_after_s
    workers = await services.manager.reports.workers(recent_s=0)
    serving = records.serving(workers, dead_after, services.models.smallest_needs_mb())
    models = []
    for spec in services.models.models.values():
        entry = spec.public()
        entry["live_workers"] = serving[spec.name]
        if services.learner is not None:
            entry["vram_learning"] = await services.learner.report(spec)
        models.append(entry)
    return {"models": models}
