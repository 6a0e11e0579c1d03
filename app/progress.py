"""A model's progress: the `PROGRESS <fraction> [message]` lines it prints, and their delivery.

Updates reach their callback in order from a task of their own (`ProgressFeed`), so a slow
callback (a database write) never holds up the reader of the model's output. The feed is also the
throttle: at most one update per PROGRESS_INTERVAL_S, the newest winning, so a model printing
progress in a tight loop costs a few writes a second and its run's end waits for one write at most.
One-shot runs (app/runner.py) and warm runners (app/warm.py) both feed theirs through one.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import math
from collections.abc import Awaitable, Callable

_LOG = logging.getLogger("gpujobs.runner")  # part of a run's story: logged under the runner's name
PROGRESS_INTERVAL_S = 0.25  # the least time between two updates handed to the callback
_PROGRESS_DRAIN_S = 5.0  # after a run's end, how long its last updates may take to deliver

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
    output. Only the newest undelivered update is kept, and it waits until PROGRESS_INTERVAL_S has
    passed since the last delivery: the first goes at once, the ones printed in between are never
    delivered (each was a database write and a NOTIFY; a 1,000-deep queue of them took seconds to
    drain after the model had exited, while its job held the GPU slot). The drain delivers the last
    one without waiting out the interval, so a run's final word is never lost. Its failures are
    logged, never raised. One-shot runs and warm runners both feed theirs through one."""

    def __init__(self, callback: ProgressCallback, name: str) -> None:
        self._callback, self._name = callback, name
        self._context = contextvars.copy_context()  # its maker's (the job's), not the first put()'s
        self._newest: tuple[float, str] | None = None
        self._waiting = asyncio.Event()  # set while an update is kept for delivery, or at the end
        self._ending = asyncio.Event()  # the run has ended: deliver what is kept, then stop
        self._task: asyncio.Task[None] | None = None

    def put(self, fraction: float, message: str) -> None:
        """Keep an update for the callback, in place of any not yet delivered."""
        self._newest = (fraction, message)
        self._waiting.set()
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._deliver(), name=self._name, context=self._context
            )

    async def drain(self) -> None:
        """Deliver the update kept, if any, at once (for at most _PROGRESS_DRAIN_S), then end the task."""
        if self._task is None:
            return
        self._ending.set()
        self._waiting.set()
        _, late = await asyncio.wait({self._task}, timeout=_PROGRESS_DRAIN_S)
        if late:
            _LOG.warning("progress callback too slow; dropping updates", extra={"action": "progress_dropped"})
        self.cancel()
        await asyncio.gather(self._task, return_exceptions=True)

    def cancel(self) -> None:
        """Deliver nothing more."""
        if self._task is not None:
            self._task.cancel()

    async def _deliver(self) -> None:
        """Hand the newest update on, then hold off for the interval (cut short by the drain)."""
        while not (self._ending.is_set() and self._newest is None):
            await self._waiting.wait()
            self._waiting.clear()
            if self._newest is None:  # woken by the drain with nothing kept
                continue
            fraction, message = self._newest
            self._newest = None
            try:
                await self._callback(fraction, message)
            except Exception:
                _LOG.exception("progress callback failed", extra={"action": "progress_callback_failed"})
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._ending.wait(), PROGRESS_INTERVAL_S)
