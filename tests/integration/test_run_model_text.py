"""What a model says lands in the job row even when PostgreSQL cannot store it as said: a NUL
character (in a failing run's log, in a warm runner's error or progress) is written as U+FFFD."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from app.queue.jobs import JobState
from tests.conftest import HERE, script_model, toy_model
from tests.integration.test_worker import enqueue

ONESHOT = "import sys; sys.stderr.buffer.write(b'bad \\x00 byte\\n'); sys.exit(1)"
RUNNER = """\
from app import modelkit

def handle(model, job):
    job.progress(0.5, "half \\x00 way")
    raise ValueError("no \\x00 good")

modelkit.serve(lambda: None, handle, name="nul_warm")
"""


@pytest.fixture
def models_file(tmp_path: Path) -> Path:
    """`toy`, `nul` (prints a NUL on stderr and exits 1) and `nul_warm` (a kit runner whose job
    reports progress and fails, both with a NUL in their text)."""
    runner = tmp_path / "nul_warm.py"
    runner.write_text(RUNNER)
    path = tmp_path / "models.toml"
    path.write_text(
        toy_model("toy")
        + script_model("nul", ["{python}", "-c", ONESHOT])
        + f"""
[models.nul_warm]
mode = "persistent"
argv = ["{{python}}", "-c", "pass"]
serve_argv = {json.dumps(["{python}", str(runner)])}
vram = {{ base_mb = 1000 }}
timeout_s = 10
max_attempts = 1
[[models.nul_warm.outputs]]
name = "out.txt"
"""
    )
    return path


@pytest.mark.asyncio
@pytest.mark.parametrize("model", ["nul", "nul_warm"])
async def test_a_nul_in_what_the_model_says_fails_the_job_with_its_words(
    manager, make_worker, model, monkeypatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(HERE.parent))  # the runner imports app.modelkit
    job_id = await enqueue(manager, model=model, max_attempts=1)
    await asyncio.wait_for(make_worker().run(), 30)
    job = await manager.get(job_id)
    assert job.state is JobState.failed, (job.state, job.error)
    words = "bad \ufffd byte" if model == "nul" else "no \ufffd good"
    assert words in (job.error or ""), job.error
    if model == "nul_warm":
        assert job.progress_message == "half \ufffd way"
