"""Tests for app.procgroup: leftover process groups killed, with real processes (no mocks)."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
import time

import pytest

from app import procgroup

GRACE_S = 0.3


async def _leftover(*, ignore_term: bool) -> asyncio.subprocess.Process:
    """A sleeping process in a group of its own, as a run leaves one, once it runs."""
    handler = "signal.SIG_IGN" if ignore_term else "signal.SIG_DFL"
    code = (
        f"import signal, time\nsignal.signal(signal.SIGTERM, {handler})\n"
        "print('ready', flush=True)\ntime.sleep(60)\n"
    )
    leftover = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, stdout=asyncio.subprocess.PIPE, start_new_session=True
    )
    assert leftover.stdout is not None
    assert await leftover.stdout.readline() == b"ready\n"
    return leftover


@pytest.mark.asyncio
@pytest.mark.parametrize("ignore_term", [False, True])
async def test_kill_process_group_of_a_leftover(ignore_term: bool) -> None:
    leftover = await _leftover(ignore_term=ignore_term)
    assert await procgroup.kill_process_group(leftover.pid, grace_s=GRACE_S)
    await leftover.communicate()
    assert leftover.returncode == (-signal.SIGKILL if ignore_term else -signal.SIGTERM)
    assert not await procgroup.kill_process_group(leftover.pid, grace_s=GRACE_S)


@pytest.mark.asyncio
@pytest.mark.parametrize("pgid", [-3, 0, 1, None])
async def test_kill_process_group_refuses_dangerous_groups(pgid: int | None) -> None:
    with pytest.raises(ValueError):
        await procgroup.kill_process_group(os.getpgid(0) if pgid is None else pgid, grace_s=0.1)


# A process that starts `argv[1]` children running `argv[2]` (sleep: about 80 kB each, where a
# forked Python is about 0.8 MB), says "ready", and kills and reaps them all once its stdin closes
# (so the test leaves no orphan to the host's init).
CROWD = """
import os, signal, sys
kids = []
for _ in range(int(sys.argv[1])):
    pid = os.fork()
    if pid == 0:
        os.execv(sys.argv[2], ["sleep", "3600"])
    kids.append(pid)
print("ready", flush=True)
sys.stdin.read()
for pid in kids:
    os.kill(pid, signal.SIGKILL)
for pid in kids:
    os.waitpid(pid, 0)
"""


@pytest.mark.asyncio
async def test_a_kill_grace_leaves_the_event_loop_free_beside_many_processes() -> None:
    """Whether a leftover group still had a live member was asked of every process's
    /proc/<pid>/stat on the event loop, every 50 ms of the grace: beside about 2,150 processes
    each look took about 100 ms, and the worker's loop (heartbeats, claims, the other jobs) was
    busy for most of the grace. Measured as the CPU the loop's thread spends during a grace beside
    1,500 more processes: the CPU time of its thread, not wall time, which a loaded host stretches."""
    crowd = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CROWD, "1500", shutil.which("sleep") or "/bin/sleep",
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    assert crowd.stdin is not None and crowd.stdout is not None
    try:
        assert await asyncio.wait_for(crowd.stdout.readline(), 60) == b"ready\n"
        leftover = await _leftover(ignore_term=True)
        started = time.thread_time()
        assert await procgroup.kill_process_group(leftover.pid, grace_s=1.0)
        busy_s = time.thread_time() - started
        await leftover.communicate()
        assert leftover.returncode == -signal.SIGKILL  # it ignored SIGTERM: the grace ran to its end
    finally:
        crowd.stdin.close()
        await crowd.wait()
    assert busy_s < 0.1, f"the event loop's thread spent {busy_s:.3f} s of CPU in a 1 s grace"
