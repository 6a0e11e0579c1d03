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


def signal_group(pgid: int, sig: int) -> bool:
    """Send `sig` to a process group; False when no process of ours is in it."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):  # gone, or now someone else's: not ours to kill
        return False
    return True


async def kill_process_group(pgid: int, *, grace_s: float) -> bool:
    """SIGTERM a leftover group, SIGKILL it after `grace_s`; True if anything was there.

    Refuses (ValueError) pgid <= 1 and our own group: a recorded pid may be reused after a restart.
    """
    if pgid <= 1 or pgid == os.getpgid(0):
        raise ValueError(f"refusing to kill process group {pgid}")
    if not signal_group(pgid, signal.SIGTERM):
        return False
    _LOG.warning("killing leftover process group", extra={"action": "leftover_group_killed", "pid": pgid})
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not _group_alive(pgid):
            return True
        await asyncio.sleep(_POLL_S)
    signal_group(pgid, signal.SIGKILL)
    return True


def _group_alive(pgid: int) -> bool:
    """Whether the group has a member that is not a zombie (zombies only wait to be reaped)."""
    if not signal_group(pgid, 0):
        return False
    if not Path("/proc/self/stat").exists():  # no procfs: zombies cannot be told apart
        return True
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:  # the process went away while we looked
            continue
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":
            return True
    return False
