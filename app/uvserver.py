"""uvicorn's server as an API process of `gpujobs serve` runs it (app/apiserver.py).

A signal to exit tells the app at once (`app.state.on_exit`: its worker stops claiming, its event
streams end), not once open connections have closed or timeout_graceful_shutdown has passed. A
second signal (REPEAT_S or more after the first), a SIGTERM as well as uvicorn's second Ctrl-C,
stops at once: the worker kills its models and hands its jobs back (`app.state.on_exit_now`), and
open connections are closed, not waited for. The app's lifespan ends all the same (uvicorn's skips
it when forced): its end is where the worker hands its jobs back, and without it they were left to
their leases. Only a process that serves imports this module: a worker alone never loads uvicorn.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn

from app.apiserver import FORCED_REQUESTS_S, REPEAT_S

if TYPE_CHECKING:
    from fastapi import FastAPI


class Server(uvicorn.Server):
    """uvicorn's server that tells `app` of a stop at once, and stops at once when asked again."""

    def __init__(self, config: uvicorn.Config, app: FastAPI) -> None:
        super().__init__(config)
        self._app_state = app.state
        self.asked_at: float | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        state, now = self._app_state, time.monotonic()
        again = self.asked_at is not None and now - self.asked_at >= REPEAT_S
        self.asked_at = self.asked_at or now
        state.stopped_by = getattr(state, "stopped_by", None) or sig
        super().handle_exit(sig, frame)
        if again:
            self.force_exit = True
            state.asked_again = True  # serve_app's exit code says so
            if self.loop is not None:
                with contextlib.suppress(RuntimeError):  # the loop has closed
                    self.loop.call_soon_threadsafe(self.close_connections)
        on_exit: Callable[[], None] | None = getattr(state, "on_exit_now" if again else "on_exit", None)
        if on_exit is not None:  # None while the app starts: it has no worker or stream yet
            on_exit()

    def close_connections(self) -> None:
        """Close every open connection: a request in flight reads a disconnect and ends."""
        for connection in list(self.server_state.connections):
            transport = getattr(connection, "transport", None)
            if transport is not None:
                transport.close()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await super().shutdown(sockets)
        shutdown_done = getattr(self.lifespan, "shutdown_event", None)
        if not self.force_exit or shutdown_done is None or shutdown_done.is_set():
            return
        self.close_connections()
        tasks = list(self.server_state.tasks)
        if tasks:  # the requests in flight, each now reading a disconnect
            _, late = await asyncio.wait(tasks, timeout=FORCED_REQUESTS_S)
            for task in late:
                task.cancel()
        await self.lifespan.shutdown()
