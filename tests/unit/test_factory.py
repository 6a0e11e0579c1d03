"""build_worker: every worker and scheduling setting reaches the worker it builds."""

from __future__ import annotations

import sys
from pathlib import Path

from app import db, modelsfile, storage
from app.queue import factory
from app.queue.manager import JobManager
from app.queue.worker import Worker
from app.settings import Settings
from tests.conftest import modules_loaded_by
from tests.unit.test_gpu import GIB, fake_pynvml


async def built(settings: Settings) -> Worker:
    """The worker `build_worker` makes of `settings` (its database never connected to)."""
    engine = db.create_engine(settings.database_url or "")
    worker = factory.build_worker(
        settings,
        manager=JobManager(engine),
        store=storage.ResultStore(settings.storage_dir),
        models=modelsfile.load_registry(settings.models_file),
        listen_dsn=None,
        burst=True,
    )
    await engine.dispose()
    return worker


async def test_settings_reach_the_worker_and_its_planner(models_file: Path, tmp_path: Path):
    settings = Settings(
        database_url="postgresql+asyncpg://nobody@127.0.0.1:1/none",  # never connected to
        models_file=models_file,
        storage_dir=tmp_path / "storage",
        gpus="24GiB",
        worker_name="w7",
        lease_s=7,
        kill_grace_s=3,
        max_log_mb=2,
        warm_idle_s=11,
        vram_buffer_mb=100,
        max_jobs_per_gpu=2,
        claim_batch=3,
        gpu_settle_timeout_s=9,
        reserve_after_s=13,
    )
    worker = await built(settings)
    config = worker._config
    assert (config.worker_id, config.lease_s, config.kill_grace_s, config.warm_idle_s) == (
        settings.worker_id,
        7,
        3,
        11,
    )
    assert config.burst and config.python == sys.executable
    assert config.max_log_bytes == 2 * 1024 * 1024
    assert worker.pool._max_log_bytes == config.max_log_bytes
    scheduling = config.scheduling
    assert (scheduling.vram_buffer_mb, scheduling.max_jobs_per_gpu, scheduling.claim_batch) == (100, 2, 3)
    assert (scheduling.gpu_settle_timeout_s, scheduling.reserve_after_s) == (9, 13)


async def test_a_worker_uses_the_gpus_its_cuda_visible_devices_names(
    models_file: Path, tmp_path: Path, monkeypatch
):
    """`gpujobs worker` started with CUDA_VISIBLE_DEVICES=1 (one worker per group of GPUs) used
    both of the host's GPUs."""
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml([("NVIDIA L4", 24 * GIB, 24 * GIB)] * 2))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    settings = Settings(
        database_url="postgresql+asyncpg://nobody@127.0.0.1:1/none",  # never connected to
        models_file=models_file,
        storage_dir=tmp_path / "storage",
    )
    assert [g.index for g in (await built(settings))._inventory.snapshot()] == [1]


def test_a_worker_process_builds_no_orm_classes():
    """The ORM classes (app.tables) serve the API's reads only; building them cost every worker's
    start about 0.12 s of CPU. Nor does a worker load the web layer or Alembic."""
    loaded = modules_loaded_by("app.queue.factory")
    assert {"app.queue.worker", "app.queue.manager", "app.retention"} <= loaded
    assert not {"app.tables", "fastapi", "starlette", "alembic"} & loaded
