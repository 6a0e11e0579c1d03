"""A model's progress: the `PROGRESS <fraction> [message]` lines it prints, and their delivery.

Updates reach their callback in order from a task of their own (`ProgressFeed`), so a slow
callback (a database write) never holds up the reader of the model's output. One-shot runs
(app/runner.py) and warm runners (app/warm.py) both feed theirs through one.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import math
from collections.abc import Awaitable, Callable

_LOG = logging.getLogger("gpujobs.runner")  # part of a run's story: logged under the runner's name
_PROGRESS_BACKLOG = 1000  # undelivered progress updates kept; the oldest are dropped beyond this
_PROGRESS_DRAIN_S = 5.0  # after a run's end, how long queued progress updates may take to deliver

ProgressCallback = Callable[[float, str], Awaitable[None]]


def parse_progress(line: str) -> tuple[float, str] | None:
    """Parse `PROGRESS <fraction> [message]` into (fraction clamped to [0, 1], message); else None."""
    parts = line.strip().split(maxsplit=2)
    if len(parts) < 2 or parts[0] != "PROGRESS":
        return None
    try:
        fraction = float(parts[1])
    except ValueError:
        return None
    if math.isnan(fraction):
        return None
    return min(max(fraction, 0.0), 1.0), parts[2] if len(parts) == 3 else ""


class ProgressFeed:
    """Progress updates handed to a callback in order, from a task of their own that starts with
    the first update: a slow callback (a database write) never holds up the reader of the model's
    output. At most _PROGRESS_BACKLOG wait; beyond that the oldest is dropped. Its failures are
    logged, never raised. One-shot runs and warm runners both feed theirs through one."""

    def __init__(self, callback: ProgressCallback, name: str) -> None:
        self._callback, self._name = callback, name
        self._context = contextvars.copy_context()  # its maker's (the job's), not the first put()'s
        self._updates: asyncio.Queue[tuple[float, str]] | None = None
        self._task: asyncio.Task[None] | None = None

    def put(self, fraction: float, message: str) -> None:
        """Queue an update for the callback."""
        if self._updates is None:
            self._updates = asyncio.Queue(maxsize=_PROGRESS_BACKLOG)
            self._task = asyncio.get_running_loop().create_task(
                self._deliver(self._updates), name=self._name, context=self._context
            )
        if self._updates.full():
            self._updates.get_nowait()
            self._updates.task_done()
        self._updates.put_nowait((fraction, message))

    async def drain(self) -> None:
        """Deliver what is queued (for at most _PROGRESS_DRAIN_S), then end the task."""
        if self._task is None or self._updates is None:
            return
        try:
            await asyncio.wait_for(self._updates.join(), _PROGRESS_DRAIN_S)
        except TimeoutError:
            _LOG.warning("progress callback too slow; dropping updates", extra={"action": "progress_dropped"})
        self.cancel()
        await asyncio.gather(self._task, return_exceptions=True)

    def cancel(self) -> None:
        """Deliver nothing more."""
        if self._task is not None:
            self._task.cancel()

    async def _deliver(self, updates: asyncio.Queue[tuple[float, str]]) -> None:
        while True:
            fraction, message = await updates.get()
            try:
                await self._callback(fraction, message)
            except Exception:
                _LOG.exception("progress callback failed", extra={"action": "progress_callback_failed"})
            finally:
                updates.task_done()
