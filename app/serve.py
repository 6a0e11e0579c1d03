"""`gpujobs serve`: the HTTP API in one process, or in several that share one port.

One process is the default. An upload costs the API several milliseconds of CPU (the multipart
form, the image check, the hash, the send of the megabyte), and one Python process uses one core,
so on a host with cores to spare one process is the bound on uploads long before PostgreSQL is
(tests/bench/README.md). With `GPUJOBS_API_PROCESSES` = N > 1 a parent binds the port once and
keeps N children serving it: the kernel hands each new connection to a child that is waiting in
`accept`, so a busy child takes no more. Only child 0 runs the in-process worker. A child that
dies is started again (after a pause if it died young); one that could not start at all on its
first try (a database, a setting) ends the whole command with its exit code. The parent
does no HTTP itself: it waits on the children and on SIGTERM/SIGINT, which it passes on.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from types import FrameType
from typing import TYPE_CHECKING, Any, Final

from app import errors

if TYPE_CHECKING:
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
# A child that dies this soon after its start waits before the next start, doubling to the cap.
YOUNG_S: Final = 10.0
PAUSE_FIRST_S: Final = 0.5
PAUSE_MAX_S: Final = 30.0
# A signal this soon after the first is that one delivered twice (`timeout` signals its child, then
# its process group, the child included), not an operator asking again.
REPEAT_S: Final = 1.0
# After the children were told to stop at once, how long they have before SIGKILL.
KILL_AFTER_S: Final = 5.0


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
        # The default asyncio loop: subprocess start is several times slower under uvloop.
        loop="asyncio",
        log_level=settings.log_level.lower(),
        access_log=False,
        log_config=None,  # our logging (logs.setup): one format for every line
        timeout_graceful_shutdown=5,  # open event streams must not hold a shutdown forever
    )


def listen(host: str, port: int, *, backlog: int = 2048) -> socket.socket:
    """A socket listening on host:port, for uvicorn to serve; ConfigError naming the settings if
    the address cannot be had (in use, or no address of this host).

    Bound before the app starts: uvicorn given only host and port runs the app's start-up, which
    starts the in-process worker, before it binds, so a port in use was found after the worker had
    claimed jobs. Listening at once also keeps the port from a second `serve` starting beside
    this one (two sockets with SO_REUSEADDR may both bind a port that none listens on yet)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # as uvicorn chooses
    sock = socket.socket(family)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        where = f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"
        raise errors.ConfigError(
            f"GPUJOBS_HOST/GPUJOBS_PORT (--host/--port): cannot listen on {where}: {exc}"
        ) from exc
    return sock


def run(settings: Settings, processes: int, sock: socket.socket) -> int:
    """Serve on `sock` (listening) in this process, or in `processes` of them; the exit code."""
    host, port = sock.getsockname()[:2]
    log.info("listening on http://%s:%d", f"[{host}]" if sock.family == socket.AF_INET6 else host, port)
    if processes == 1:
        return serve_app(settings, sock)
    return serve_processes(settings, processes, sock)


