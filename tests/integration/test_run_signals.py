"""A model killed by a signal Python has no name for (a real-time one, SIGRTMIN+6 say) fails its
attempt as killed by that signal, like any other: not as an internal error of the worker."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.queue.jobs import JobState
from tests.conftest import script_model, toy_model
from tests.integration.test_worker import enqueue

SUICIDE = "import os, signal; os.kill(os.getpid(), signal.SIGRTMIN + 6)"


@pytest.fixture
def models_file(tmp_path: Path) -> Path:
    """`toy`, and `rt`, which kills itself with SIGRTMIN+6."""
    path = tmp_path / "models.toml"
    path.write_text(toy_model("toy") + script_model("rt", ["{python}", "-c", SUICIDE]))
    return path


@pytest.mark.asyncio
async def test_a_model_killed_by_a_signal_without_a_name_fails_as_killed(manager, make_worker) -> None:
    job_id = await enqueue(manager, model="rt", max_attempts=1)
    await make_worker().run()
    job = await manager.get(job_id)
    assert job.state is JobState.failed, (job.state, job.error)
    assert (job.error or "").startswith("killed by SIGRTMIN+6"), job.error
    assert job.abnormal_runs == 1  # a signal nobody sent it, as a segfault is
