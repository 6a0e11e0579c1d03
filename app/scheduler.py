"""Scheduling policy: reservations for starved big jobs, backfill, aging, learned VRAM, OOM growth.

Pure functions over plain values, with time passed in, so the worker drives them with the real
clock and the scheduling simulator (tests/bench/simulate.py) with a simulated one.

    priority order ──► best fitting job is claimed ──► GPU with the tightest fit
          │
          └─ top job fits no GPU now, waited > reserve_after_s ──► reservation on the GPU that frees
             room for it soonest (running jobs' expected ends). While it holds, that GPU takes only
               · jobs that outrank the reserved one (effective priority), or
               · backfill: jobs expected to end before the reserved job could start.
             GPUs too small for the reserved job are never held back.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class GpuRoom:
    """One GPU as the scheduler sees it: what it can ever give, and what it can give now (MB)."""

    index: int
    capacity_mb: int
    available_mb: int


@dataclass(frozen=True, slots=True)
class Running:
    """A job running on a GPU, and when it is expected to end (seconds, caller's clock)."""

    gpu: int
    vram_mb: int
    expected_end_s: float


@dataclass(frozen=True, slots=True)
class Waiting:
    """The best queued job that fits no GPU now."""

    job_id: object
    vram_mb: int
    effective_priority: int
    waited_s: float


@dataclass(frozen=True, slots=True)
class Reservation:
    """A GPU held for a waiting job until it starts; `start_s` is when it should fit."""

    job_id: object
    gpu: int
    vram_mb: int
    effective_priority: int
    start_s: float


def moving_average(before: float | None, sample: float, *, weight: float) -> float:
    """An exponential moving average with `sample` folded in (`weight` on the newest); the first
    sample stands alone."""
    return sample if before is None else before + weight * (sample - before)


def age_boost(waited_s: float, *, step_s: float, max_boost: int) -> int:
    """Priority added by waiting: one per `step_s`, at most `max_boost` (Slurm's age factor)."""
    if step_s <= 0 or waited_s <= 0:
        return 0
    return min(max_boost, int(waited_s // step_s))


def room_at(gpu: GpuRoom, running: Sequence[Running], need_mb: int, now_s: float) -> float | None:
    """When `need_mb` should be free on `gpu` if its jobs end as expected; None if it never fits."""
    if need_mb > gpu.capacity_mb:
        return None
    free = gpu.available_mb
    if free >= need_mb:
        return now_s
    for job in sorted((r for r in running if r.gpu == gpu.index), key=lambda r: r.expected_end_s):
        free += job.vram_mb
        if free >= need_mb:
            return max(now_s, job.expected_end_s)
    return None  # room taken by something outside the service: no sure time


def reserve(
    waiting: Waiting, gpus: Sequence[GpuRoom], running: Sequence[Running], now_s: float, *, after_s: float
) -> Reservation | None:
    """A reservation for `waiting` if it has waited long enough: on the GPU that frees room soonest."""
    if waiting.waited_s < after_s:
        return None
    options = [(t, g.index) for g in gpus if (t := room_at(g, running, waiting.vram_mb, now_s)) is not None]
    if not options:
        return None
    start_s, index = min(options)
    return Reservation(waiting.job_id, index, waiting.vram_mb, waiting.effective_priority, start_s)


def split_budgets(
    budgets: Mapping[int, int], reservation: Reservation | None
) -> tuple[dict[int, int], dict[int, int]]:
    """(open budgets, the held GPU's budget). A held GPU that already fits its job is open again."""
    if reservation is None or reservation.gpu not in budgets:
        return dict(budgets), {}
    held = budgets[reservation.gpu]
    if held >= reservation.vram_mb:
        return dict(budgets), {}
    open_ = {i: b for i, b in budgets.items() if i != reservation.gpu}
    return open_, {reservation.gpu: held}


@dataclass(frozen=True, slots=True)
class RunTime:
    """Expected run time of a model: intercept + slope * megapixels, from finished jobs."""

    intercept_s: float
    per_megapixel_s: float
    samples: int

    def expected_s(self, megapixels: float, *, margin: float = 1.25) -> float:
        """A cautious estimate (with `margin`) for an input of this size."""
        return max(0.0, self.intercept_s + self.per_megapixel_s * megapixels) * margin

    def max_megapixels(self, window_s: float, *, margin: float = 1.25) -> float:
        """The largest input expected to finish within `window_s` (0 if none, inf if any)."""
        budget = window_s / margin - self.intercept_s
        if budget < 0:
            return 0.0
        if self.per_megapixel_s <= 0:
            return math.inf
        return budget / self.per_megapixel_s


def backfill_limits(
    estimates: Mapping[str, RunTime], models: Sequence[str], window_s: float, *, min_samples: int
) -> dict[str, float]:
    """Per model, the largest input that may start on a held GPU; models without enough history
    are left out (an unknown run time could delay the reserved job)."""
    limits = {}
    for model in models:
        estimate = estimates.get(model)
        if estimate is not None and estimate.samples >= min_samples:
            limit = estimate.max_megapixels(window_s)
            if limit > 0:
                limits[model] = limit
    return limits


def learned_vram_mb(
    declared_mb: int,
    observed_ratios: Sequence[float],
    *,
    percentile: float,
    margin_mb: int,
    min_samples: int,
    cap_mb: int | None,
) -> int:
    """Admit on a high percentile of observed/declared peaks plus a margin, once there are enough.

    `observed_ratios` are peak ÷ declared estimate of past jobs of the model, so the declared
    formula keeps scaling with input size. Never above `cap_mb` (None: no cap).
    """
    if len(observed_ratios) < min_samples:
        return declared_mb
    ordered = sorted(observed_ratios)
    rank = min(len(ordered) - 1, max(0, math.ceil(percentile / 100 * len(ordered)) - 1))
    learned = math.ceil(declared_mb * ordered[rank]) + margin_mb
    return learned if cap_mb is None else min(learned, cap_mb)


def after_oom_mb(vram_mb: int, peak_mb: int | None, *, growth: float, capacity_mb: int) -> int:
    """A larger estimate after an out-of-memory failure: grown, at least the observed peak, at most
    `capacity_mb` (capped before rounding: a huge growth is a float too large for an integer)."""
    grown = max(math.ceil(min(vram_mb * growth, capacity_mb)), (peak_mb or 0) + 1)
    return min(grown, capacity_mb)
