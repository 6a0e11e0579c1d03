"""The model catalog: which models can run, and their parameters."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from app.api.deps import ServicesDep, get_caller

router = APIRouter(
    tags=["models"],
    dependencies=[Depends(get_caller)],
    responses={401: {"description": "Missing, invalid or revoked API key"}},
)


@router.get("/models")
async def list_models(services: ServicesDep) -> dict[str, Any]:
    """Every registered model: parameters, VRAM declared and observed, timeout, outputs."""
    models = []
    for spec in services.models.models.values():
        entry = spec.public()
        if services.learner is not None:
            entry["vram_learning"] = await services.learner.report(spec)
        models.append(entry)
    return {"models": models}
