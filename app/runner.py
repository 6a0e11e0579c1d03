"""Run one model as a subprocess in its own process group, with a log, progress, timeout and stop.

Kills go to the whole group (SIGTERM, `kill_grace_s`, SIGKILL); after the main process exits the group
gets a last SIGKILL, so forked helpers die too. Both pipes drain at once into the log; stdout progress
lines reach `on_progress` in order from a separate task (a slow callback never stalls the pipes) and
never after `wait()` returns. Call `stop()` and `wait()` from the event loop's thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import signal
import sys
import time
import warnings
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

_LOG = logging.getLogger("gpujobs.runner")
_T = TypeVar("_T")

LINE_LIMIT_BYTES = 64 * 1024  # longer stdout/stderr lines are logged in pieces and never parsed
TAIL_BYTES = 4096
TAIL_LINES = 40
_PROGRESS_BACKLOG = 1000  # undelivered progress updates kept; the oldest are dropped beyond this
_PIPE_DRAIN_S = 2.0  # after the group is dead, how long the pipes may take to reach EOF
_PROGRESS_DRAIN_S = 5.0  # after exit, how long queued progress updates may take to deliver
_POLL_S = 0.05
_PASSED_THROUGH = ("PATH", "LANG", "LC_ALL", "TMPDIR", "PYTHONPATH")

ProgressCallback = Callable[[float, str], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class RunResult:
    """How one model run ended."""

    exit_code: int | None  # None when a signal ended it
    signal: int | None  # the signal that ended it (from a negative returncode)
    timed_out: bool
    stopped: str | None  # the reason given to stop(), when the stop ended the run
    duration_s: float
    log_tail: str  # the last TAIL_LINES lines / TAIL_BYTES bytes this run wrote to its log

    @property
    def ok(self) -> bool:
        """Whether the model exited 0 by itself, without timeout or stop."""
        return self.exit_code == 0 and not self.timed_out and self.stopped is None


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


async def kill_process_group(pgid: int, *, grace_s: float) -> bool:
    """SIGTERM a leftover group, SIGKILL it after `grace_s`; True if anything was there.

    Refuses (ValueError) pgid <= 1 and our own group: a recorded pid may be reused after a restart.
    """
    if pgid <= 1 or pgid == os.getpgid(0):
        raise ValueError(f"refusing to kill process group {pgid}")
    if not _signal_group(pgid, signal.SIGTERM):
        return False
    _LOG.warning("killing leftover process group", extra={"action": "leftover_group_killed", "pid": pgid})
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not _group_alive(pgid):
            return True
        await asyncio.sleep(_POLL_S)
    _signal_group(pgid, signal.SIGKILL)
    return True


def _signal_group(pgid: int, sig: int) -> bool:
    """Send `sig` to a process group; False when no process of ours is in it."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):  # gone, or now someone else's: not ours to kill
        return False
    return True


def _group_alive(pgid: int) -> bool:
    """Whether the group has a member that is not a zombie (zombies only wait to be reaped)."""
    if not _signal_group(pgid, 0):
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


async def _next_chunk(reader: asyncio.StreamReader) -> tuple[bytes, bool]:
    """The next line (complete) or a piece of an overlong one (not complete); b"" at EOF."""
    try:
        return await reader.readuntil(b"\n"), True
    except asyncio.IncompleteReadError as exc:  # EOF: the last, unterminated line (maybe empty)
        return exc.partial, True
    except asyncio.LimitOverrunError as exc:
        return await reader.read(max(exc.consumed, 1)), False


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

    async def exited(self) -> int:
        """The return code, once the process has exited (safe to cancel)."""
        await asyncio.shield(self._exited)
        assert self.returncode is not None
        return self.returncode


async def spawn(*argv: str, limit: int, **kwargs: Any) -> Process:
    """`asyncio.create_subprocess_exec`, giving a `Process` whose exit is noticed at once."""
    loop = asyncio.get_running_loop()
    transport, protocol = await loop.subprocess_exec(lambda: _ExitProtocol(limit, loop), *argv, **kwargs)
    return Process(transport, protocol, loop)


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


