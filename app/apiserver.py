"""One API process of `gpujobs serve`: uvicorn's settings, its server, and the exit code it gives.

The server tells the app at once when it is asked to stop (its worker stops claiming, its event
streams end), and stops at once when asked again. The exit code tells a supervisor how it ended:
a graceful stop, a forced one, a worker that failed, or a start-up that failed or was refused.
Several of these processes on one port: app/supervisor.py.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Final

from app import errors

if TYPE_CHECKING:
    import socket

    import uvicorn
    from fastapi import FastAPI
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

    from app.settings import Settings

log = logging.getLogger("gpujobs.serve")

# Exit codes, as `gpujobs serve` in one process gives them.
WORKER_FAILED: Final = 1  # the in-process worker stopped after an error
STOPPED_NOW: Final = 1  # asked again while stopping: stopped at once, as `gpujobs worker` exits then
REFUSED: Final = 2  # the app's start-up refused a setting (its worker cannot start): said in one line
START_FAILED: Final = 3  # uvicorn could not start (the app's start-up failed otherwise)
# A signal this soon after the first is that one delivered twice (`timeout` signals its child, then
# its process group, the child included), not an operator asking again.
REPEAT_S: Final = 1.0
# After a forced stop, how long requests in flight have to end once their connections are closed.
FORCED_REQUESTS_S: Final = 1.0


def uvicorn_config(app: ASGIApp, settings: Settings, host: str, port: int) -> uvicorn.Config:
    """The server's settings, the same in one process and in each of several."""
    import uvicorn

    from app.api import connections

    return uvicorn.Config(
        app,
        host=host,
        port=port,
        # A request's head bounded in size and time (uvicorn's own waits for it for ever).
        http=connections.protocol(settings.client_timeout_s),
        # An idle kept-alive connection is closed by that protocol once the client timeout has
        # passed with no request (README): uvicorn's own 5 s closed it first, under a client or
        # proxy that reuses connections for longer, whose next request then met a closed socket.
        timeout_keep_alive=math.ceil(settings.client_timeout_s) + 1,
        # The default asyncio loop: subprocess start is several times slower under uvloop.
        loop="asyncio",
        log_level=settings.log_level.lower(),
        access_log=False,
        log_config=None,  # our logging (logs.setup): one format for every line
        timeout_graceful_shutdown=5,  # open event streams must not hold a shutdown forever
    )


def serve_app(settings: Settings, sock: socket.socket) -> int:
    """Run the app in this process on `sock` (listening) until it is asked to stop; the exit code
    `gpujobs serve` gives. A signal's comes as SystemExit (143 on SIGTERM: sigterm.exit_on_sigterm),
    but after a forced stop (asked again): SystemExit(STOPPED_NOW), as `gpujobs worker` exits then,
    so that a supervisor can tell a forced stop from a graceful one."""

    from app.api.main import create_app

    app = create_app(settings)
    host, port = sock.getsockname()[:2]
    server = _server(uvicorn_config(_QuietRefusal(app), settings, host, port), app)
    app.state.on_worker_failed = lambda: setattr(server, "should_exit", True)
    try:
        server.run(sockets=[sock])
    # uvicorn's when the start-up failed, or the signals it raises again once it has shut down:
    # SIGTERM's SystemExit (sigterm.exit_on_sigterm), SIGINT's KeyboardInterrupt (asyncio's handler).
    except (SystemExit, KeyboardInterrupt):
        refused: errors.AppError | None = getattr(app.state, "start_refused", None)
        if refused is not None:
            raise refused from None  # for the CLI to say in one line, exit 2
        if getattr(app.state, "asked_again", False):
            raise SystemExit(STOPPED_NOW) from None
        raise
    if getattr(app.state, "asked_again", False):
        raise SystemExit(STOPPED_NOW)
    # uvicorn raised the signal again once it had shut down, under the handler it found: one that
    # ignores it (SIGINT in a shell's background job) made a stop by Ctrl-C or kill exit 0.
    if (stopped_by := getattr(app.state, "stopped_by", None)) is not None:
        raise SystemExit(128 + stopped_by)
    if not server.started:  # the start-up failed (said in the log)
        return START_FAILED
    if getattr(app.state, "worker_failed", False):  # as `worker` does: a supervisor starts it again
        return WORKER_FAILED
    return 0


def _server(config: uvicorn.Config, app: FastAPI) -> uvicorn.Server:
    """uvicorn's server, that tells the app of a stop at once and stops at once when asked again
    (app/uvserver.py: imported here, where a process serves)."""
    from app import uvserver

    return uvserver.Server(config, app)


class _QuietRefusal:
    """The app, but for the traceback uvicorn logs of a start-up the app refused with an AppError
    (`app.state.start_refused`: its worker cannot start), which the app logged in one line, and
    `gpujobs serve` says in one more."""

    def __init__(self, app: FastAPI) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            return await self._app(scope, receive, send)

        async def quiet(message: Message) -> None:
            refused = getattr(self._app.state, "start_refused", None) is not None
            if message["type"] == "lifespan.startup.failed" and refused:
                message = {**message, "message": ""}  # Starlette's traceback of it
            await send(message)

        await self._app(scope, receive, quiet)
