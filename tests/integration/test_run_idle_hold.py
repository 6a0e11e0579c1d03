"""A persistent model's idle_vram_mb = 0 (a runner that keeps nothing on the GPU between jobs,
a CPU model say) holds 0 MB while idle, not its vram.base_mb."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.queue.jobs import JobState
from tests.conftest import warm_model
from tests.integration.test_durability import running, until
from tests.integration.test_worker import enqueue


@pytest.fixture
def models_file(models_file: Path, tmp_path: Path) -> Path:
    """The test models and `warm_free`: base_mb 1000, idle_vram_mb 0."""
    with models_file.open("a") as f:
        f.write(warm_model("warm_free", tmp_path / "loads-warm_free.txt", idle_vram_mb=0))
    return models_file


@pytest.mark.asyncio
async def test_an_idle_runner_declared_to_hold_nothing_holds_nothing(manager, make_worker) -> None:
    job_id = await enqueue(manager, model="warm_free")
    async with running(make_worker(burst=False)) as worker:
        job = await until(manager, job_id, lambda j: j.state.final)
        assert job.state is JobState.succeeded, job.error
        [row] = worker.pool.report(0)
        assert row["state"] == "idle" and row["vram_mb"] == 0, row
        assert worker.pool.reserved_mb(0) == 0
