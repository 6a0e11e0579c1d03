"""The worker: claims by priority and VRAM fit, runs real subprocesses, stores results."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

from app import images
from app.queue.jobs import JobState
from app.queue.manager import JobManager, NewJob
from tests.conftest import png_bytes


async def enqueue(manager: JobManager, *, model: str = "toy", priority: int = 0, vram_mb: int = 1000,
                  max_attempts: int = 3, image: bytes | None = None, **params: Any) -> uuid.UUID:
    """Queue a job directly through the manager (the API is tested elsewhere)."""
    checked = images.inspect(image or png_bytes(), max_pixels=10**8)
    spec_defaults = {"sleep": 0.0, "steps": 2, "exit_code": 0, "fail_attempts": 0, "signal": "none",
                     "output": True, "trace": "none"}
    job, _ = await manager.enqueue(
        NewJob("tester", model, {**spec_defaults, **params} if model == "toy" else params, priority, vram_mb,
               max_attempts),
        checked,
        queue_limit=100_000,
    )
    return job.id


def trace(path: Path) -> list[dict[str, Any]]:
    """Runs recorded by the toy model, in the order they ended."""
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


async def test_toy_job_runs_and_its_result_is_stored(manager, make_worker, store):
    job_id = await enqueue(manager, steps=4)
    worker = make_worker()
    await worker.run()
    job = await manager.get(job_id)
    assert job.state is JobState.succeeded, job.error
    assert job.attempt == 1 and job.progress == 1
    [result] = job.results
    path, media_type, _ = store.resolve(job, "out.txt")
    assert path.read_text() == f"done {job_id}:1\n" and media_type == "text/plain"
    assert result.bytes == path.stat().st_size
    log = store.log_path(job_id, 1).read_text()
    assert "toy model stderr line" in log and "PROGRESS" in log
    kinds = [e.kind for e in await manager.events(job_id)]
    assert kinds[:3] == ["submitted", "claimed", "started"]
    assert "progress" in kinds and kinds[-1] == "succeeded"
    assert not any((store.root / "scratch").iterdir())  # scratch cleaned
