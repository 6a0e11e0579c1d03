"""Several API processes on one port (`GPUJOBS_API_PROCESSES` = N > 1): a parent that keeps N
children serving the socket it bound.

The children share the listening socket: the child the kernel wakes first accepts the connections
waiting (asyncio takes up to its backlog at a wake-up), so a burst may land on one child, and
connections spread out only as they come at different times (docs/operations.md). Only child 0
runs the in-process worker. A child that dies is started again (after a pause if it died young);
one that could not start at all on its first try (a database, a setting) ends the whole command
with its exit code. The parent does no HTTP itself: it waits on the
children and on SIGTERM/SIGINT, which it passes on. Each child is one app/apiserver.py process.
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
from typing import TYPE_CHECKING, Any, Final

from app import apiserver, errors

if TYPE_CHECKING:
    from app.settings import Settings

log = logging.getLogger("gpujobs.serve")

# A child that dies this soon after its start waits before the next start, doubling to the cap.
YOUNG_S: Final = 10.0
PAUSE_FIRST_S: Final = 0.5
PAUSE_MAX_S: Final = 30.0
# After the children were told to stop at once, how long they have before SIGKILL.
KILL_AFTER_S: Final = 5.0


def _child_main(settings: Settings, sock: socket.socket, parent: int) -> None:
    """A child's whole life (a fresh interpreter: multiprocessing's spawn)."""
    from app import logs

    logs.setup(settings.log_level, settings.log_format, stream=sys.stderr)
    # Out of the terminal's process group: Ctrl-C reaches the parent alone, which passes SIGTERM on
    # (a child that shut down by itself first would be taken for one that died, and started again).
    os.setpgid(0, 0)
    _end_with_parent(parent)
    try:
        code = apiserver.serve_app(settings, sock)
    except errors.AppError as exc:  # said in one line, as by `gpujobs serve` in one process
        print(f"error: {exc.message}", file=sys.stderr, flush=True)
        code = apiserver.REFUSED
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
        elif now - self._asked_at >= apiserver.REPEAT_S:
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
        if child.first and code in (apiserver.START_FAILED, apiserver.REFUSED):
            log.error("API process %d (pid %s) could not start; stopping the others", child.index, pid)
            self.exit_code = code
            self._stop.set()
            return
        lived_s = time.monotonic() - child.started
        pause_s = min(max(child.pause_s * 2, PAUSE_FIRST_S), PAUSE_MAX_S) if lived_s < YOUNG_S else 0.0
        what = "the in-process worker failed" if code == apiserver.WORKER_FAILED else _exit_text(code)
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
            if self._force.is_set() and again is None and now - first >= apiserver.REPEAT_S:
                log.warning("asked again: the API processes stop at once (their worker's models killed)")
                self._signal_children(signal.SIGTERM)
                again, self.exit_code = now, self.exit_code or apiserver.STOPPED_NOW
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
