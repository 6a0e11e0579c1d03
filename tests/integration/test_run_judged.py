"""How a one-shot run's end is judged: a timeout stays a timeout, a start that failed for a while
is tried again, and a large output is checked without stalling the worker."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from app.queue.jobs import JobState
from tests.conftest import toy_model
from tests.integration.test_worker import enqueue

ONE_GIB = 1 << 30


@pytest.fixture
def models_file(tmp_path: Path) -> Path:
    """`toy`; `term64`, which answers SIGTERM with its bad-input exit code 64 (timeout 1 s); `big`,
    which writes a 1 GiB output (sparse: quick to write, not to hash); `labelled`, which refuses
    every input as bad (exit 65) whatever its `label` param says; `missing`, whose program is not
    there."""
    path = tmp_path / "models.toml"
    term64 = ["/bin/sh", "-c", "trap 'exit 64' TERM; sleep 100 & wait"]
    big = [
        "{python}",
        "-c",
        f"import os, sys; os.truncate(open(sys.argv[1] + '/out.bin', 'wb').name, {ONE_GIB})",
        "{output_dir}",
    ]
    path.write_text(
        toy_model("toy")
        + f"""
[models.term64]
argv = {json.dumps(term64)}
vram = {{ base_mb = 1000 }}
timeout_s = 1
max_attempts = 2
bad_input_exit_codes = [64]
[[models.term64.outputs]]
name = "out.txt"

[models.big]
argv = {json.dumps(big)}
vram = {{ base_mb = 1000 }}
timeout_s = 30
max_attempts = 1
[[models.big.outputs]]
name = "out.bin"
max_mb = 2048

[models.labelled]
argv = {json.dumps(LABELLED)}
vram = {{ base_mb = 1000 }}
timeout_s = 30
max_attempts = 3
bad_input_exit_codes = [65]
[models.missing]
argv = ["/nonexistent/no-such-program", "{{output_dir}}"]
vram = {{ base_mb = 1000 }}
timeout_s = 10
max_attempts = 3
[[models.missing.outputs]]
name = "out.txt"
[models.labelled.params.label]
type = "str"
default = "plain"
[[models.labelled.outputs]]
name = "out.txt"
"""
    )
    return path


LABELLED = ["{python}", "-c", "import sys; print('bad image', file=sys.stderr); sys.exit(65)", "{label}"]


@pytest.mark.parametrize(
    "label", ["plain", "a sign saying No space left on device", "a robot, CUDA out of memory"]
)
async def test_a_bad_input_is_judged_by_what_the_model_said_not_by_its_params(manager, make_worker, label):
    """The worker's "started pid N: <command line>" was in the tail a failed run is judged by, and
    the command line holds the request's params: a label saying "No space left on device" had the
    job handed back three times as the host's full disk (claims paused, the worker reported its
    storage unusable), then fail with "ran out of disk space"; one saying "CUDA out of memory" was
    queued again twice with a larger VRAM estimate. Any user could do either."""
    job_id = await enqueue(manager, model="labelled", vram_mb=1000, label=label)
    await make_worker().run()
    job = await manager.get(job_id)
    kinds = [e.kind for e in await manager.events(job_id)]
    assert (job.state, job.attempt, job.vram_mb) == (JobState.failed, 1, 1000), (kinds, job.error)
    assert (job.error or "").startswith("bad input: exit code 65"), job.error


async def test_a_timeout_is_no_bad_input_whatever_the_code_the_model_dies_with(manager, make_worker):
    """A model that exits with a bad-input code when SIGTERM stops it (at its timeout) was failed
    for good as bad input, where a timeout is retried."""
    job_id = await enqueue(manager, model="term64")
    await make_worker(retry_base_s=60).run()  # not due before the worker ends, however slow the host
    job = await manager.get(job_id)
    assert job.state is JobState.scheduled, (job.state, job.error)  # retried, after its backoff
    assert (job.error or "").startswith("timed out"), job.error


async def test_a_large_output_is_checked_without_stalling_the_worker(manager, make_worker):
    """The outputs' SHA-256 was computed on the event loop: a 1 GiB output stopped the worker's
    heartbeats, its other jobs' pipes and, under `serve`, the API for the whole read."""
    job_id = await enqueue(manager, model="big")
    stalls: list[float] = []

    async def ticker() -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.01)
            now = time.monotonic()
            stalls.append(now - last)
            last = now

    ticking = asyncio.create_task(ticker())
    try:
        await make_worker().run()
    finally:
        ticking.cancel()
    job = await manager.get(job_id)
    assert job.state is JobState.succeeded, job.error
    assert max(stalls) < 0.3, f"the event loop stalled for {max(stalls):.2f} s"


async def test_a_model_that_could_not_start_fails_with_a_log_that_says_why(manager, make_worker, store):
    """A failed job always has a log that says why (README, "Durability"). A one-shot model whose program
    is missing failed its job, once, with no log file: its log link answered an empty log, as for
    a run that said nothing and succeeded."""
    job_id = await enqueue(manager, model="missing")
    await make_worker().run()
    job = await manager.get(job_id)
    assert (job.state, job.attempt) == (JobState.failed, 1), job
    assert (job.error or "").startswith("the model could not be started"), job.error
    said = store.log_path(job.id, job.attempt).read_text()
    assert "[runner] the model could not be started: [Errno 2]" in said and "no-such-program" in said, said


def test_a_start_that_fails_for_a_while_is_told_from_one_that_never_can(tmp_path: Path):
    """A model that could not start for want of file descriptors (or memory, or processes) was
    failed for good, as if its program were missing."""
    script = textwrap.dedent(
        """
        import asyncio, resource, sys
        from pathlib import Path
        from app import runner

        async def start(argv):
            process = runner.ModelProcess(argv, cwd=Path("."), env={}, log_path=Path("run.log"),
                                          timeout_s=5, kill_grace_s=1)
            try:
                await process.start()
            except OSError as exc:
                return runner.cannot_start(exc)
            await process.wait()
            return "started"

        async def main():
            Path("plain.txt").write_text("not a program")
            Path("plain.txt").chmod(0o755)
            print(await start(["/nonexistent/model"]), await start(["./plain.txt"]))
            resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
            held = []
            try:
                while True:
                    held.append(open("/dev/null"))
            except OSError:
                pass
            print(await start(["/bin/true"]))

        asyncio.run(main())
        """
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "True", "False"]  # missing, not a program; then no fds
