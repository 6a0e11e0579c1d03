"""Tests for app.procgroup: leftover process groups killed, with real processes (no mocks)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import pytest

from app import procgroup

GRACE_S = 0.3


@pytest.mark.asyncio
@pytest.mark.parametrize("ignore_term", [False, True])
async def test_kill_process_group_of_a_leftover(ignore_term: bool) -> None:
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
    assert await procgroup.kill_process_group(leftover.pid, grace_s=GRACE_S)
    await leftover.communicate()
    assert leftover.returncode == (-signal.SIGKILL if ignore_term else -signal.SIGTERM)
    assert not await procgroup.kill_process_group(leftover.pid, grace_s=GRACE_S)


@pytest.mark.asyncio
@pytest.mark.parametrize("pgid", [-3, 0, 1, None])
async def test_kill_process_group_refuses_dangerous_groups(pgid: int | None) -> None:
    with pytest.raises(ValueError):
        await procgroup.kill_process_group(os.getpgid(0) if pgid is None else pgid, grace_s=0.1)
