"""What every attempt of one worker shares (app/queue/attempt.py): the worker's settings an attempt
reads, and its site, through which an attempt tells the worker of its model's end and of storage
trouble."""

from __future__ import annotations

from collections.abc import Callable, Set
from dataclasses import dataclass
from typing import TYPE_CHECKING

from app import gpu, storage, warmpool
from app.queue import manager as manager_

if TYPE_CHECKING:
    from app.queue.attempt import Attempt


@dataclass(frozen=True, slots=True)
class AttemptConfig:
    """The worker settings an attempt needs."""

    worker_id: str
    kill_grace_s: float
    retry_base_s: float
    retry_max_s: float
    python: str
    oom_max_retries: int = 2
    oom_growth: float = 1.5
    sample_interval_s: float = 0.5  # how often the model's GPU memory is read (NVML)
    max_log_bytes: int = 0  # the cap on the attempt's log (0: none)
    database: str = ""  # the database's identity, marked on its runs (leftovers.QUEUE); set at start


@dataclass(frozen=True, slots=True)
class Site:
    """What every attempt of one worker shares, and how an attempt tells the worker of its model's
    end and of storage trouble; `live_runs`: the worker's runs still going, as `run <id>:<attempt>`."""

    manager: manager_.JobManager
    store: storage.ResultStore
    config: AttemptConfig
    inventory: gpu.GpuInventory | None = None
    pool: warmpool.WarmPool | None = None  # warm runners, for persistent models
    on_model_end: Callable[[Attempt], None] | None = None
    on_storage_trouble: Callable[[Attempt], None] | None = None
    live_runs: Callable[[], Set[str]] = frozenset
