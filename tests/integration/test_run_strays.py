"""What a one-shot run leaves behind: a process it started outside its process group (in a
session of its own, which the group's kill misses) dies with the run, and writes nothing into
the next job's scratch lane; the files it left in its lane are removed off the event loop."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from app.queue.jobs import JobState
from tests.conftest import script_model, toy_model
from tests.integration.test_durability import alive, running, until
from tests.integration.test_worker import enqueue

# Starts a process in a session of its own that writes its pid to argv[2], then (after argv[4]
# seconds) writes out.txt into the run's output folder, argv[1] (if it can), and lives on. Then, by argv[3]:
# "hang" sleeps (until its timeout), "exit" ends well, writing its own out.txt. With argv[5]
# "quiet" the stray closes its stdout and stderr first (as a daemon does).
STRAY = textwrap.dedent(
    """
    import os, sys, time
    out_dir, pid_file, then, delay_s, quiet = sys.argv[1:6]
    child = os.fork()
    if child == 0:
        os.setsid()
        if quiet == "quiet":
            null = os.open(os.devnull, os.O_RDWR)
            os.dup2(null, 1)
            os.dup2(null, 2)
        time.sleep(float(delay_s))
        try:
            with open(os.path.join(out_dir, "out.txt"), "w") as f:
                f.write("left behind by an earlier job")
        except OSError:  # the lane is gone: live on all the same
            pass
        time.sleep(60)
        os._exit(0)
    with open(pid_file + ".tmp", "w") as f:
        f.write(str(child))
    os.rename(pid_file + ".tmp", pid_file)
    if then == "hang":
        time.sleep(60)
    with open(os.path.join(out_dir, "out.txt"), "w") as f:
        f.write("mine")
    """
)

# Leaves a folder of argv[2] empty files in its scratch lane (a cache in its HOME), writes out.txt.
LITTER = textwrap.dedent(
    """
    import os, sys
    os.mkdir("cache")
    for i in range(int(sys.argv[2])):
        open(os.path.join("cache", str(i)), "w").close()
    with open(os.path.join(sys.argv[1], "out.txt"), "w") as f:
        f.write("done")
    """
)


@pytest.fixture
def models_file(tmp_path: Path) -> Path:
    """`toy`; `stray`, which leaves a process behind (see STRAY; timeout 10 s, its `then`, `delay_s`
    and `quiet` as params); `silent`, which waits 2 s and writes nothing."""
    path = tmp_path / "models.toml"
    stray = [
        "{python}",
        "-c",
        STRAY,
        "{output_dir}",
        str(tmp_path / "stray.pid"),
        "{then}",
        "{delay_s}",
        "{quiet}",
    ]
    params = "".join(
        f'[models.stray.params.{name}]\ntype = "str"\ndefault = "{default}"\n'
        for name, default in (("then", "exit"), ("delay_s", "3"), ("quiet", "loud"))
    )
    path.write_text(
        toy_model("toy")
        + script_model("stray", stray)
        + params
        + script_model("silent", ["{python}", "-c", "import time; time.sleep(2)"])
        + script_model("stray_timeout", stray).replace("timeout_s = 10", "timeout_s = 1")
        + params.replace("models.stray.", "models.stray_timeout.")
        + script_model("litter", ["{python}", "-c", LITTER, "{output_dir}", "100"])
    )
    return path


def _stray_pid(tmp_path: Path) -> int:
    return int((tmp_path / "stray.pid").read_text())


async def _gone(pid: int, within_s: float) -> bool:
    for _ in range(int(within_s / 0.05)):
        if not alive(pid):
            return True
        await asyncio.sleep(0.05)
    return not alive(pid)


@pytest.fixture
def strays(tmp_path: Path):
    """Kills what the test's model left alive, whatever the test found."""
    yield
    if (tmp_path / "stray.pid").exists() and alive(pid := _stray_pid(tmp_path)):
        os.kill(pid, signal.SIGKILL)


async def test_a_process_that_left_a_timed_out_runs_group_dies_with_the_run(
    manager, make_worker, tmp_path, strays
):
    job_id = await enqueue(manager, model="stray_timeout", then="hang", max_attempts=1)
    await make_worker().run()
    job = await manager.get(job_id)
    assert job.state is JobState.failed and "timed out" in (job.error or ""), job.error
    assert await _gone(_stray_pid(tmp_path), within_s=2)


