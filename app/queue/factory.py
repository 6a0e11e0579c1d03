"""Workers built from Settings: for `gpujobs serve` (beside the API) and `gpujobs worker`.

Kept apart from the web layer so a worker process starts without importing it.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable, Coroutine
from typing import Any

from app import gpu, registry, retention, storage
from app.queue import manager as manager_
from app.queue import planner as planner_
from app.queue import worker as worker_
from app.queue import workerconfig
from app.settings import Settings


def build_worker(
    settings: Settings,
    *,
    manager: manager_.JobManager,
    store: storage.ResultStore,
    models: registry.Registry,
    listen_dsn: str | None,
    burst: bool = False,
) -> worker_.Worker:
    """A worker configured from settings (used by `serve` and `gpujobs worker`)."""
    config = workerconfig.WorkerConfig(
        **_same_names(workerconfig.WorkerConfig, settings),
        scheduling=planner_.PlannerConfig(**_same_names(planner_.PlannerConfig, settings)),
        python=sys.executable,
        burst=burst,
    )
    # The GPUs it may use, as for any CUDA program: CUDA_VISIBLE_DEVICES (one worker per group).
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    inventory = gpu.detect_inventory(settings.gpus, settings.virtual_gpu_mb, visible=visible)
    return worker_.Worker(
        manager=manager,
        store=store,
        models=models,
        inventory=inventory,
        config=config,
        listen_dsn=listen_dsn,
        side_tasks=retention_task(settings, manager),
    )


def _same_names(config: type[Any], settings: Settings) -> dict[str, Any]:
    """The settings a config dataclass takes: its fields that Settings has under the same name."""
    return {
        f.name: getattr(settings, f.name) for f in dataclasses.fields(config) if hasattr(settings, f.name)
    }


def retention_task(
    settings: Settings, manager: manager_.JobManager
) -> dict[str, Callable[[], Coroutine[Any, Any, None]]]:
    """The worker's periodic retention run (none when retention_days is 0); one worker at a time prunes."""
    if settings.retention_days <= 0:
        return {}
    pruner = retention.Pruner(manager, settings.storage_dir)
    older_than_s = settings.retention_days * 86_400
    return {
        "retention": lambda: pruner.run_forever(
            older_than_s=older_than_s, interval_s=settings.retention_interval_s
        )
    }
