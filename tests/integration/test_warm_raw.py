"""A warm runner written without app/modelkit.py: what the worker takes from it is bounded and
checked on its side, not trusted to the kit (tests/models/raw_runner.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from app.queue.jobs import JobState
from tests.conftest import HERE
from tests.integration.test_durability import running, until
from tests.integration.test_worker import enqueue

RAW = HERE / "models" / "raw_runner.py"


@pytest.fixture
def models_file(models_file: Path) -> Path:
    """The test models and `warm_raw`, served by tests/models/raw_runner.py, one attempt a job."""
    with models_file.open("a") as f:
        f.write(
            f"""
[models.warm_raw]
mode = "persistent"
argv = ["/bin/false"]
serve_argv = {json.dumps(["{python}", str(RAW)])}
vram = {{ base_mb = 1000 }}
timeout_s = 30
max_attempts = 1
[models.warm_raw.params.error_kb]
type = "int"
default = 0
[models.warm_raw.params.hardlink]
type = "bool"
default = false
[models.warm_raw.params.empty_error]
type = "bool"
default = false
[models.warm_raw.params.other_id]
type = "bool"
default = false
[models.warm_raw.params.close_stdout]
type = "bool"
default = false
[[models.warm_raw.outputs]]
name = "out.txt"
media_type = "text/plain"
"""
        )
    return models_file


async def test_a_runners_error_is_stored_cut_to_a_bound(manager, make_worker):
    """A runner's error was stored whole: a 900 KiB error made the job's JSON 900 KB, its history
    twice that (the error's first line in each event), and every list that showed the job."""
    job_id = await enqueue(manager, model="warm_raw", vram_mb=1000, error_kb=900)
    async with running(make_worker(burst=False)):
        job = await until(manager, job_id, lambda j: j.state.final)
    assert job.state is JobState.failed
    assert job.error is not None and job.error.startswith("the model failed: xxx")
    assert len(job.error) < 9000 and "cut" in job.error.splitlines()[-1]
    for event in await manager.events(job_id):
        assert len(json.dumps(event.detail)) < 9000


async def test_an_output_with_a_second_name_elsewhere_is_refused(manager, make_worker, store):
    """A hard link to a file the runner keeps was published as the job's output: the runner,
    alive after the job, could change the file served after its sha256 was recorded."""
    job_id = await enqueue(manager, model="warm_raw", vram_mb=1000, hardlink=True)
    async with running(make_worker(burst=False)):
        job = await until(manager, job_id, lambda j: j.state.final)
    assert job.state is JobState.failed, job
    assert job.error is not None and "out.txt" in job.error and "hard link" in job.error, job.error
    assert not (store.root / "results" / str(job.id)).exists() or not any(
        p.is_file() and os.stat(p).st_nlink > 1 for p in (store.root / "results" / str(job.id)).rglob("*")
    )


@pytest.mark.parametrize(
    ("param", "said"),
    [
        ("other_id", "the warm runner broke the protocol: protocol error: unexpected"),
        ("close_stdout", "the warm runner broke the protocol: the runner closed its stdout during the job"),
        ("empty_error", "the model failed: (no message)"),
    ],
)
async def test_what_a_runner_did_wrong_is_said_as_it_was(manager, make_worker, param, said):
    """A runner that broke the protocol was said to have died, by SIGTERM (the worker's own kill of
    it), and the job took a strike towards quarantine for a model's bug; one that closed its stdout
    and stayed was said to have exited (and quarantined); an error with no words read `the model
    failed: failed`."""
    job_id = await enqueue(manager, model="warm_raw", vram_mb=1000, **{param: True})
    async with running(make_worker(burst=False)):
        job = await until(manager, job_id, lambda j: j.state.final)
    assert job.state is JobState.failed and (job.error or "").startswith(said), job.error
    [failed] = [e.detail for e in await manager.events(job_id) if e.kind == "failed"]
    assert failed.get("signal") is None and failed.get("exit_code") is None, failed
    assert job.abnormal_runs == 0
