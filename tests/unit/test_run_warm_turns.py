"""A warm runner's lines beyond the one answer it owes (app/warm.py): they end that runner, and
never become the answer to the next job."""

from __future__ import annotations

import asyncio
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from app import modelkit, runner, warm, warmpool, warmresult

ROOT = Path(__file__).resolve().parents[2]
KEY = warmpool.RunnerKey("toy", 0)

# Answers every job with a done line, then `EXTRA` (formatted with the job id) in the same write.
ANSWERING = """\
import json, os, sys
print(json.dumps({{'ready': True, 'pid': os.getpid()}}) + {ready_extra!r}, end='', flush=True)
for line in sys.stdin:
    job = json.loads(line)['job']
    done = json.dumps({{'job': job, 'done': True}}) + '\\n'
    sys.stdout.write(done + {extra!r}.replace('JOB', job))
    sys.stdout.flush()
"""


@pytest.fixture
async def pool() -> AsyncIterator[warmpool.WarmPool]:
    pool = warmpool.WarmPool(kill_grace_s=0.3)
    yield pool
    await pool.close_all("test over")


def _launch(tmp_path: Path, name: str, *, extra: str = "", ready_extra: str = "\n") -> warm.Launch:
    script = tmp_path / f"{name}.py"
    script.write_text(textwrap.dedent(ANSWERING.format(extra=extra, ready_extra=ready_extra)))
    folder = tmp_path / "runners" / name
    folder.mkdir(parents=True)
    return warm.Launch(
        name, (sys.executable, str(script)), runner.minimal_env(None), folder, folder / "runner.log"
    )


async def _run(tmp_path: Path, warm_runner: warm.WarmRunner, n: int) -> warmresult.WarmResult:
    progress: list[tuple[float, str]] = []

    async def on_progress(fraction: float, message: str) -> None:
        progress.append((fraction, message))

    request = modelkit.Request(f"job{n}:1", tmp_path / "in.png", tmp_path / f"out{n}", {})
    result = await warm_runner.run_job(
        request, timeout_s=10, log_path=tmp_path / f"job{n}.log", on_progress=on_progress
    )
    assert not progress, "progress after the answer reached the job"
    return result


async def _dead(warm_runner: warm.WarmRunner) -> bool:
    for _ in range(300):
        if warm_runner.state is warm.RunnerState.DEAD:
            return True
        await asyncio.sleep(0.01)
    return False


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "extra",
    [
        '{"job": "JOB", "done": true}\n',  # a second done for the same job
        '{"job": "JOB", "progress": 0.5}\n',  # progress after done
        '{"job": "JOB", "error": "changed my mind"}\n',
    ],
    ids=["second_done", "progress_after_done", "error_after_done"],
)
async def test_a_line_after_the_answer_ends_the_runner_not_the_next_job(
    tmp_path: Path, pool: warmpool.WarmPool, extra: str
) -> None:
    launch = _launch(tmp_path, "talker", extra=extra)
    first: Any = None
    for n in (1, 2):
        async with pool.use(KEY, launch, hold_mb=0) as warm_runner:
            first = first or warm_runner
            result = await _run(tmp_path, warm_runner, n)
        assert result.outcome is warmresult.Outcome.DONE, (n, result.error)
    assert await _dead(first), "a runner that spoke out of turn was kept"


@pytest.mark.asyncio
async def test_a_line_after_ready_ends_the_runner_not_its_first_job(
    tmp_path: Path, pool: warmpool.WarmPool
) -> None:
    launch = _launch(tmp_path, "eager", ready_extra='\n{"job": "x:1", "done": true}\n')
    with pytest.raises(warmresult.StartFailed, match="out of turn"):
        async with pool.use(KEY, launch, hold_mb=0) as warm_runner:
            await _run(tmp_path, warm_runner, 1)


# Texts with a lone surrogate: what json.dumps writes for a str() of a file name that is not UTF-8.
UNPAIRED = r"""
import json, os, sys
print(json.dumps({'ready': True}), flush=True)
for line in sys.stdin:
    job = json.loads(line)['job']
    sys.stdout.write(json.dumps({'job': job, 'progress': 0.5, 'message': 'reading \udcff.png'}) + '\n')
    sys.stdout.write(json.dumps({'job': job, 'error': 'cannot read \udcff.png', 'bad_input': True}) + '\n')
    sys.stdout.flush()
"""


async def _one_job(tmp_path: Path, source: str) -> tuple[warmresult.WarmResult, list[tuple[float, str]]]:
    """Run one job through a runner made of `source`; its result and the progress it reported."""
    script = tmp_path / "runner.py"
    script.write_text(source)
    folder = tmp_path / "runner"
    folder.mkdir()
    launch = warm.Launch("r", (sys.executable, str(script)), runner.minimal_env(None), folder, folder / "log")
    warm_runner = warm.WarmRunner(launch, kill_grace_s=0.3)
    await warm_runner.start()
    progress: list[tuple[float, str]] = []

    async def on_progress(fraction: float, message: str) -> None:
        progress.append((fraction, message))

    request = modelkit.Request("j:1", tmp_path / "in.png", tmp_path / "out", {})
    try:
        result = await warm_runner.run_job(
            request, timeout_s=5, log_path=tmp_path / "job.log", on_progress=on_progress
        )
    finally:
        await warm_runner.close()
    return result, progress


@pytest.mark.asyncio
async def test_texts_that_are_not_unicode_reach_the_job_replaced(tmp_path: Path) -> None:
    result, progress = await _one_job(tmp_path, UNPAIRED)
    assert result.outcome is warmresult.Outcome.BAD_INPUT, result.error  # not a 5 s timeout
    assert result.error == "cannot read \ufffd.png"
    assert progress == [(0.5, "reading \ufffd.png")]
    assert "PROGRESS 0.500 reading \ufffd.png" in (tmp_path / "job.log").read_text()


HUGE = """
import json, sys
print(json.dumps({'ready': True}), flush=True)
for line in sys.stdin:
    job = json.loads(line)['job']
    sys.stdout.write('{"job": "%s", "progress": 1%s}\\n' % (job, '0' * 400))  # an int past any float
    sys.stdout.write(json.dumps({'job': job, 'done': True}) + '\\n')
    sys.stdout.flush()
"""


@pytest.mark.asyncio
async def test_progress_past_any_float_is_complete_not_a_hang(tmp_path: Path) -> None:
    result, progress = await _one_job(tmp_path, HUGE)
    assert result.outcome is warmresult.Outcome.DONE, result.error  # not a 5 s timeout
    assert [fraction for fraction, _ in progress] == [1.0]


@pytest.mark.asyncio
async def test_a_runner_that_exits_right_after_ready_is_not_handed_a_job(tmp_path: Path) -> None:
    """Its ready line and its end come together: the start fails (or the runner is ended while
    idle), and no job is sent to it to wait out its timeout."""
    script = tmp_path / "brief.py"
    script.write_text("import json, os\nos.write(1, (json.dumps({'ready': True}) + '\\n').encode())\n")
    folder = tmp_path / "runner"
    folder.mkdir()
    launch = warm.Launch("b", (sys.executable, str(script)), runner.minimal_env(None), folder, folder / "log")
    for _ in range(5):
        warm_runner = warm.WarmRunner(launch, kill_grace_s=0.3)
        try:
            await warm_runner.start()
        except warmresult.StartFailed:
            continue
        await asyncio.sleep(0.2)  # its end is seen while idle
        assert warm_runner.state is not warm.RunnerState.IDLE, "a dead runner stayed idle"
