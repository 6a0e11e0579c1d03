"""Run one model as a subprocess in its own process group, with a log, progress, timeout and stop.

Kills go to the whole group (SIGTERM, `kill_grace_s`, SIGKILL); after the main process exits the group
gets a last SIGKILL, so forked helpers die too. Both pipes drain at once into the log; stdout progress
lines reach `on_progress` in order from a separate task (a slow callback never stalls the pipes) and
never after `wait()` returns. Call `stop()` and `wait()` from the event loop's thread.

`ModelProcess` starts the child with `subprocess.Popen` and reads it with the event loop's own
readiness callbacks: asyncio's subprocess transports, protocols and child watcher cost more CPU
than starting `/bin/true` does (warm runners, which also write to their child's stdin, keep it:
app/childprocess.py). Signals to the group and the kill of a leftover one: app/procgroup.py;
progress lines and their delivery: app/progress.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, TypeVar

from app import outputpipe, procgroup, progress, subreaper
from app.runlog import RunLog

_LOG = logging.getLogger("gpujobs.runner")
_T = TypeVar("_T")

_PIPE_DRAIN_S = 2.0  # after the group is dead, how long the pipes may take to reach EOF
_READ_BYTES = 64 * 1024  # at most this much of a pipe per read
_PASSED_THROUGH = ("PATH", "LANG", "LC_ALL", "TMPDIR", "PYTHONPATH")


@dataclass(frozen=True, slots=True)
class RunResult:
    """How one model run ended."""

    exit_code: int | None  # None when a signal ended it
    signal: int | None  # the signal that ended it (from a negative returncode)
    timed_out: bool
    stopped: str | None  # the reason given to stop(), when the stop ended the run
    duration_s: float
    log_tail: str  # the last TAIL_LINES lines / TAIL_BYTES bytes this run wrote to its log
    # A process outside the run's group still held its output pipes after it exited: one it
    # started in a session of its own, which the group's kill misses (the caller finds it by marker).
    escaped: bool = False

    @property
    def ok(self) -> bool:
        """Whether the model exited 0 by itself, without timeout or stop."""
        return self.exit_code == 0 and not self.timed_out and self.stopped is None


def minimal_env(gpu_index: int | None, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Build a model's environment: PATH, locale, TMPDIR, PYTHONPATH, its GPU, then `extra`; nothing else."""
    if gpu_index is not None and gpu_index < 0:
        raise ValueError(f"gpu_index must be >= 0, got {gpu_index}")
    env = {name: os.environ[name] for name in _PASSED_THROUGH if os.environ.get(name)}
    env.setdefault("PATH", os.defpath)
    env.setdefault("LANG", "C.UTF-8")
    env["CUDA_VISIBLE_DEVICES"] = "" if gpu_index is None else str(gpu_index)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


# Why a program cannot start that no retry mends: it is missing, not executable, or not a program.
# Anything else (no file descriptors, memory or processes left) is this host's passing trouble.
_NEVER_STARTS: Final = frozenset(
    {errno.ENOENT, errno.EACCES, errno.EPERM, errno.ENOEXEC, errno.ENOTDIR, errno.EISDIR, errno.ELOOP,
     errno.ENAMETOOLONG}
)  # fmt: skip


def cannot_start(exc: OSError) -> bool:
    """Whether a start's OSError says the program can never start here (a missing working folder
    says so too: the caller tells that apart)."""
    return exc.errno in _NEVER_STARTS


async def _finish_anyway(coro: Coroutine[Any, Any, _T]) -> _T:
    """Run cleanup to its end even if the caller is cancelled meanwhile, then re-raise that."""
    task = asyncio.create_task(coro, name="runner-cleanup")
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.cancelled():
                raise
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return task.result()


def _pidfd(pid: int) -> int | None:
    """A file descriptor that becomes readable when `pid` exits; None without pidfds (Linux < 5.3)."""
    if not hasattr(os, "pidfd_open"):
        return None
    try:
        return os.pidfd_open(pid)
    except OSError:  # ENOSYS, or no descriptor left: a thread will wait instead
        return None


