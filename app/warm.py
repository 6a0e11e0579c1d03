"""WarmRunner: one persistent model process that serves jobs one at a time (app/modelkit protocol).

    start() --ready--> IDLE <--done, bad input, OOM-- RUNNING <--run_job()-- IDLE
    any other end (exit, timeout, stop(), crash, protocol error, model error, close()) --> DEAD

Kills go to the runner's process group (SIGTERM, `kill_grace_s`, SIGKILL, a last SIGKILL for
forked helpers). A model error other than bad input or OOM ends the runner too: it may have left
the model or its CUDA context broken. Nothing restarts a runner; app/warmpool.py starts a fresh one
for the next job. stderr goes to the runner's log and, during a job, to the job's log as well (both
capped: the runner's rotates, the job's keeps its head and last lines; app/runlog.py).
Progress reaches `on_progress` in order, never after `run_job()` returns. Use from the loop's thread.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import signal
import time
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from app import childprocess, folders, logs, modelkit, procgroup, progress, runner, warmresult
from app.runlog import RunLog

_LOG = logging.getLogger("gpujobs.warm")
_PIPE_DRAIN_S = 2.0
_EXIT_SETTLE_S = 1.0  # after its exit, for its last lines (a process it forked may hold its stdout)
_READ_BYTES = 1 << 16
_STDERR_SETTLE_S = 0.02  # after a job's final line, for its stderr to arrive (unless it says it ended)

ProgressCallback = progress.ProgressCallback


class RunnerState(StrEnum):
    """Where a runner is in its life."""

    STARTING = "starting"
    IDLE = "idle"
    RUNNING = "running"
    CLOSING = "closing"
    DEAD = "dead"


@dataclass(frozen=True, slots=True)
class Launch:
    """How to start a runner."""

    name: str  # what it serves, for logs ("relief on GPU 0")
    argv: tuple[str, ...]
    env: Mapping[str, str]
    cwd: Path
    log_path: Path  # the runner's own log, across its jobs
    load_timeout_s: float = 300.0
    temp_dir: Path | None = None  # its TMPDIR, made for it alone: removed as it ends


def _own_task(coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
    """A task of the runner's. The runner outlives the job that starts it (a job's task may start
    it, or end it), so its tasks log under no job: only the worker is kept of the context."""
    return asyncio.create_task(coro, name=name, context=logs.outside_job())


class WarmRunner:
    """One persistent model process: `start()`, `run_job()` one job at a time, `close()`."""

    def __init__(self, launch: Launch, *, kill_grace_s: float = 5.0, max_log_bytes: int = 0) -> None:
        if not launch.argv or launch.load_timeout_s <= 0 or kill_grace_s < 0:
            raise ValueError("argv must not be empty, load_timeout_s > 0 and kill_grace_s >= 0")
        self.launch, self._grace = launch, kill_grace_s
        self.state, self.last_used_s, self.jobs_done = RunnerState.STARTING, time.monotonic(), 0
        self.created_s = self.last_used_s  # monotonic, like last_used_s
        self.load_s: float | None = None  # from start() to the ready line, once it came
        self._proc: childprocess.Process | None = None
        # Its own log rotates at the cap (a runner may live for weeks); each job's keeps its head and end.
        self._max_log_bytes = max_log_bytes
        self._log = RunLog(launch.log_path, "warm", eager=True, max_bytes=max_log_bytes, rotate=True)
        self._job: tuple[str, RunLog] | None = None  # the job in flight
        self._stderr_ended = asyncio.Event()  # the kit's last stderr line of the job in flight was read
        self._events: collections.deque[warmresult.Event] = collections.deque()
        self._progress: progress.ProgressFeed | None = None  # the job's, made with its first update
        self._wakeup: asyncio.Future[None] | None = None  # what `_next` waits on: an event or stop()
        self._tasks: list[asyncio.Task[None]] = []
        self._spawned: asyncio.Future[None] | None = None  # done once start() has its process, or not
        self._stop = asyncio.Event()
        self._stop_reason: str | None = None
        self._ending: asyncio.Task[None] | None = None
        self._eof = False
        self._signalled = False  # the worker sent its process a signal: its exit says nothing of it
        # The one line awaited now (ready, or the job's final reply) came: any further line before
        # the next job is out of turn, and ends the runner rather than answer that job.
        self._answered = False
        self._heard = False  # the job in flight had progress: the runner took it
        self._out_of_turn: str | None = None  # such a line, when it came before start() returned

    @property
    def pid(self) -> int | None:
        """The runner's pid, which is also its process-group id; None before start()."""
        return None if self._proc is None else self._proc.pid

    def describe_exit(self) -> str:
        """How the process ended, in words."""
        code = None if self._proc is None else self._proc.returncode
        if code is None:
            return "running"
        return f"exit code {code}" if code >= 0 else f"killed by signal {-code}"

    async def start(self) -> int:
        """Start the runner in its own session and wait for its ready line; else StartFailed."""
        launch, began = self.launch, time.monotonic()
        proc = await self._spawn()
        if self._ending is not None:  # ended while spawned: no ready line is awaited (it is killed)
            await asyncio.shield(self._ending)
            raise warmresult.StartFailed(f"ended while it started ({self.describe_exit()})")
        problem = await self._wait_ready(time.monotonic() + launch.load_timeout_s)
        if problem is None and self._ending is not None:  # a line out of turn came with its ready line
            problem = self._out_of_turn or "ended right after its ready line"
        if problem is not None:
            await asyncio.shield(self._end(problem))
            tail = f"\n--- last lines of the runner log ---\n{self._log.tail()}"
            # Any other end was ours (a kill), whose exit code says nothing of the model.
            code = proc.returncode if problem == warmresult.EXITED_LOADING else None
            raise warmresult.StartFailed(f"{problem} ({self.describe_exit()}){tail}", exit_code=code)
        self.state, self.last_used_s = RunnerState.IDLE, time.monotonic()
        self.load_s = self.last_used_s - began
        _LOG.info("warm runner %s ready", launch.name, extra={"action": "runner_ready", "pid": proc.pid})
        return proc.pid

    async def _spawn(self) -> childprocess.Process:
        """The runner's process, its pipes read; an end asked for meanwhile waits for it, to kill it."""
        launch = self.launch
        self._spawned = asyncio.get_running_loop().create_future()
        try:
            self._proc = proc = await childprocess.spawn(
                *launch.argv, cwd=launch.cwd, env=dict(launch.env), stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True,
                limit=modelkit.MAX_LINE_BYTES,
            )  # fmt: skip
        except BaseException as exc:  # cancelled meanwhile too: asyncio killed what it had forked
            self.state = RunnerState.DEAD
            self._log.close()
            # A missing working folder fails the start as a missing program does: told apart first.
            permanent = isinstance(exc, OSError) and runner.cannot_start(exc) and launch.cwd.is_dir()
            folders.remove_quietly(launch.temp_dir)
            if isinstance(exc, OSError):
                raise warmresult.StartFailed(
                    f"the runner could not be started: {exc}", permanent=permanent
                ) from exc
            raise
        finally:
            self._spawned.set_result(None)
        self._log.note(f"started pid {proc.pid} for {launch.name}: {' '.join(launch.argv)}")
        assert proc.stdout is not None and proc.stderr is not None
        stdout = _own_task(self._read_stdout(proc.stdout), f"warm-stdout-{proc.pid}")
        self._tasks = [
            stdout,
            _own_task(self._read_stderr(proc.stderr), f"warm-stderr-{proc.pid}"),
            _own_task(self._watch_exit(proc, stdout), f"warm-exit-{proc.pid}"),
        ]
        return proc

    async def _wait_ready(self, deadline: float) -> str | None:
        """None once the ready line came; otherwise what went wrong."""
        try:
            event = await self._next(deadline)
        except asyncio.CancelledError:
            await asyncio.shield(self._end("cancelled while loading"))
            raise
        if isinstance(event, modelkit.Ready):
            self._log.note(f"ready: model {event.model!r}, pid {event.pid}")
            return None
        return warmresult.not_ready(event, self.launch.load_timeout_s, self._stop_reason)

    def stop(self, reason: str) -> None:
        """Abort loading or the job (also one about to be sent) for `reason`; the runner is then ended."""
        self._stop_reason = self._stop_reason or reason
        self._stop.set()
        self._wake()

    def clear_stop(self) -> None:
        """Forget a stop() that came after the last job had ended (the pool does this on acquire)."""
        self._stop_reason = None
        self._stop.clear()

    def kill(self) -> None:
        """SIGKILL the runner's group now, with no grace (the worker stops at once); close() reaps it."""
        if self._proc is not None and self._proc.returncode is None:
            procgroup.signal_group(self._proc.pid, signal.SIGKILL)

    def close(self, reason: str = "closed") -> asyncio.Task[None]:
        """End the runner (stdin closed, it should exit; its group killed after the grace); await it."""
        return self._end(reason, gentle=True)

    async def run_job(
        self, request: modelkit.Request, *, timeout_s: float, log_path: Path, on_progress: ProgressCallback
    ) -> warmresult.WarmResult:
        """Send one job and wait for its end; the runner survives only done, bad input and OOM."""
        if self.state is not RunnerState.IDLE:
            raise RuntimeError(f"run_job() on a runner that is {self.state}")
        line = request.encode()  # a request that cannot be sent fails here, before anything changed
        job, started = request.job, time.monotonic()
        job_log = RunLog(log_path, "warm", max_bytes=self._max_log_bytes)
        self.state, self._job = RunnerState.RUNNING, (job, job_log)
        # Its task (a slow callback must not hold up the answer) runs in the context of this job's
        # task, where it is made: not in the reader's, which no job owns.
        self._progress = progress.ProgressFeed(on_progress, f"warm-progress-{self.pid}")
        self._answered = self._heard = False
        self._stderr_ended.clear()
        reused = self.jobs_done > 0
        job_log.note(f"job {job} sent to warm runner pid {self.pid} ({self.launch.name})")
        try:
            judged = await self._exchange(job, line, started + timeout_s, timeout_s)
        except asyncio.CancelledError:
            self._job = None
            if self._progress is not None:
                self._progress.cancel()
                self._progress = None
            job_log.close(keep=True)
            await asyncio.shield(self._end("cancelled during a job"))
            raise
        finally:
            if self.state is RunnerState.RUNNING:
                self.state = RunnerState.IDLE  # out-of-turn lines from here on end the runner
        await self._settle(job, *judged[:2])
        if reused and self._gone_before_the_job(judged):
            judged = (warmresult.Outcome.GONE, warmresult.GONE_BEFORE, ())
        elif judged[1] == warmresult.EXITED_DURING and self._signalled:  # EOF, and no exit until ended
            judged = (warmresult.Outcome.BROKE, warmresult.CLOSED_STDOUT, ())
        self._job = None
        if self._progress is not None:  # all of it reaches the callback before run_job() returns
            feed, self._progress = self._progress, None
            await feed.drain()
        return self._result(job_log, judged, time.monotonic() - started)

    async def _settle(self, job: str, outcome: warmresult.Outcome, error: str | None) -> None:
        """Keep the runner after done, bad input and OOM (its stderr given a moment); else end it."""
        if outcome in (warmresult.Outcome.DONE, warmresult.Outcome.BAD_INPUT, warmresult.Outcome.OOM):
            self.last_used_s, self.jobs_done = time.monotonic(), self.jobs_done + 1
            if not self._stderr_ended.is_set():  # usually read already: the kit writes it first
                with contextlib.suppress(TimeoutError):  # a runner without the kit: give stderr a moment
                    await asyncio.wait_for(self._stderr_ended.wait(), _STDERR_SETTLE_S)
        else:
            await asyncio.shield(self._end(f"job {job}: {error}"))

    def _gone_before_the_job(self, judged: warmresult.Judged) -> bool:
        """Whether the runner, idle after its last job, ended on its own before it took this one: a
        runner may exit 0 between jobs (one that retires itself after some), and its exit can reach
        the worker after the next job was written to it. Told by EOF as the first and only word
        about the job, and exit code 0 (once `_settle` reaped it): no model ran the job."""
        assert self._proc is not None
        return judged[1] == warmresult.EXITED_DURING and not self._heard and self._proc.returncode == 0

    def _result(self, log: RunLog, judged: warmresult.Judged, took_s: float) -> warmresult.WarmResult:
        """Close the job's log and describe the job's end."""
        assert self._proc is not None
        outcome, error, _ = judged
        log.note(f"{outcome}{': ' + error if error else ''} after {took_s:.2f} s; runner {self.state}")
        log.close(keep=outcome is not warmresult.Outcome.DONE)
        returncode = None if self._signalled else self._proc.returncode
        stop_reason = self._stop_reason
        return warmresult.WarmResult.of(
            judged, stop_reason=stop_reason, returncode=returncode, took_s=took_s, log_tail=log.tail()
        )

    async def _exchange(self, job: str, line: bytes, deadline: float, timeout_s: float) -> warmresult.Judged:
        """Write the job line, then wait for its final reply, the deadline or a stop."""
        assert self._proc is not None and self._proc.stdin is not None
        stdin = self._proc.stdin
        if not self._stop.is_set():
            with contextlib.suppress(ConnectionError, TimeoutError):  # EOF or the deadline shows next
                stdin.write(line)
                if stdin.transport.get_write_buffer_size() or stdin.is_closing():  # else all in the pipe
                    await asyncio.wait_for(stdin.drain(), deadline - time.monotonic())
        event = await self._next(deadline)
        return warmresult.judge(event, job, stop_reason=self._stop_reason, timeout_s=timeout_s)

    async def _next(self, deadline: float) -> warmresult.Event | warmresult.Outcome:
        """The next event from stdout, or why there was none (the deadline, or stop()).

        It waits on one future that the reader or stop() completes: no task per event."""
        if self._stop.is_set():
            return warmresult.Outcome.STOPPED
        if not self._events:
            self._wakeup = wakeup = asyncio.get_running_loop().create_future()
            try:
                await asyncio.wait((wakeup,), timeout=max(deadline - time.monotonic(), 0.0))
            finally:
                self._wakeup = None
        if self._events:
            return self._events.popleft()
        return warmresult.Outcome.STOPPED if self._stop.is_set() else warmresult.Outcome.TIMED_OUT

    def _wake(self) -> None:
        """Let `_next` look again."""
        if self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)

    async def _read_stdout(self, reader: asyncio.StreamReader) -> None:
        """Pass progress on, queue other events; after a protocol violation drain the pipe unparsed.

        Read as the bytes come, not by lines: the start of a line written while no reply is awaited
        is out of turn at once, before a job is sent that would read it as the start of its reply."""
        lines = modelkit.ReplyLines()
        while chunk := await reader.read(_READ_BYTES):
            if all(self._take(event) for event in lines.feed(chunk)) and self._may_wait(lines.unfinished):
                continue  # (`all` stops at the first violation)
            while await reader.read(_READ_BYTES):  # after a violation: the rest unparsed, to EOF
                pass
            break
        else:
            if (last := lines.end()) is not None:
                self._take(last)
        self._eof = True  # the process is on its way out: let it finish before any signal
        self._hand_on(None)

    def _may_wait(self, begun: bytes) -> bool:
        """Whether an unfinished line may wait for its end: there is none, or a reply is awaited;
        else it is out of turn, handed on as a violation (False)."""
        if not begun or (self.state is not RunnerState.IDLE and not self._answered):
            return True
        return self._take(f"an unfinished line {begun[:200]!r}")

    def _take(self, event: modelkit.Reply | str) -> bool:
        """Pass a job's progress on, hand anything else on; False for a protocol violation."""
        job = None if self._answered else self._job  # progress after the job's answer is out of turn
        if isinstance(event, modelkit.Progress) and job is not None and event.job == job[0]:
            self._heard = True
            job[1].write(f"PROGRESS {event.fraction:.3f} {event.message}\n".encode())
            if self._progress is not None:
                self._progress.put(event.fraction, event.message)
            return True
        self._hand_on(event)
        if isinstance(event, str):
            self._log.note(f"protocol error on stdout: {event}")
            return False
        return True

    async def _watch_exit(self, proc: childprocess.Process, stdout: asyncio.Task[None]) -> None:
        """See the runner's exit even while its stdout stays open (a process it forked, a data
        loader's worker say, holds the pipe): once the lines it wrote have had a moment to be read,
        its stdout counts as ended."""
        await proc.exited()
        done, _ = await asyncio.wait((stdout,), timeout=_EXIT_SETTLE_S)
        if not done and not self._eof:
            self._log.note(f"runner pid {proc.pid} exited; a process it started holds its stdout open")
            self._eof = True
            self._hand_on(None)

    def _hand_on(self, event: warmresult.Event) -> None:
        """Queue an event for whoever waits; while idle, or once the line awaited came (a second
        final reply, a line right after ready), any event (EOF included) ends the runner."""
        if self.state is RunnerState.IDLE or (self._answered and self.state is not RunnerState.CLOSING):
            if event is not None and self.state is RunnerState.STARTING:
                self._out_of_turn = f"spoke out of turn after its ready line: {event}"
            gone = "exited while idle" if self.state is RunnerState.IDLE else "exited after its answer"
            self._end(gone if event is None else f"spoke out of turn: {event}")
        elif self.state in (RunnerState.STARTING, RunnerState.RUNNING):
            self._answered = True
            self._events.append(event)
            self._wake()

    async def _read_stderr(self, reader: asyncio.StreamReader) -> None:
        """Copy stderr into the runner log and, during a job, the job log."""
        while True:
            try:
                chunk = await reader.readuntil(b"\n")
            except asyncio.IncompleteReadError as exc:
                chunk = exc.partial
            except asyncio.LimitOverrunError as exc:
                chunk = await reader.read(max(exc.consumed, 1))
            if not chunk:
                return
            if self._job is not None and chunk == modelkit.stderr_end(self._job[0]):
                self._stderr_ended.set()  # protocol, not output: in neither log
                continue
            self._log.write(chunk)
            if self._job is not None:
                self._job[1].write(chunk)

    def _end(self, why: str, *, gentle: bool = False) -> asyncio.Task[None]:
        """Kill and reap the runner, once: later calls get the same task."""
        if self._ending is None:
            self.state = RunnerState.CLOSING if self.state is not RunnerState.DEAD else self.state
            self._ending = _own_task(self._kill(why, gentle), f"warm-end-{self.pid}")
        return self._ending

    async def _kill(self, why: str, gentle: bool) -> None:
        """Close stdin (gentle) or SIGTERM, SIGKILL the group after the grace; reap; close the logs."""
        if self._spawned is not None:  # asked while the process was spawned: wait to kill it too
            await self._spawned
        if (proc := self._proc) is not None:
            self._log.note(f"ending runner pid {proc.pid}: {why}")
            level = logging.INFO if gentle else logging.WARNING
            _LOG.log(level, "ending warm runner: %s", why, extra={"action": "runner_ended", "pid": proc.pid})
            steps: list[str | signal.Signals] = ["eof"] if gentle or self._eof else []
            for step in [*steps, signal.SIGTERM, signal.SIGKILL]:
                if proc.returncode is not None:
                    break
                if step == "eof" and proc.stdin is not None:
                    proc.stdin.close()
                elif isinstance(step, signal.Signals):
                    self._signalled = True
                    procgroup.signal_group(proc.pid, step)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(proc.exited(), None if step == signal.SIGKILL else self._grace)
            procgroup.signal_group(proc.pid, signal.SIGKILL)  # forked helpers must not outlive it
            await proc.close_pipes(self._tasks, _PIPE_DRAIN_S)
            self._log.note(f"runner pid {proc.pid} ended: {self.describe_exit()}")
        self.state = RunnerState.DEAD
        self._log.close()
        # Not waited for: a job's answer, an eviction and a stop at once must not wait on a disk.
        asyncio.get_running_loop().run_in_executor(None, folders.remove_quietly, self.launch.temp_dir)
