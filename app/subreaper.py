"""Subreaper: the worker as the parent of what escapes its runs.

A model may leave a process behind that neither its run's process-group kill nor its pipes show
(a daemon: fork, setsid, stdin, stdout and stderr on /dev/null). Without a subreaper it went to
init, and lived until the worker's next reap round read every process's environment (a few
seconds); meanwhile its lane went to the next job, maybe another user's, whose outputs it could
replace. Once the worker is a child subreaper (Linux: prctl(PR_SET_CHILD_SUBREAPER)), such a
process becomes the worker's own child when its run's process exits: right after the run, a
look at the worker's few children (not at every process on the host) finds it, by its run's
marker, and it is killed and reaped before the run's outputs are read and its lane reused.

Only a child identified as a stray is ever waited for (asyncio and subprocess wait for their own
children: stealing a status made their run fail), and only a zombie that was one already at the
worker's previous round and that no code of this process spawned (`reap_zombies`).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Set
from pathlib import Path

log = logging.getLogger("gpujobs.worker")

PR_SET_CHILD_SUBREAPER = 36
_KILL_ROUNDS = 64  # a stray's own children come to the worker once it is dead: looked for again
_TASKS = Path("/proc/self/task")

_active = False  # whether this process is a child subreaper
_spawned: set[int] = set()  # children this process started and waits for itself
_claimed: set[int] = set()  # strays killed, being waited for: no other look takes them


def become() -> bool:
    """Make this process a child subreaper (Linux; once per process); whether it is one. Elsewhere,
    or refused, nothing changes: strays are left to the reap round's scan, as before."""
    global _active
    if _active or not sys.platform.startswith("linux"):
        return _active
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        _active = libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        _active = False
    if not _active:
        log.warning("could not become a child subreaper: strays are left to the reap round")
    return _active


def spawned(pid: int) -> None:
    """Note a child this process started and waits for itself: never read, killed nor reaped here."""
    _spawned.add(pid)


def exited(pid: int) -> None:
    """Forget a child noted by `spawned`, once it was waited for."""
    _spawned.discard(pid)


def children(*, every_thread: bool = False) -> list[int]:
    """This process's children. An orphan comes to the main thread (the kernel gives it to the
    subreaper's first live thread), a child spawned on the loop to the loop's thread: those two
    lists are read (a few microseconds), every thread's with `every_thread` (for the reap round)."""
    if every_thread:
        try:
            tids = [int(name) for name in os.listdir(_TASKS)]
        except OSError:
            return []
    else:
        tids = list(dict.fromkeys((os.getpid(), threading.get_native_id())))
    found: list[int] = []
    for tid in tids:
        try:
            found += map(int, _read(f"/proc/self/task/{tid}/children").split())
        except OSError:  # no such file (no procfs, an old kernel), or the thread ended
            continue
    return found


def _read(path: str) -> bytes:
    """A small /proc file whole (os.read: a third of what a Python file object costs per job)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = [os.read(fd, 65536)]
        while chunks[-1]:
            chunks.append(os.read(fd, 65536))
        return b"".join(chunks)
    finally:
        os.close(fd)


def _environ(pid: int) -> bytes:
    """A process's environment as the kernel shows it (empty for a zombie, or when unreadable)."""
    try:
        return _read(f"/proc/{pid}/environ")
    except OSError:
        return b""


async def kill_strays(is_stray: Callable[[bytes], bool], **log_extra: str) -> int:
    """SIGKILL and reap every child of this process whose environment `is_stray` (a run's marker,
    of a run that is over), then its children, which come to this process as it dies; how many.
    Nothing is done unless this process is a subreaper."""
    killed = 0
    for _ in range(_KILL_ROUNDS):
        found = [
            pid
            for pid in (children() if _active else ())
            if pid not in _spawned and pid not in _claimed
            if is_stray(_environ(pid)) and _kill(pid, log_extra)
        ]
        if not found:
            break
        _claimed.update(found)
        await asyncio.to_thread(_reap, found)
        killed += len(found)
    return killed


def _kill(pid: int, log_extra: dict[str, str]) -> bool:
    """SIGKILL a stray (our child, not reaped yet: its pid is not reused); whether it was. One we
    may not signal (it took another user's id) is not waited for: that wait might never end."""
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        return False
    extra = {"action": "orphan_killed", "pid": pid, **log_extra}
    log.warning("killed a process its run left behind", extra=extra)
    return True


def _reap(pids: list[int]) -> None:
    """Wait for killed strays (a thread: a process in the kernel's uninterruptible sleep dies late)."""
    for pid in pids:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass
        finally:
            _claimed.discard(pid)


def reap_zombies(earlier: Set[int]) -> set[int]:
    """Reap this process's zombie children that were zombies at the previous look too (`earlier`,
    what the last call returned) and that no code here spawned: strays that ended by themselves.
    (asyncio and subprocess reap their own within milliseconds.) Returns the zombies seen now."""
    zombies: set[int] = set()
    if not _active:
        return zombies
    for pid in children(every_thread=True):
        if pid in _spawned or pid in _claimed or not _is_zombie(pid):
            continue
        if pid not in earlier:
            zombies.add(pid)
            continue
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            continue
        log.info("reaped a process a run left behind", extra={"action": "orphan_reaped", "pid": pid})
    return zombies


def _is_zombie(pid: int) -> bool:
    """Whether `pid` is a zombie (ended, waiting to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()
    except OSError:
        return False
    return bool(fields) and fields[0] == b"Z"