class ModelProcess:
    """One model run: `start()`, optionally `stop(reason)`, and always `await wait()`.

    A run that prints no progress needs no task: the event loop reads the pipes (`add_reader`) and
    learns of the exit when the child's pidfd becomes readable (where pidfds are missing, a thread
    waits for the child). The progress task starts with the first update.
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        cwd: Path,
        env: Mapping[str, str],
        log_path: Path,
        timeout_s: float,
        kill_grace_s: float = 5.0,
        max_log_bytes: int = 0,
        on_progress: progress.ProgressCallback | None = None,
    ) -> None:
        if not argv:
            raise ValueError("argv is empty")
        if timeout_s <= 0 or kill_grace_s < 0:
            raise ValueError("timeout_s must be > 0 and kill_grace_s >= 0")
        self._argv = tuple(argv)
        self._cwd = cwd
        self._env = dict(env)
        self._log = RunLog(log_path, "runner", max_bytes=max_log_bytes)  # see app/runlog.py for the cap
        self._timeout_s = timeout_s
        self._kill_grace_s = kill_grace_s
        self._on_progress = on_progress
        self._popen: subprocess.Popen[bytes] | None = None
        self._pipes: list[outputpipe.OutputPipe] = []
        self._escaped = False  # see RunResult.escaped
        self._progress: progress.ProgressFeed | None = None  # made with the first update
        self._stop_reason: str | None = None
        self._started_at = 0.0
        self._result: RunResult | None = None
        # Made by start(), in the running loop:
        self._loop: asyncio.AbstractEventLoop
        self._group: int  # the child's pid, also its process-group id
        self._exited: asyncio.Future[int]  # the return code, once the child is reaped
        self._stopped: asyncio.Future[None]  # done at the first stop()
        self._pipes_closed: asyncio.Future[None]  # done when both pipes are closed

    @property
    def pid(self) -> int | None:
        """The child's pid, which is also its process-group id; None before start()."""
        return None if self._popen is None else self._popen.pid

    async def start(self) -> int:
        """Start the model in its own session; return its pid (== pgid). OSError if it cannot start."""
        if self._popen is not None:
            raise RuntimeError("this ModelProcess was already started")
        try:
            launched = self._launch()
        except OSError as exc:  # a failed job always has a log: here, why (and the command it tried)
            self._log.note(f"the model could not be started: {exc}", command=" ".join(self._argv))
            self._log.close(keep=True)
            raise
        self._begin(*launched)
        return self._group

    def stop(self, reason: str) -> None:
        """Ask the run to stop for `reason` (the first reason wins); `wait()` performs the kill."""
        if self._stop_reason is None:
            self._stop_reason = reason
        if self._popen is not None and not self._stopped.done():
            self._stopped.set_result(None)

    def kill(self) -> None:
        """SIGKILL the whole group now, with no grace (the worker stops at once); `wait()` reaps it."""
        if self._popen is not None:
            procgroup.signal_group(self._group, signal.SIGKILL)

    async def wait(self) -> RunResult:
        """Run until exit, timeout or stop; kill and reap the whole group; safe to cancel."""
        if self._result is not None:
            return self._result
        if self._popen is None:
            raise RuntimeError("wait() before start()")
        try:
            timed_out, stopped = await self._supervise()
        except asyncio.CancelledError:
            stopped = self._stop_reason or "wait() was cancelled"
            await _finish_anyway(self._cleanup(timed_out=False, stopped=stopped))
            raise
        if self._exited.done() and not self._pipes and self._progress is None:
            self._kill_leftovers()  # nothing left to wait for: no cleanup task needed to be cancel-safe
            return self._finish(timed_out=timed_out, stopped=stopped)
        return await _finish_anyway(self._cleanup(timed_out=timed_out, stopped=stopped))

    def _launch(self) -> tuple[subprocess.Popen[bytes], int, int]:
        """Start the child on two new pipes; return it and the pipes' read ends.

        Popen returns once the child has called exec (CPython uses vfork), as asyncio's start would.
        """
        fds: list[int] = []  # stdout's read and write ends, then stderr's
        try:
            fds += os.pipe()
            fds += os.pipe()
            popen = subprocess.Popen(
                self._argv, cwd=self._cwd, env=self._env, stdin=subprocess.DEVNULL, stdout=fds[1],
                stderr=fds[3], start_new_session=True,
            )  # fmt: skip
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        os.close(fds[1])
        os.close(fds[3])
        return popen, fds[0], fds[2]

    def _begin(self, popen: subprocess.Popen[bytes], stdout: int, stderr: int) -> None:
        """Note the start, then have the loop read both pipes and learn of the exit."""
        self._loop = loop = asyncio.get_running_loop()
        self._popen, self._group, self._started_at = popen, popen.pid, time.monotonic()
        self._exited, self._stopped, self._pipes_closed = (loop.create_future() for _ in range(3))
        if self._stop_reason is not None:
            self._stopped.set_result(None)
        subreaper.spawned(popen.pid)  # its own to wait for: never taken for a stray
        _LOG.debug("model started", extra={"action": "model_started", "pid": popen.pid})  # also in its log
        self._log.note(f"started pid {popen.pid}", command=" ".join(self._argv))
        self._pipes = [
            outputpipe.OutputPipe(stdout, parse=self._on_progress is not None),
            outputpipe.OutputPipe(stderr, parse=False),
        ]
        for pipe in self._pipes:
            loop.add_reader(pipe.fd, self._on_output, pipe)
        pidfd = _pidfd(popen.pid)
        if pidfd is not None:
            loop.add_reader(pidfd, self._reap, popen, pidfd)
        else:
            name = f"runner-wait-{popen.pid}"
            threading.Thread(target=self._wait_in_thread, args=(popen,), name=name, daemon=True).start()

    def _reap(self, popen: subprocess.Popen[bytes], pidfd: int) -> None:
        """The pidfd is readable: the child has exited; reap it (no wait: it is a zombie)."""
        self._loop.remove_reader(pidfd)
        os.close(pidfd)
        self._set_exited(popen.wait())

    def _wait_in_thread(self, popen: subprocess.Popen[bytes]) -> None:
        """Without pidfds: wait for the child in this thread, then tell the loop."""
        code = popen.wait()
        with contextlib.suppress(RuntimeError):  # the loop was closed meanwhile
            self._loop.call_soon_threadsafe(self._set_exited, code)

    def _set_exited(self, code: int) -> None:
        """Record the return code of the reaped child."""
        subreaper.exited(self._group)
        if not self._exited.done():
            self._exited.set_result(code)

    async def _exits_within(self, timeout_s: float | None) -> bool:
        """Whether the child exits within `timeout_s` (None: wait for it); cancelling leaves `_exited`."""
        await asyncio.wait((self._exited,), timeout=timeout_s)
        return self._exited.done()

    async def _supervise(self) -> tuple[bool, str | None]:
        """Wait for exit, the deadline or a stop request; returns (timed_out, stop reason)."""
        remaining = max(self._timeout_s - (time.monotonic() - self._started_at), 0.0)
        watched: tuple[asyncio.Future[Any], ...] = (self._exited, self._stopped)
        await asyncio.wait(watched, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
        if self._exited.done():
            return False, None
        if self._stop_reason is not None:
            await self._kill(f"stop requested: {self._stop_reason}", "run_stopped")
            return False, self._stop_reason
        await self._kill(f"timed out after {self._timeout_s:g}s", "run_timed_out")
        return True, None

    async def _kill(self, why: str, action: str) -> None:
        """SIGTERM the group, give the main process `kill_grace_s` to exit, then SIGKILL the group."""
        pid = self._group
        _LOG.warning("killing model process group: %s", why, extra={"action": action, "pid": pid})
        self._log.note(f"{why}; SIGTERM to process group {pid}")
        procgroup.signal_group(pid, signal.SIGTERM)
        if not await self._exits_within(self._kill_grace_s):
            self._log.note(f"still running after {self._kill_grace_s:g}s; SIGKILL to process group {pid}")
            procgroup.signal_group(pid, signal.SIGKILL)
            await self._exits_within(None)

    async def _cleanup(self, *, timed_out: bool, stopped: str | None) -> RunResult:
        """Kill what is left of the group, drain pipes and progress, close the log, build the result."""
        if not self._exited.done():  # wait() was cancelled before the run ended
            await self._kill(f"cancelled ({stopped})", "run_cancelled")
        self._kill_leftovers()
        await self._drain_pipes()
        if self._progress is not None:
            await self._progress.drain()
        return self._finish(timed_out=timed_out, stopped=stopped)

    def _kill_leftovers(self) -> None:
        """SIGKILL the rest of the reaped child's group: forked helpers must not outlive the run."""
        if procgroup.signal_group(group := self._group, signal.SIGKILL):
            _LOG.info("killed group leftovers", extra={"action": "group_leftovers_killed", "pid": group})

    def _finish(self, *, timed_out: bool, stopped: str | None) -> RunResult:
        """Note how the child ended, close the log and build the result."""
        returncode = self._exited.result()
        self._log.note(f"exit code {returncode}" if returncode >= 0 else f"killed by signal {-returncode}")
        self._log.close(keep=returncode != 0 or timed_out or stopped is not None)
        self._result = RunResult(
            exit_code=returncode if returncode >= 0 else None,
            signal=-returncode if returncode < 0 else None,
            timed_out=timed_out,
            stopped=stopped,
            duration_s=time.monotonic() - self._started_at,
            log_tail=self._log.tail(),
            escaped=self._escaped,
        )
        return self._result

    async def _drain_pipes(self) -> None:
        """Let the pipes reach EOF; give up on pipes held open by a process that left the group."""
        if self._pipes:
            await asyncio.wait((self._pipes_closed,), timeout=_PIPE_DRAIN_S)
        if self._pipes:
            self._escaped = True
            self._log.note("output pipes still open after exit (a process left the group?); closing them")
            for pipe in list(self._pipes):
                self._close_pipe(pipe, eof=False)

    def _on_output(self, pipe: outputpipe.OutputPipe) -> None:
        """The loop saw a pipe readable: copy what it has into the log, queue progress; close at EOF."""
        try:
            data = os.read(pipe.fd, _READ_BYTES)
        except BlockingIOError:
            return
        except OSError as exc:
            _LOG.error("cannot read the model's output: %s", exc, extra={"action": "reader_failed"})
            data = b""
        if data:
            self._take(*pipe.feed(data))
        else:
            self._close_pipe(pipe, eof=True)

    def _close_pipe(self, pipe: outputpipe.OutputPipe, *, eof: bool) -> None:
        """Stop reading a pipe; its unterminated last line goes to the log (and is parsed at EOF)."""
        self._loop.remove_reader(pipe.fd)
        os.close(pipe.fd)
        rest, lines = pipe.rest()
        self._take(rest, lines if eof else [])
        self._pipes.remove(pipe)
        if not self._pipes and not self._pipes_closed.done():
            self._pipes_closed.set_result(None)

    def _take(self, ready: bytes, lines: list[bytes]) -> None:
        """Log output and queue the progress updates among its complete stdout lines."""
        self._log.write(ready)
        for line in lines:
            self._queue_progress(line.decode("utf-8", errors="replace"))

    def _queue_progress(self, line: str) -> None:
        """Queue a parsed progress update for the callback."""
        parsed = progress.parse_progress(line)
        if parsed is None or self._on_progress is None:
            return
        if self._progress is None:
            self._progress = progress.ProgressFeed(self._on_progress, f"runner-progress-{self._group}")
        self._progress.put(*parsed)
