"""A worker's GPU accounting: NVML's last reading of its GPUs, what each offers one job, what the
worker holds on each, and whether any of its models fits one at all."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from app import errors, gpu, registry, warmpool
from app.queue import planner as planner_

log = logging.getLogger("gpujobs.worker")


class GpuBook:
    """The GPUs of one worker as its heartbeat reports them and its attempts read them."""

    def __init__(
        self,
        inventory: gpu.GpuInventory,
        planner: planner_.Planner,
        pool: warmpool.WarmPool,
        buffer_mb: int,
    ) -> None:
        self._inventory = inventory
        self._planner = planner
        self._pool = pool
        self._buffer_mb = buffer_mb
        self._gpus: list[gpu.Gpu] = []  # the last reading of the GPUs that NVML answered

    def first_reading(self) -> list[gpu.Gpu]:
        """The reading at the worker's start, NVML's errors raised: without it the worker cannot start."""
        self._gpus = self._inventory.snapshot()
        return self._gpus

    def report(
        self, in_hand: Sequence[planner_.InHand], gpus: list[gpu.Gpu] | None = None
    ) -> list[dict[str, Any]]:
        """The GPU snapshot stored on each heartbeat: NVML's reading, the most one job may be given
        there (its size less this worker's buffer: what the API's intake holds uploads to), what
        this worker reserved (`in_hand`: the jobs whose model still runs), and its warm runners on
        each GPU (WarmPool.report, starts_on)."""
        reserved: Counter[int] = Counter()
        count: Counter[int] = Counter()
        for a in in_hand:
            reserved[a.gpu] += a.job.vram_mb
            count[a.gpu] += 1
        return [
            {
                **asdict(g),
                "offered_mb": self.offered_mb(g),
                "reserved_mb": reserved[g.index] + self._pool.reserved_mb(g.index),
                "running_jobs": count[g.index],
                "warm": self._pool.report(g.index),
                "warm_starts": self._pool.starts_on(g.index),
            }
            for g in (self.read() if gpus is None else gpus)
        ]

    def read(self) -> list[gpu.Gpu]:
        """A fresh reading of the GPUs or, while NVML fails (a driver hiccup), the last one it
        gave: what the heartbeat reports and a claimed job's growth cap read, so that an NVML
        error stops neither the leases' renewal nor a claimed job's start (claims themselves
        pause meanwhile: Planner.claim)."""
        try:
            self._gpus = self._inventory.snapshot()
        except errors.AppError as exc:
            self._planner.gpus_unreadable(exc)  # logged once per outage, for the claims too
        else:
            self._planner.gpus_readable()
        return self._gpus

    def capacity_mb(self) -> int:
        """The most a job may use here: the largest GPU's size less the buffer. Not the size of the
        GPU a job ran on: placed on the smallest that fits, a job out of memory there grows onto
        a larger one."""
        return max((self.offered_mb(g) for g in self.read()), default=0)

    def offered_mb(self, g: gpu.Gpu) -> int:
        """The most one job may be given on `g`: its size less this worker's buffer."""
        return max(0, g.total_mb - self._buffer_mb)

    def check_fit(self, gpus: list[gpu.Gpu], models: registry.Registry, *, worker_id: str) -> None:
        """Refuse to start when no model fits any GPU here (even for the smallest input); else name,
        in one warning, the models that fit none: their jobs wait for another worker, and this one
        would never say why."""
        buffer_mb = self._buffer_mb
        total = max((g.total_mb for g in gpus), default=0)
        offered = total - buffer_mb
        needs = models.smallest_needs_mb()
        large = [f"{name} ({mb} MB)" for name, mb in sorted(needs.items()) if mb > offered]
        if needs and len(large) == len(needs):
            sizes = ", ".join(f"GPU {g.index}: {g.total_mb} MB" for g in gpus) or "no GPUs"
            offers = (
                f"the largest GPU offers {offered} MB after the {buffer_mb} MB buffer"
                if total > buffer_mb
                else f"GPUJOBS_VRAM_BUFFER_MB ({buffer_mb} MB) leaves nothing of the largest GPU ({total} MB)"
            )
            raise errors.ConfigError(
                f"no GPU can ever run a job: the smallest model needs {models.smallest_vram_mb()} MB,"
                f" {offers} ({sizes})"
            )
        if large:
            log.warning(
                "models this worker never runs: their declared VRAM is more than its largest GPU "
                "offers (%d MB after the buffer): %s",
                offered,
                ", ".join(large),
                extra={"action": "models_too_large", "worker": worker_id},
            )