async def test_a_process_a_run_left_behind_writes_nothing_into_the_next_jobs_lane(
    manager, make_worker, tmp_path, strays
):
    """The stray of a run that ended well wrote its file into the lane the next job ran in (one
    lane: one job at a time), and that job, which wrote nothing, succeeded with it as its output."""
    first = await enqueue(manager, model="stray", max_attempts=1)  # the stray writes after 3 s
    second = await enqueue(manager, model="silent", max_attempts=1)
    await make_worker(max_jobs_per_gpu=1).run()
    assert (await manager.get(first)).state is JobState.succeeded
    job = await manager.get(second)
    assert job.state is JobState.failed and "out.txt" in (job.error or ""), (job.state, job.error)
    assert await _gone(_stray_pid(tmp_path), within_s=1)


async def test_a_quiet_stray_of_a_run_that_ended_well_is_killed_within_a_reap_round(
    manager, make_worker, tmp_path, strays
):
    """A stray that let go of the run's output pipes (a daemon) is not seen as the run ends; the
    worker's reaper finds it by the run's marker once the run is over."""
    job_id = await enqueue(manager, model="stray", quiet="quiet", delay_s="60", max_attempts=1)
    async with running(make_worker(burst=False, reap_interval_s=0.3)):
        await until(manager, job_id, lambda j: j.state.final)
        assert await _gone(_stray_pid(tmp_path), within_s=3)


# Folders shutil.rmtree was asked to remove, with the thread that asked (see `_on_audit`).
_REMOVED: list[tuple[str, int]] = []
_WATCHING: list[bool] = []
# Reads of /proc's list of processes, while `_COUNTING` holds True (see `_on_audit`).
_PROC_SCANS: list[str] = []
_COUNTING: list[bool] = []


def _on_audit(event: str, args: tuple[Any, ...]) -> None:
    if event == "shutil.rmtree" and _WATCHING:
        _REMOVED.append((str(args[0]), threading.get_ident()))
    elif event == "os.scandir" and _COUNTING and str(args[0]) == "/proc":
        _PROC_SCANS.append(event)


def _watch() -> None:
    if not _WATCHING:
        sys.addaudithook(_on_audit)  # hooks stay for the process: this one records while watched
        _WATCHING.append(True)


async def test_a_lane_full_of_what_the_model_left_is_emptied_off_the_event_loop(manager, make_worker):
    """The lane was emptied on the worker's event loop: 40,000 files a model left in its HOME
    stopped the loop for 0.45 s (its heartbeats, the other jobs' pipes, the API under `serve`),
    a few million for longer than a lease. A lane holding more than its input and an empty out/
    is emptied in a thread."""
    _watch()
    _REMOVED.clear()
    job_id = await enqueue(manager, model="litter")
    await make_worker().run()
    assert (await manager.get(job_id)).state is JobState.succeeded
    threads = {thread for path, thread in _REMOVED if path.endswith(f"{os.sep}cache")}
    assert threads and threading.get_ident() not in threads, _REMOVED


async def test_an_idle_worker_looks_for_strays_only_after_a_run_ended(manager, make_worker, tmp_path, strays):
    """Every reap round read the environment of every process on the host to find strays: 75-85
    ms of CPU a round beside 2,000 processes (as root; 32-37 ms as a user of its own), idle or
    not. A round now looks only when a run or runner of the worker ended since it last looked."""
    _watch()
    _PROC_SCANS.clear()
    _COUNTING.append(True)
    try:
        async with running(make_worker(burst=False, reap_interval_s=0.1)):
            deadline = time.monotonic() + 30
            while not _PROC_SCANS:  # its first round looks, however long its start took
                assert time.monotonic() < deadline, "no round looked for strays"
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.3)  # its start's own children reaped, and looked after once
            _PROC_SCANS.clear()
            await asyncio.sleep(1.0)  # about ten rounds with nothing running
            idle = len(_PROC_SCANS)
            job_id = await enqueue(manager, model="stray", quiet="quiet", delay_s="60", max_attempts=1)
            await until(manager, job_id, lambda j: j.state.final)
            assert await _gone(_stray_pid(tmp_path), within_s=3)  # the round after its end looked
    finally:
        _COUNTING.clear()
    # Every round looked before (about ten here). One look is allowed: any child of this test
    # process reaped late (an earlier test's) changes the totals the worker compares.
    assert idle <= 1, idle
