"""What a model says lands in the job row even when PostgreSQL cannot store it as said: a NUL
character (in a failing run's log, in a warm runner's error or progress) is written as U+FFFD. A
progress message is kept to PROGRESS_MESSAGE_CHARS wherever it is stored."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from app.queue.jobs import PROGRESS_MESSAGE_CHARS, JobState
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
LONG = "x" * 5000
LONG_ONESHOT = f"print('PROGRESS 0.3 {LONG}', flush=True); raise SystemExit(1)"
LONG_RUNNER = f"""\
from app import modelkit

def handle(model, job):
    job.progress(0.3, "{LONG}")
    raise ValueError("done talking")

modelkit.serve(lambda: None, handle, name="long_warm")
"""


@pytest.fixture
def models_file(tmp_path: Path) -> Path:
    """`toy`, `nul` (prints a NUL on stderr and exits 1) and `nul_warm` (a kit runner whose job
    reports progress and fails, both with a NUL in their text)."""
    path = tmp_path / "models.toml"
    path.write_text(
        toy_model("toy")
        + script_model("nul", ["{python}", "-c", ONESHOT])
        + script_model("long", ["{python}", "-c", LONG_ONESHOT])
        + kit_model(tmp_path, "nul_warm", RUNNER)
        + kit_model(tmp_path, "long_warm", LONG_RUNNER)
    )
    return path


def kit_model(folder: Path, name: str, source: str) -> str:
    """Registry TOML for a persistent model whose runner is `source` (written beside the registry)."""
    runner = folder / f"{name}.py"
    runner.write_text(source)
    return f"""
[models.{name}]
mode = "persistent"
argv = ["{{python}}", "-c", "pass"]
serve_argv = {json.dumps(["{python}", str(runner)])}
vram = {{ base_mb = 1000 }}
timeout_s = 10
max_attempts = 1
[[models.{name}.outputs]]
name = "out.txt"
"""


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


@pytest.mark.asyncio
@pytest.mark.parametrize("model", ["long", "long_warm"])
async def test_a_long_progress_message_is_kept_to_one_length_in_the_job_and_its_events(
    manager, make_worker, model, monkeypatch
) -> None:
    """The job row kept 200 characters of a progress message while its milestone event kept all
    of it: 64 KiB a line from a one-shot model, 1 KiB from the kit, 1 MiB from another runner."""
    monkeypatch.setenv("PYTHONPATH", str(HERE.parent))
    job_id = await enqueue(manager, model=model, max_attempts=1)
    await asyncio.wait_for(make_worker().run(), 30)
    job = await manager.get(job_id)
    assert job.progress_message == LONG[:PROGRESS_MESSAGE_CHARS], job.progress_message
    milestones = [e.detail for e in await manager.events(job_id) if e.kind == "progress"]
    assert milestones == [{"progress": 0.25, "message": LONG[:PROGRESS_MESSAGE_CHARS]}], milestones
