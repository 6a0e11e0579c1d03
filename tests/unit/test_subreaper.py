"""The worker as a child subreaper (app/subreaper.py): which of its children it kills and reaps."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app import subreaper
from app.queue import leftovers

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a subreaper is Linux's")


def _state(pid: int) -> str | None:
    """The process's state letter ("Z": a zombie); None once it is gone (reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return None


def _until_zombie(pid: int) -> None:
    deadline = time.monotonic() + 5
    while _state(pid) != "Z":
        assert time.monotonic() < deadline, _state(pid)
        time.sleep(0.01)


def _sleeping(env: dict[str, str]) -> int:
    """A child that sleeps for 30 s in `env`, which nothing here waits for (no Popen)."""
    return os.posix_spawnp("sleep", ["sleep", "30"], env)


def _kill(pids: list[int]) -> None:
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def test_only_a_zombie_seen_at_two_rounds_that_nothing_here_spawned_is_reaped():
    """A stray that ended by itself stayed a zombie of the worker for good. A round now reaps a
    zombie child only at its second look, and never one this process spawned and waits for itself
    (taking its status made the run fail, or a failed run succeed)."""
    assert subreaper.become()
    known = subprocess.Popen(["/bin/sh", "-c", "exit 3"])
    subreaper.spawned(known.pid)
    stray = os.posix_spawn("/bin/true", ["true"], {})  # stands for a stray that came to the worker
    try:
        _until_zombie(known.pid)
        _until_zombie(stray)
        seen = subreaper.reap_zombies(set())
        assert stray in seen and known.pid not in seen
        assert _state(stray) == "Z"  # a zombie of a moment may be asyncio's, about to be reaped
        subreaper.reap_zombies(seen)
        assert _state(stray) is None and known.wait(timeout=5) == 3
    finally:
        subreaper.exited(known.pid)


async def test_only_children_with_the_marker_of_an_ended_run_of_this_worker_are_killed():
    """Killing a child without an ended run's marker (a re-parented postmaster, a live run's
    helper, another worker's) would take down what is not a stray."""
    assert subreaper.become()
    base = {"PATH": os.defpath}
    ended = _sleeping({**base, "GPUJOBS_JOB": "j:1", "GPUJOBS_WORKER": "w"})
    spared = [
        _sleeping(env)
        for env in (
            base,
            {**base, "GPUJOBS_JOB": "j:2", "GPUJOBS_WORKER": "w"},  # a live run's
            {**base, "GPUJOBS_JOB": "j:1", "GPUJOBS_WORKER": "other"},  # another worker's
        )
    ]
    try:
        await asyncio.sleep(0.2)  # each has called exec: its own environment is the one shown
        assert await leftovers.kill_adopted("w", lambda: {"run j:2"}) == 1
        assert _state(ended) is None  # killed and reaped
        assert all(_state(pid) not in (None, "Z") for pid in spared)  # alive, untouched
    finally:
        _kill(spared)
