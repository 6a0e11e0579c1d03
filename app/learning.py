"""Learned VRAM: admit jobs on what their model was seen to use, not only on what it declared.

Workers record each run's peak GPU memory (NVML, per process group). Once a model has
`min_samples` recorded peaks, a new job is admitted on a high percentile of observed ÷ declared,
times its own declared estimate (so input size still scales it), plus a margin, and never above
the declared figure (or the declared maximum) unless the operator allows it; then never above the
largest GPU its workers have reported, less the buffer. A job whose estimate is still above that
(its declared one, for a large input) could never be claimed: intake refuses it (`offered_mb`,
`largest_megapixels`). Without NVML no peaks are recorded and the declared estimate is used as is.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from app import registry, scheduler
from app.queue import manager as manager_


@dataclass(frozen=True, slots=True)
class LearningConfig:
    """How learned estimates are made (Settings: learned_vram_*)."""

    min_samples: int = 20
    percentile: float = 95.0
    margin_mb: int = 256
    above_declared: bool = False
    buffer_mb: int = 512  # the workers' vram_buffer_mb: what a GPU never hands out
    ttl_s: float = 30.0


class VramLearner:
    """Per-model observed peaks, read from the database and cached for `ttl_s`."""

    def __init__(self, manager: manager_.JobManager, config: LearningConfig) -> None:
        self._manager = manager
        self._config = config
        self._ratios: dict[str, tuple[list[float], int]] = {}
        self._offered: dict[str, int] = {}  # per model: the most a GPU of its workers gives one job
        self._read_at = -float("inf")

    async def _observed(self) -> dict[str, tuple[list[float], int]]:
        if time.monotonic() - self._read_at > self._config.ttl_s:
            self._ratios = await self._manager.reports.vram_ratios()
            self._offered = await self._manager.reports.largest_gpus(buffer_mb=self._config.buffer_mb)
            self._read_at = time.monotonic()
        return self._ratios

    async def estimate(self, spec: registry.ModelSpec, megapixels: float) -> tuple[int, int]:
        """(MB to admit the job on, the declared estimate)."""
        await self._observed()
        declared = spec.estimate_vram_mb(megapixels)
        return self._admitted(spec, declared), declared

    async def offered_mb(self, model: str) -> int | None:
        """The most a job of `model` may be admitted on and still be claimed: what the largest GPU
        its workers reported in the last day offers, each worker by its own buffer (the claim takes
        a job of at most that). None with no such worker. From the cache: no query of its own."""
        await self._observed()
        return self._offered.get(model)

    def largest_megapixels(self, spec: registry.ModelSpec, offered_mb: int, below: float) -> float | None:
        """The most megapixels, under `below`, whose estimate is at most `offered_mb`, rounded down
        to 0.01 MP; None where not even an empty image's is. Read off the cache `estimate` used, by
        halving: the estimate grows with the megapixels, learned or not."""

        def fits(megapixels: float) -> bool:
            return self._admitted(spec, spec.estimate_vram_mb(megapixels)) <= offered_mb

        if not fits(0.0):
            return None
        low, high = 0.0, below
        for _ in range(40):
            middle = (low + high) / 2
            low, high = (middle, high) if fits(middle) else (low, middle)
        return math.floor(low * 100) / 100

    def _admitted(self, spec: registry.ModelSpec, declared: int) -> int:
        """The MB a job declared at `declared` is admitted on, from the cached observations."""
        ratios, _ = self._ratios.get(spec.name, ([], 0))
        # Above the declared estimate only up to what the largest GPU the model's workers have
        # reported lately can give (less the buffer), so that some GPU can take the job; with none
        # known (its workers away for a day), not above it at all. By default, not above the
        # model's declared maximum either.
        offered = self._offered.get(spec.name)
        cap = declared if offered is None else max(declared, offered)
        if not self._config.above_declared:
            cap = min(cap, spec.max_vram_mb or declared)
        return scheduler.learned_vram_mb(
            declared,
            ratios,
            percentile=self._config.percentile,
            margin_mb=self._config.margin_mb,
            min_samples=self._config.min_samples,
            cap_mb=cap,
        )

    async def report(self, spec: registry.ModelSpec) -> dict[str, Any]:
        """Declared versus observed for GET /models: samples, largest peak, the ratio admitted on."""
        ratios, max_peak = (await self._observed()).get(spec.name, ([], 0))
        learned_ratio = None
        if len(ratios) >= self._config.min_samples:
            probe = 1000  # the ratio the percentile gives, read off a 1000 MB declaration
            learned_ratio = (
                scheduler.learned_vram_mb(
                    probe,
                    ratios,
                    percentile=self._config.percentile,
                    margin_mb=0,
                    min_samples=self._config.min_samples,
                    cap_mb=None,
                )
                / probe
            )
        return {
            "declared": {
                "base_mb": spec.base_mb,
                "mb_per_megapixel": spec.mb_per_megapixel,
                "max_mb": spec.max_vram_mb,
            },
            "observed": {
                "samples": len(ratios),
                "max_peak_mb": max_peak or None,
                "peak_to_declared_p": self._config.percentile,
                "ratio": learned_ratio,
            },
            "admits_on": "learned" if learned_ratio is not None else "declared",
        }
