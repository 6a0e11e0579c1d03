"""A claim's statement as the queue sends it and reads it back: CLAIM's (and SUCCEED's) parameters,
and the claimed jobs in its rows."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence, Set
from typing import Any

from app.queue.jobs import Claimed, Job, vram_class


def parameters(
    models: Sequence[str] | Mapping[str, float],
    budgets: Mapping[int, int],
    gpu_ids: list[int],
    limit: int,
    *,
    slots: Mapping[int, int] | None,
    ahead: Mapping[int, int] | None,
    warm: Set[tuple[str, int | None]],
    min_priority: int,
) -> dict[str, Any]:
    """CLAIM's parameters for the GPUs `gpu_ids` of `budgets` (JobManager.claim says what each
    argument means), but the worker's and its lease's."""
    limits = dict(models) if isinstance(models, Mapping) else dict.fromkeys(models, math.inf)
    budget = max(budgets[g] for g in gpu_ids)
    offered, waits = offers(gpu_ids, limit, slots, ahead)
    return {
        "models": list(limits),
        "max_megapixels": list(limits.values()),
        "warm_mb": [  # per model: the most free MB of a GPU where it has a warm runner
            max((budgets[g] for m, g in warm if m == model and g in gpu_ids), default=0) for model in limits
        ],
        "warm_pairs": sorted(f"{model}:{gpu}" for model, gpu in warm),
        "min_priority": min_priority,
        "max_class": vram_class(budget),
        "budget": budget,
        "limit": limit,
        "gpu_ids": gpu_ids,
        "gpu_budgets": [budgets[g] for g in gpu_ids],
        "gpu_slots": offered,
        "gpu_waits": waits,
    }


def success_values(items: Sequence[tuple[Job, str, str]]) -> dict[str, Any]:
    """SUCCEED's parameters for (job, results JSON, detail JSON) items: parallel arrays."""
    return {
        "ids": [job.id for job, _, _ in items],
        "attempts": [job.attempt for job, _, _ in items],
        "results": [results for _, results, _ in items],
        "details": [detail for _, _, detail in items],
    }


def offers(
    gpu_ids: Sequence[int], limit: int, slots: Mapping[int, int] | None, ahead: Mapping[int, int] | None
) -> tuple[list[int], list[int]]:
    """Per GPU of a claim: the jobs it may take (its slots, at most `limit`), and of those the ones
    past its slots free now (its slots less `ahead`), which wait for a running job to end."""
    if slots is None:
        return [limit] * len(gpu_ids), [0] * len(gpu_ids)
    offered = [min(limit, slots[g]) for g in gpu_ids]
    ahead = ahead or {}
    return offered, [max(0, n - (slots[g] - ahead.get(g, 0))) for g, n in zip(gpu_ids, offered, strict=True)]


def claimed(rows: Iterable[Any]) -> list[Claimed]:
    """Claimed jobs from CLAIM's rows, with their input images."""
    return [
        Claimed(
            Job.from_row(row),
            None if row["input_data"] is None else (str(row["input_media_type"]), bytes(row["input_data"])),
        )
        for row in rows
    ]
