"""Process groups: a signal to every process of one, and the kill of a group left behind.

A model starts in a session of its own, so its pid is also its group's id and one signal to the
group reaches the helpers it forked (one that starts a session of its own leaves the group: the
worker finds those by their marker, app/queue/leftovers.py). A zombie member counts as gone: it
only waits for its parent to reap it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from pathlib import Path

_LOG = logging.getLogger("gpujobs.runner")  # part of a run's story: logged under the runner's name
_POLL_S = 0.05
_PROC = Path("/proc")


def signal_group(pgid: int, sig: int) -> bool:
    """Send `sig` to a process group; False when no process of ours is in it."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):  # gone, or now someone else's: not ours to kill
        return False
    return True


def refused(pgid: int) -> bool:
    """Whether `pgid` is init's (or none) or this process's own group: never a leftover model's (a
    recorded pid may be reused after a restart)."""
    return pgid <= 1 or pgid == os.getpgid(0)


async def kill_process_group(pgid: int, *, grace_s: float) -> bool:
    """SIGTERM a leftover group, SIGKILL it after `grace_s`; True if anything was there.

    Refuses (ValueError) what `refused` names.
    """
    if refused(pgid):
        raise ValueError(f"refusing to kill process group {pgid}")
    if not signal_group(pgid, signal.SIGTERM):
        return False
    _LOG.warning("killing leftover process group", extra={"action": "leftover_group_killed", "pid": pgid})
    deadline = time.monotonic() + grace_s
    members: set[int] = set()  # the group's live members at the last look through /proc
    while time.monotonic() < deadline:
        if not await _group_alive(pgid, members):
            return True
        await asyncio.sleep(_POLL_S)
    signal_group(pgid, signal.SIGKILL)
    return True


async def _group_alive(pgid: int, members: set[int]) -> bool:
    """Whether the group has a member that is not a zombie (zombies only wait to be reaped).

    Linux lists no group's members: finding them reads every process's /proc/<pid>/stat, tens of
    milliseconds of CPU beside a few thousand processes, which on the event loop held up the
    worker's heartbeats, claims and other jobs for most of a grace. So they are found in a thread,
    and only when none of `members` (updated here) is one still: while one lives, a look reads
    one file."""
    if not signal_group(pgid, 0):
        return False
    if not _PROC.joinpath("self", "stat").exists():  # no procfs: zombies cannot be told apart
        return True
    if any(_is_live_member(pid, pgid) for pid in members):
        return True
    members.clear()
    members.update(await asyncio.to_thread(_live_members, pgid))
    return bool(members)


def _live_members(pgid: int) -> set[int]:
    """The pids of the group's members that are not zombies, read from /proc."""
    return {int(name) for name in os.listdir(_PROC) if name.isdigit() and _is_live_member(int(name), pgid)}


def _is_live_member(pid: int, pgid: int) -> bool:
    """Whether `pid` is (still) in group `pgid` and not a zombie (a pid reused since is not)."""
    try:
        fields = _PROC.joinpath(str(pid), "stat").read_text().rpartition(")")[2].split()
    except OSError:  # the process went away while we looked
        return False
    return len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z"
