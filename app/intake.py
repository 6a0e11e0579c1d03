"""Intake: validate a submission, check its image, queue the job. The API's one call for POST /jobs."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

from app import errors, images, learning, registry
from app.queue import manager as manager_
from app.queue.jobs import Job


@dataclass(frozen=True, slots=True)
class Limits:
    """What a submission may be."""

    max_upload_bytes: int
    max_pixels: int
    queue_limit: int
    priority_min: int
    priority_max: int
    queue_limit_per_key: int = 0  # 0: no limit per principal


def parse_params(raw: str | None) -> dict[str, Any]:
    """The `params` form field: a JSON object, or nothing."""
    if raw is None or raw.strip() == "":
        return {}
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise errors.InvalidParams(
            f"params: not valid JSON ({exc.msg} at {exc.pos})", field="params"
        ) from exc
    if not isinstance(value, dict):
        raise errors.InvalidParams('params: must be a JSON object such as {"width_mm": 80}', field="params")
    return value


def check_priority(priority: int, limits: Limits) -> int:
    """Priority within the configured bounds."""
    if not limits.priority_min <= priority <= limits.priority_max:
        raise errors.InvalidRequest(
            f"priority: must be between {limits.priority_min} and {limits.priority_max}", field="priority"
        )
    return priority


async def submit(
    manager: manager_.JobManager,
    models: registry.Registry,
    *,
    owner: str,
    model: str,
    priority: int,
    params: Mapping[str, Any],
    image: BinaryIO,
    idempotency_key: str | None,
    limits: Limits,
    learner: learning.VramLearner | None = None,
    gate: asyncio.Semaphore | None = None,
) -> tuple[Job, bool]:
    """Check everything, store the image, queue the job; (job, created). Nothing is stored on error.

    `gate`, if given, is held while the job is written to the database.
    """
    spec = models.get(model)
    values = spec.validate_params(params)
    check_priority(priority, limits)
    # One hop to a thread to read, check and hash the bytes (zlib and hashlib release the GIL).
    checked = await asyncio.to_thread(_read_and_inspect, image, limits)
    declared = spec.estimate_vram_mb(checked.megapixels)
    vram_mb = declared if learner is None else (await learner.estimate(spec, checked.megapixels))[0]
    new = manager_.NewJob(
        owner=owner,
        model=spec.name,
        params=values,
        priority=priority,
        vram_mb=vram_mb,
        declared_vram_mb=declared,
        max_attempts=spec.max_attempts,
        idempotency_key=idempotency_key,
    )
    async with gate or contextlib.nullcontext():
        return await manager.enqueue(
            new, checked, queue_limit=limits.queue_limit, owner_limit=limits.queue_limit_per_key
        )


def _read_and_inspect(image: BinaryIO, limits: Limits) -> manager_.NewInput:
    return images.inspect(images.read_upload(image, limits.max_upload_bytes), max_pixels=limits.max_pixels)
