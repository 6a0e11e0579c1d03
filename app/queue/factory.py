"""Workers built from Settings: for `gpujobs serve` (beside the API) and `gpujobs worker`.

Kept apart from the web layer so a worker process starts without importing it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Coroutine
from typing import Any

from app import gpu, registry, retention, storage
from app.queue import manager as manager_
from app.queue import worker as worker_
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
    config = worker_.WorkerConfig(
        worker_id=settings.worker_id,
        lease_s=settings.lease_s,
        heartbeat_interval_s=settings.heartbeat_interval_s,
        poll_interval_s=settings.poll_interval_s,
        reap_interval_s=settings.reap_interval_s,
        vram_buffer_mb=settings.vram_buffer_mb,
        max_jobs_per_gpu=settings.max_jobs_per_gpu,
        kill_grace_s=settings.kill_grace_s,
        shutdown_grace_s=settings.shutdown_grace_s,
        retry_base_s=settings.retry_base_s,
        retry_max_s=settings.retry_max_s,
        age_step_s=settings.age_step_s,
        age_max_boost=settings.age_max_boost,
        reserve_after_s=settings.reserve_after_s,
        backfill_min_samples=settings.backfill_min_samples,
        gpu_settle_timeout_s=settings.gpu_settle_timeout_s,
        oom_max_retries=settings.oom_max_retries,
        oom_growth=settings.oom_growth,
        warm_idle_s=settings.warm_idle_s,
        warm_streak_max=settings.warm_streak_max,
        claim_batch=settings.claim_batch,
        python=sys.executable,
        burst=burst,
    )
    inventory = gpu.detect_inventory(settings.gpus, settings.virtual_gpu_mb)
    return worker_.Worker(
        manager=manager,
        store=store,
        models=models,
        inventory=inventory,
        config=config,
        listen_dsn=listen_dsn,
        side_tasks=retention_task(settings, manager),
    )


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