def serve_app(settings: Settings, sock: socket.socket) -> int:
    """Run the app in this process on `sock` (listening) until it is asked to stop; the exit code
    `gpujobs serve` gives. A signal's comes as SystemExit (143 on SIGTERM: cli._exit_on_sigterm),
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
    # SIGTERM's SystemExit (_exit_on_sigterm), SIGINT's KeyboardInterrupt (asyncio's handler).
    except (SystemExit, KeyboardInterrupt):
        refused: errors.AppError | None = getattr(app.state, "start_refused", None)
        if refused is not None:
            raise refused from None  # for the CLI to say in one line, exit 2
        if getattr(app.state, "asked_again", False):
            raise SystemExit(STOPPED_NOW) from None
        raise
    if getattr(app.state, "asked_again", False):
        raise SystemExit(STOPPED_NOW)
    if not server.started:  # the start-up failed (said in the log)
        return START_FAILED
    if getattr(app.state, "worker_failed", False):  # as `worker` does: a supervisor starts it again
        return WORKER_FAILED
    return 0


def _server(config: uvicorn.Config, app: FastAPI) -> uvicorn.Server:
    """uvicorn's server, but that a signal to exit tells the app at once (`app.state.on_exit`:
    its worker stops claiming, its event streams end), not once open connections have closed or
    timeout_graceful_shutdown has passed. A second signal (REPEAT_S or more after the first), a
    SIGTERM as well as uvicorn's second Ctrl-C, stops at once: the worker kills its models and
    hands its jobs back (`app.state.on_exit_now`), and open connections are not waited for."""
    import uvicorn

    class Server(uvicorn.Server):
        asked_at: float | None = None

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            now = time.monotonic()
            again = self.asked_at is not None and now - self.asked_at >= REPEAT_S
            self.asked_at = self.asked_at or now
            super().handle_exit(sig, frame)
            if again:
                self.force_exit = True
                app.state.asked_again = True  # serve_app's exit code says so
            hook = "on_exit_now" if again else "on_exit"
            on_exit: Callable[[], None] | None = getattr(app.state, hook, None)
            if on_exit is not None:  # None while the app starts: it has no worker or stream yet
                on_exit()

    return Server(config)


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


def _child_main(settings: Settings, sock: socket.socket, parent: int) -> None:
    """A child's whole life (a fresh interpreter: multiprocessing's spawn)."""
    from app import logs

    logs.setup(settings.log_level, settings.log_format, stream=sys.stderr)
    # Out of the terminal's process group: Ctrl-C reaches the parent alone, which passes SIGTERM on
    # (a child that shut down by itself first would be taken for one that died, and started again).
    os.setpgid(0, 0)
    _end_with_parent(parent)
    try:
        code = serve_app(settings, sock)
    except errors.AppError as exc:  # said in one line, as by `gpujobs serve` in one process
        print(f"error: {exc.message}", file=sys.stderr, flush=True)
        code = REFUSED
    sys.exit(code)


def _end_with_parent(parent: int) -> None:
    """Have Linux send this process SIGTERM when its parent dies (SIGKILL, a crash), so a child
    never goes on serving the port alone; elsewhere, nothing."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() != parent:  # it died before the call above
        sys.exit(0)


@dataclass
class _Child:
    index: int
    process: BaseProcess
    started: float
    first: bool  # its first start: a start-up failure then ends the command
    pause_s: float = 0.0  # the pause before its next start, if it dies young


