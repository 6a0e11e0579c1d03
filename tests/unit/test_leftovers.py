"""Finding a worker's leftover runs on this host by the markers in their environment."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from app import errors
from app.queue import leftovers, records
from app.queue.jobs import JobState


@pytest.fixture
def sleepers() -> Iterator[dict[str, int]]:
    """Processes (own sessions) marked as a one-shot run of `h:w10` and a warm runner of `h:w2`."""
    marks = {"run": {"GPUJOBS_WORKER": "h:w10"}, "runner": {"GPUJOBS_RUNNER": "h:w2:relief:0"}}
    path = {"PATH": os.environ["PATH"]}
    started = {
        name: subprocess.Popen(["sleep", "30"], env={**path, **env}, start_new_session=True)
        for name, env in marks.items()
    }
    yield {name: exec_done(p.pid) for name, p in started.items()}
    for p in started.values():
        p.kill()
        p.wait()


def test_a_workers_runs_and_runners_are_found_by_its_exact_id(sleepers):
    assert sleepers["run"] in leftovers.find_worker_models("h:w10")
    assert sleepers["runner"] in leftovers.find_worker_models("h:w2")
    found = leftovers.find_worker_models("h:w1")  # a prefix of both ids: neither is its run
    assert sleepers["run"] not in found and sleepers["runner"] not in found


def test_a_runner_of_a_worker_whose_name_extends_another_with_a_colon_is_not_the_others():
    """Workers `w2` and `w2:b` on host `h`: the runner of `h:w2:b` (model relief, GPU 0) is not a
    leftover of `h:w2`, whose restart must leave it alone."""
    env = {"PATH": os.environ["PATH"], "GPUJOBS_RUNNER": "h:w2:b:relief:0"}
    runner = subprocess.Popen(["sleep", "30"], env=env, start_new_session=True)
    try:
        exec_done(runner.pid)  # a rerun in a fresh clone's run: looked at before its exec
        assert runner.pid in leftovers.find_worker_models("h:w2:b")
        assert runner.pid not in leftovers.find_worker_models("h:w2")
    finally:
        runner.kill()
        runner.wait()


def hold(worker_id: str) -> None:
    """Hold `worker_id` and let it go at once (ConfigError if it is held elsewhere)."""
    held = leftovers.hold_identity(worker_id)
    assert held is not None
    held.close()


def test_a_worker_id_is_held_by_one_process_at_a_time_and_freed_when_it_ends():
    worker_id = f"h:held-{os.getpid()}"
    held = leftovers.hold_identity(worker_id)
    assert held is not None
    try:
        with pytest.raises(
            errors.ConfigError, match=rf"'{worker_id}' is running on this host \(pid {os.getpid()}\)"
        ):
            hold(worker_id)
        hold(worker_id + "x")  # another id is free
    finally:
        held.close()
    hold(worker_id)  # freed with its socket
    # A holder killed outright frees it too: the kernel closes its socket.
    code = f"from app.queue import leftovers; h = leftovers.hold_identity({worker_id!r}); print(); input()"
    with subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    ) as holder:
        assert holder.stdout is not None and holder.stdout.readline() == b"\n"
        with pytest.raises(errors.ConfigError, match=f"pid {holder.pid}"):
            hold(worker_id)
        holder.kill()
    hold(worker_id)


async def test_a_leftover_of_one_attempt_spares_the_runs_of_the_next():
    """A reaper kills what a dead worker's attempt left on this host, found by the GPUJOBS_JOB
    marker when no pid was recorded. Meanwhile the job may have been taken back elsewhere and
    claimed again by a worker on this host: the marker of any attempt matched, and the new run was
    killed as the old one's leftover."""
    job_id = uuid.uuid4()
    old, new = [
        await asyncio.create_subprocess_exec(
            "sleep",
            "30",
            env={"PATH": os.environ["PATH"], "GPUJOBS_JOB": f"{job_id}:{n}"},
            start_new_session=True,
        )
        for n in (1, 2)
    ]
    try:
        for p in (old, new):
            await asyncio.to_thread(exec_done, p.pid)
        taken = records.TakenBack(job_id, 1, "h:dead", JobState.running, None, socket.gethostname())
        assert await leftovers.kill_leftover(taken, host=socket.gethostname(), grace_s=5)
        assert await asyncio.wait_for(old.wait(), 5) is not None
        assert new.returncode is None  # the next attempt's run lives on
        assert not leftovers.is_model_of(new.pid, job_id, 1) and leftovers.is_model_of(new.pid, job_id, 2)
    finally:
        for p in (old, new):
            if p.returncode is None:
                p.kill()
            await p.wait()


def exec_done(pid: int, timeout_s: float = 5.0) -> int:
    """Wait until process `pid` runs its own program (`sleep`), not the fork of this one: until
    then /proc shows this process's environment, without the marker looked for. Its pid."""
    deadline = time.monotonic() + timeout_s
    cmdline = Path(f"/proc/{pid}/cmdline")
    while cmdline.read_bytes().split(b"\0")[0] != b"sleep":
        assert time.monotonic() < deadline, f"process {pid} did not exec in {timeout_s} s"
        time.sleep(0.005)
    return pid


async def test_a_jobs_recorded_runner_is_killed_only_if_it_is_the_lost_workers():
    """A warm job's recorded pid is its runner's, marked as the runner of its worker: killed when
    the job is taken back from that worker; a process of another worker's at that pid (reused) is
    left alone, and the job's run is then looked for by its marker."""
    path = {"PATH": os.environ["PATH"]}
    ours, theirs = [
        await asyncio.create_subprocess_exec(
            "sleep", "30", env={**path, "GPUJOBS_RUNNER": f"h:{name}:warm_a:0"}, start_new_session=True
        )
        for name in ("lost", "other")
    ]
    try:
        for p in (ours, theirs):  # exec'd: until then /proc shows the test's own environment
            await asyncio.to_thread(exec_done, p.pid)
        host = socket.gethostname()
        taken = records.TakenBack(uuid.uuid4(), 1, "h:lost", JobState.running, theirs.pid, host)
        assert not await leftovers.kill_leftover(taken, host=host, grace_s=5)
        taken = records.TakenBack(uuid.uuid4(), 1, "h:lost", JobState.running, ours.pid, host)
        assert await leftovers.kill_leftover(taken, host=host, grace_s=5)
        assert await asyncio.wait_for(ours.wait(), 5) is not None
        assert theirs.returncode is None
    finally:
        for p in (ours, theirs):
            if p.returncode is None:
                p.kill()
            await p.wait()