class ModelProcess:
    """One model run: `start()`, optionally `stop(reason)`, and always `await wait()`."""

    def __init__(
        self,
        argv: Sequence[str],
        *,
        cwd: Path,
        env: Mapping[str, str],
        log_path: Path,
        timeout_s: float,
        kill_grace_s: float = 5.0,
        on_progress: ProgressCallback | None = None,
    ) -> None:
        if not argv:
            raise ValueError("argv is empty")
        if timeout_s <= 0 or kill_grace_s < 0:
            raise ValueError("timeout_s must be > 0 and kill_grace_s >= 0")
        self._argv = tuple(argv)
        self._cwd = cwd
        self._env = dict(env)
        self._log_path = log_path
        self._timeout_s = timeout_s
        self._kill_grace_s = kill_grace_s
        self._on_progress = on_progress
        self._proc: Process | None = None
        self._log: BinaryIO | None = None
        self._tail = bytearray()
        self._readers: list[asyncio.Task[None]] = []
        self._dispatcher: asyncio.Task[None] | None = None
        self._progress: asyncio.Queue[tuple[float, str]] = asyncio.Queue(maxsize=_PROGRESS_BACKLOG)
        self._stop_requested = asyncio.Event()
        self._stop_reason: str | None = None
        self._started_at = 0.0
        self._result: RunResult | None = None

    @property
    def pid(self) -> int | None:
        """The child's pid, which is also its process-group id; None before start()."""
        return None if self._proc is None else self._proc.pid

    async def start(self) -> int:
        """Start the model in its own session; return its pid (== pgid). OSError if it cannot start."""
        if self._proc is not None:
            raise RuntimeError("this ModelProcess was already started")
        self._log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self._log_path.open("ab")
        try:
            proc = await spawn(
                *self._argv,
                cwd=self._cwd,
                env=self._env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
                limit=LINE_LIMIT_BYTES,
            )
        except BaseException:
            log.close()
            raise
        self._log, self._proc, self._started_at = log, proc, time.monotonic()
        _LOG.info("model started", extra={"action": "model_started", "pid": proc.pid})
        self._note(f"started pid {proc.pid}: {' '.join(self._argv)}")
        self._start_tasks(proc)
        return proc.pid

    def stop(self, reason: str) -> None:
        """Ask the run to stop for `reason` (the first reason wins); `wait()` performs the kill."""
        if self._stop_reason is None:
            self._stop_reason = reason
        self._stop_requested.set()

    async def wait(self) -> RunResult:
        """Run until exit, timeout or stop; kill and reap the whole group; safe to cancel."""
        if self._result is not None:
            return self._result
        if self._proc is None:
            raise RuntimeError("wait() before start()")
        proc = self._proc
        try:
            timed_out, stopped = await self._supervise(proc)
        except asyncio.CancelledError:
            stopped = self._stop_reason or "wait() was cancelled"
            await _finish_anyway(self._cleanup(proc, timed_out=False, stopped=stopped))
            raise
        return await _finish_anyway(self._cleanup(proc, timed_out=timed_out, stopped=stopped))

    def _start_tasks(self, proc: Process) -> None:
        """Start the two pipe readers and, if there is a callback, the progress dispatcher."""
        assert proc.stdout is not None and proc.stderr is not None
        pid, callback = proc.pid, self._on_progress
        self._readers = [
            asyncio.create_task(self._copy(proc.stdout, parse=True), name=f"runner-stdout-{pid}"),
            asyncio.create_task(self._copy(proc.stderr, parse=False), name=f"runner-stderr-{pid}"),
        ]
        if callback is not None:
            self._dispatcher = asyncio.create_task(self._dispatch(callback), name=f"runner-progress-{pid}")

    async def _supervise(self, proc: Process) -> tuple[bool, str | None]:
        """Wait for exit, the deadline or a stop request; returns (timed_out, stop reason)."""
        remaining = max(self._timeout_s - (time.monotonic() - self._started_at), 0.0)
        exited = asyncio.create_task(proc.exited(), name=f"runner-exit-{proc.pid}")
        stopping = asyncio.create_task(self._stop_requested.wait(), name=f"runner-stop-{proc.pid}")
        try:
            await asyncio.wait({exited, stopping}, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
        finally:
            exited.cancel()
            stopping.cancel()
        if proc.returncode is not None:
            return False, None
        if self._stop_reason is not None:
            await self._kill(proc, f"stop requested: {self._stop_reason}", "run_stopped")
            return False, self._stop_reason
        await self._kill(proc, f"timed out after {self._timeout_s:g}s", "run_timed_out")
        return True, None

    async def _kill(self, proc: Process, why: str, action: str) -> None:
        """SIGTERM the group, give the main process `kill_grace_s` to exit, then SIGKILL the group."""
        _LOG.warning("killing model process group: %s", why, extra={"action": action, "pid": proc.pid})
        self._note(f"{why}; SIGTERM to process group {proc.pid}")
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.exited(), self._kill_grace_s)
        except TimeoutError:
            self._note(f"still running after {self._kill_grace_s:g}s; SIGKILL to process group {proc.pid}")
            _signal_group(proc.pid, signal.SIGKILL)
            await proc.exited()

    async def _cleanup(self, proc: Process, *, timed_out: bool, stopped: str | None) -> RunResult:
        """Kill what is left of the group, drain pipes and progress, close the log, build the result."""
        if proc.returncode is None:  # wait() was cancelled before the run ended
            await self._kill(proc, f"cancelled ({stopped})", "run_cancelled")
        returncode = await proc.exited()
        if _signal_group(proc.pid, signal.SIGKILL):  # forked helpers must not outlive the run
            _LOG.info("killed group leftovers", extra={"action": "group_leftovers_killed", "pid": proc.pid})
        await self._drain_pipes(proc)
        await self._drain_progress()
        self._note(f"exit code {returncode}" if returncode >= 0 else f"killed by signal {-returncode}")
        self._close_log()
        self._result = RunResult(
            exit_code=returncode if returncode >= 0 else None,
            signal=-returncode if returncode < 0 else None,
            timed_out=timed_out,
            stopped=stopped,
            duration_s=time.monotonic() - self._started_at,
            log_tail=self._tail_text(),
        )
        return self._result

    async def _drain_pipes(self, proc: Process) -> None:
        """Let the readers reach EOF; give up on pipes held open by a process that left the group."""
        _done, pending = await asyncio.wait(self._readers, timeout=_PIPE_DRAIN_S)
        if pending:
            self._note("output pipes still open after exit (a process left the group?); closing them")
        for task in pending:
            task.cancel()
        for outcome in await asyncio.gather(*self._readers, return_exceptions=True):
            if isinstance(outcome, Exception):
                _LOG.error("log reader failed: %r", outcome, extra={"action": "reader_failed"})
        # Process has no public close(); without it a pipe held open by an escaped process would
        # leave the transport unclosed. The process is reaped, so this only closes the pipes.
        transport = getattr(proc, "_transport", None)
        if transport is not None:
            transport.close()

    async def _drain_progress(self) -> None:
        """Deliver queued progress updates (bounded in time), then stop the dispatcher."""
        if self._dispatcher is None:
            return
        try:
            await asyncio.wait_for(self._progress.join(), _PROGRESS_DRAIN_S)
        except TimeoutError:
            _LOG.warning("progress callback too slow; dropping updates", extra={"action": "progress_dropped"})
        self._dispatcher.cancel()
        await asyncio.gather(self._dispatcher, return_exceptions=True)

    async def _copy(self, reader: asyncio.StreamReader, *, parse: bool) -> None:
        """Copy one pipe into the log as lines arrive; queue progress from complete stdout lines."""
        inside_overlong = False
        while True:
            chunk, complete = await _next_chunk(reader)
            if not chunk:
                return
            self._write(chunk)
            if parse and complete and not inside_overlong:
                self._queue_progress(chunk.decode("utf-8", errors="replace"))
            inside_overlong = not complete

    def _queue_progress(self, line: str) -> None:
        """Queue a parsed progress update for the callback, dropping the oldest if the backlog is full."""
        parsed = parse_progress(line)
        if parsed is None or self._dispatcher is None:
            return
        if self._progress.full():
            self._progress.get_nowait()
            self._progress.task_done()
        self._progress.put_nowait(parsed)

    async def _dispatch(self, callback: ProgressCallback) -> None:
        """Call `on_progress` for each update in order; its failures are logged, never raised."""
        while True:
            fraction, message = await self._progress.get()
            try:
                await callback(fraction, message)
            except Exception:
                _LOG.exception("progress callback failed", extra={"action": "progress_callback_failed"})
            finally:
                self._progress.task_done()

    def _write(self, data: bytes) -> None:
        """Append bytes to the log file and the in-memory tail; a failing disk must not stop draining."""
        self._tail += data
        if len(self._tail) > 2 * TAIL_BYTES:
            del self._tail[:-TAIL_BYTES]
        if self._log is None or self._log.closed:
            return
        try:
            self._log.write(data)
            self._log.flush()
        except OSError as exc:
            _LOG.error("cannot write the run log: %s", exc, extra={"action": "log_write_failed"})
            self._close_log()

    def _close_log(self) -> None:
        """Close the log file; a flush that fails here has already been reported or cannot matter."""
        if self._log is not None:
            with contextlib.suppress(OSError):
                self._log.close()

    def _note(self, text: str) -> None:
        """Write one line of the runner's own into the log, so the log tells why a run ended."""
        self._write(f"[runner] {text}\n".encode())

    def _tail_text(self) -> str:
        """The last TAIL_LINES lines within the last TAIL_BYTES bytes, decoded leniently."""
        text = bytes(self._tail[-TAIL_BYTES:]).decode("utf-8", errors="replace")
        return "\n".join(text.splitlines()[-TAIL_LINES:])


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
