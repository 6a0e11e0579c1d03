"""asyncio's child processes, with their exit noticed as soon as it happens.

Warm runners (app/warm.py) start theirs with `spawn()`: they also write to their child's stdin,
which asyncio's streams do well. One-shot runs (app/runner.py) do without asyncio's transports,
protocols and child watcher, which cost more CPU than starting `/bin/true` does. A worker calls
`prefer_pidfd_watcher()` once, so that Python 3.11 does not start a thread per child to learn of
its exit.
"""

from __future__ import annotations

import asyncio
import os
import sys
import warnings
from collections.abc import Sequence
from typing import Any

from app import subreaper


class _ExitProtocol(asyncio.subprocess.SubprocessStreamProtocol):
    """asyncio's stream protocol, plus a future done as soon as the process has exited."""

    def __init__(self, limit: int, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(limit=limit, loop=loop)
        self.exited: asyncio.Future[None] = loop.create_future()

    def process_exited(self) -> None:
        super().process_exited()
        if not self.exited.done():
            self.exited.set_result(None)


class Process(asyncio.subprocess.Process):
    """asyncio's Process, whose `exited()` returns as soon as the process ends.

    `wait()` in Python 3.11 also waits for the pipes to close (a forked helper may hold them), and
    polling `returncode` adds its interval to every run: tens of milliseconds on a quick job.
    """

    def __init__(self, transport: Any, protocol: _ExitProtocol, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(transport, protocol, loop)
        self._exited = protocol.exited
        self._pipes = transport  # asyncio's private `_transport`, which close_pipes() closes

    async def exited(self) -> int:
        """The return code, once the process has exited (safe to cancel)."""
        await asyncio.shield(self._exited)
        assert self.returncode is not None
        return self.returncode

    async def close_pipes(self, readers: Sequence[asyncio.Task[None]], drain_s: float) -> None:
        """Once it has exited: let `readers` reach EOF, cancelled after `drain_s` (a process it left
        behind may hold a pipe open), then close its transport (no public close; it is reaped)."""
        if readers:
            _done, pending = await asyncio.wait(readers, timeout=drain_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*readers, return_exceptions=True)
        self._pipes.close()


async def spawn(*argv: str, limit: int, **kwargs: Any) -> Process:
    """`asyncio.create_subprocess_exec`, giving a `Process` whose exit is noticed at once."""
    loop = asyncio.get_running_loop()
    transport, protocol = await loop.subprocess_exec(lambda: _ExitProtocol(limit, loop), *argv, **kwargs)
    process = Process(transport, protocol, loop)
    pid = process.pid
    subreaper.spawned(pid)  # asyncio's to wait for: never taken for a stray
    protocol.exited.add_done_callback(lambda _: subreaper.exited(pid))
    return process


def prefer_pidfd_watcher() -> None:
    """On Python 3.11 use pidfds to learn of child exits (3.12+ does by itself).

    3.11's default watcher starts a thread per child process: measurable at hundreds of model
    runs a second. Call from inside the running loop.
    """
    if sys.version_info >= (3, 12) or not hasattr(os, "pidfd_open"):
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        if isinstance(asyncio.get_child_watcher(), asyncio.PidfdChildWatcher):
            return
        try:
            os.close(os.pidfd_open(os.getpid()))  # the kernel supports pidfds (Linux 5.3+)
        except OSError:
            return
        watcher = asyncio.PidfdChildWatcher()
        watcher.attach_loop(asyncio.get_running_loop())
        asyncio.set_child_watcher(watcher)