class Supervisor:
    """The parent of N API processes on one listening socket."""

    def __init__(
        self,
        settings: Settings,
        processes: int,
        sock: socket.socket,
        *,
        on_child_exit: Callable[[int], None] = lambda _pid: None,
    ) -> None:
        self._settings = settings
        self._processes = processes
        self._sock = sock
        self._on_child_exit = on_child_exit
        self._context = multiprocessing.get_context("spawn")
        self._children: dict[int, _Child] = {}
        self._restart_at: dict[int, tuple[float, float]] = {}  # index -> (when, pause used)
        self._stop = threading.Event()
        self._force = threading.Event()  # asked to stop again while stopping: at once
        self._asked_at: float | None = None  # when stop() was first called
        self.exit_code = 0

    def stop(self) -> None:
        """Stop the children gracefully; asked again while they stop (REPEAT_S or more later), at once."""
        now = time.monotonic()
        if self._asked_at is None:
            self._asked_at = now
        elif now - self._asked_at >= REPEAT_S:
            self._force.set()
        self._stop.set()

    def run(self) -> int:
        """Start the children and keep them running until stopped; then stop them, and wait."""
        try:  # a start that fails stops those already started
            for index in range(self._processes):
                self._start(index, first=True, pause_s=0.0)
            while not self._stop.is_set():
                self._reap(timeout_s=0.2)
                self._restart_due()
        finally:
            self._stop_all()
        return self.exit_code

    def pids(self) -> dict[int, int]:
        """Each live child's pid, by index."""
        return {i: c.process.pid for i, c in self._children.items() if c.process.pid is not None}

    def _start(self, index: int, *, first: bool, pause_s: float) -> None:
        settings = self._settings.model_copy(update={"run_worker": self._settings.run_worker and index == 0})
        process = self._context.Process(
            target=_child_main,
            args=(settings, self._sock, os.getpid()),
            name=f"gpujobs-api-{index}",
        )
        process.start()
        self._children[index] = _Child(index, process, time.monotonic(), first, pause_s)
        log.info("API process %d started (pid %s)", index, process.pid)

    def _reap(self, *, timeout_s: float) -> None:
        sentinels = {c.process.sentinel: c for c in self._children.values()}
        for ended in multiprocessing.connection.wait(list(sentinels), timeout=timeout_s):
            child = sentinels[ended]  # type: ignore[index]
            child.process.join()
            del self._children[child.index]
            self._ended(child)

    def _ended(self, child: _Child) -> None:
        code, pid = child.process.exitcode, child.process.pid
        if pid is not None:
            self._on_child_exit(pid)
        if self._stop.is_set():
            return
        if child.first and code in (START_FAILED, REFUSED):
            log.error("API process %d (pid %s) could not start; stopping the others", child.index, pid)
            self.exit_code = code
            self._stop.set()
            return
        lived_s = time.monotonic() - child.started
        pause_s = min(max(child.pause_s * 2, PAUSE_FIRST_S), PAUSE_MAX_S) if lived_s < YOUNG_S else 0.0
        what = "the in-process worker failed" if code == WORKER_FAILED else _exit_text(code)
        log.error(
            "API process %d (pid %s) ended (%s) after %.1f s; starting it again in %.1f s",
            child.index, pid, what, lived_s, pause_s,
        )  # fmt: skip
        self._restart_at[child.index] = (time.monotonic() + pause_s, pause_s)

    def _restart_due(self) -> None:
        now = time.monotonic()
        for index, (when, pause_s) in list(self._restart_at.items()):
            if when <= now and not self._stop.is_set():
                del self._restart_at[index]
                self._start(index, first=False, pause_s=pause_s)

    def _stop_all(self) -> None:
        """SIGTERM to every child (each shuts down gracefully: streams, its worker's jobs), then wait;
        asked again meanwhile, a second SIGTERM (each stops at once: its worker kills its models and
        hands its jobs back, within 2 s), and SIGKILL to those still there KILL_AFTER_S later.

        The port is let go of first: each child closes its copy as it begins to stop, and with
        this one kept open until the last had exited, the kernel went on accepting connections
        that nobody would serve (they hung, then were reset); now they are refused at once."""
        self._sock.close()
        self._signal_children(signal.SIGTERM)
        first = time.monotonic()
        again: float | None = None  # when the children were told again
        killed = False
        while self._children:
            now = time.monotonic()
            # Told no sooner than REPEAT_S after the first: a child takes a sooner one for the first.
            if self._force.is_set() and again is None and now - first >= REPEAT_S:
                log.warning("asked again: the API processes stop at once (their worker's models killed)")
                self._signal_children(signal.SIGTERM)
                again, self.exit_code = now, self.exit_code or STOPPED_NOW
            if again is not None and not killed and now - again >= KILL_AFTER_S:
                log.warning("killing the API processes still stopping")
                self._signal_children(signal.SIGKILL)
                killed = True
            self._reap(timeout_s=0.2)

    def _signal_children(self, sig: signal.Signals) -> None:
        for child in self._children.values():
            if child.process.pid is not None:
                with contextlib.suppress(OSError):
                    os.kill(child.process.pid, sig)


def _exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


@contextlib.contextmanager
def _metrics_dir() -> Iterator[None]:
    """A private folder for the children's per-process metrics (prometheus_client's multiprocess
    mode), unless the operator named one; removed on the way out."""
    from app import metrics

    if metrics.multiprocess_dir():
        yield
        return
    folder = tempfile.mkdtemp(prefix="gpujobs-metrics-")
    os.environ[metrics.MULTIPROC_DIR_VAR] = folder
    try:
        yield
    finally:
        os.environ.pop(metrics.MULTIPROC_DIR_VAR, None)
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def _signals_stop(supervisor: Supervisor) -> Iterator[None]:
    def stop(signum: int, _frame: Any) -> None:
        log.info("%s: stopping the API processes (again: at once)", signal.Signals(signum).name)
        supervisor.stop()

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def serve_processes(settings: Settings, processes: int, sock: socket.socket) -> int:
    """Keep `processes` children serving `sock` (listening); the exit code."""
    from app import metrics

    with _metrics_dir():
        # An ended child's live gauges leave the shared metrics; its counters stay.
        supervisor = Supervisor(settings, processes, sock, on_child_exit=metrics.mark_process_dead)
        with _signals_stop(supervisor):
            return supervisor.run()
