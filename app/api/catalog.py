"""The model catalog: which models can run, and their parameters."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from app.api.deps import ServicesDep

router = APIRouter(tags=["models"])


@router.get("/models")
async def list_models(services: ServicesDep) -> dict[str, Any]:
    """Every registered model with its parameters, VRAM estimate, timeout and outputs."""
    return {"models": [spec.public() for spec in services.models.models.values()]}
