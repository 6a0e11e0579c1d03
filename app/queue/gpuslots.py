"""The slots of a worker's GPUs under max_jobs_per_gpu, and the jobs it claims ahead of them: the
next jobs of models whose runs are short wait on hand for a slot, not a claim's round trip later."""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from collections.abc import Sequence

from app import scheduler
from app.queue import planner as planner_

# The weight of a model's latest run in the moving average of its runs' length (claim ahead).
RUN_S_WEIGHT = 0.2


class GpuSlots:
    """One worker's GPU slots (none without a cap) and its models' recent run lengths."""

    def __init__(self, max_jobs_per_gpu: int, claim_ahead_s: float) -> None:
        self._cap = max_jobs_per_gpu
        self._claim_ahead_s = claim_ahead_s  # models whose runs take less get jobs claimed ahead
        # Slots on each GPU under max_jobs_per_gpu: a job claimed ahead waits here for one.
        self._slots: dict[int, asyncio.Semaphore] = {}
        self._run_s: dict[str, float] = {}  # model -> its recent runs' length (moving average)

    def slot(self, gpu_index: int | None) -> asyncio.Semaphore | None:
        """The slots of a GPU under max_jobs_per_gpu (None: no cap, so nothing is claimed ahead)."""
        if not self._cap or gpu_index is None:
            return None
        if gpu_index not in self._slots:
            self._slots[gpu_index] = asyncio.Semaphore(self._cap)
        return self._slots[gpu_index]

    def ran(self, model: str, took_s: float) -> None:
        """A run of `model` took `took_s` (from its model's start to its end)."""
        self._run_s[model] = scheduler.moving_average(self._run_s.get(model), took_s, weight=RUN_S_WEIGHT)

    def ahead(self, in_hand: Sequence[planner_.InHand]) -> dict[int, int]:
        """Jobs each GPU may hold beyond its cap: one for each job in hand there (running, or
        about to) whose model's recent runs were shorter than claim_ahead_s, at most the cap. So
        the next jobs are on hand when those end, instead of a claim's round trip later."""
        cap, limit = self._cap, self._claim_ahead_s
        if not cap or not limit:
            return {}
        ahead: Counter[int] = Counter()
        for a in in_hand:
            if self._run_s.get(a.job.model, math.inf) < limit:
                ahead[a.gpu] += 1
        return {g: min(n, cap) for g, n in ahead.items()}
