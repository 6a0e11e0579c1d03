"""WarmPool: a worker's warm runners by (model, GPU), with the VRAM they hold while idle.

A runner is *in use* from `acquire()` to `release()`: its memory is then part of its job's
reservation. A runner not in use holds its `hold_mb` on its GPU (`reserved_mb`) until it is closed:
idle too long (`idle_close`), evicted for another model's job (`evict_lru`), or at shutdown
(`close_all`). A runner that died or was ended (crash, timeout, stop, model error) is dropped when
it comes back; the next `acquire()` of its key starts a fresh one. Several runners may share a key
when jobs of one model run side by side on one GPU.

How many runners a key gets. Unpaced (the default), a job that finds no idle runner starts one:
each job slot gets its own runner, which keeps it busy when jobs come in a stream. Paced
(`paced=True`, GPUJOBS_WARM_PACED), a job that finds every runner of its model busy waits for the
first to come free (first come, first served), unless one more runner would serve the jobs
waiting sooner: when they would wait longer, at the runners' recent pace, than a runner of the key
takes to start. Until both are measured, one runner of a key starts at a time. A model that
answers in milliseconds is then served by one or two runners, not one per slot, and a burst of a
slow-loading model does not load it once per job; one whose jobs run for minutes still gets a
runner per job. For no-op jobs, pacing cost throughput on 2 cores (tests/bench/README.md).

Use from the event loop's thread only: the checks and marks in `acquire()`, `release()` and the
close methods happen without awaiting in between.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from app import scheduler, warm, warmresult

_LOG = logging.getLogger("gpujobs.warm")


# How to start a runner, or a function that says it (see WarmPool.acquire).
LaunchOf = warm.Launch | Callable[[], warm.Launch]
# A runner in these states serves, or will serve, jobs (not closing, not dead).
_LIVE = frozenset({warm.RunnerState.STARTING, warm.RunnerState.IDLE, warm.RunnerState.RUNNING})
# How report() names the runner states that do not depend on the runner being in use.
_REPORTED = {warm.RunnerState.STARTING: "starting", warm.RunnerState.CLOSING: "closing"}
# The weight of the newest sample in a key's moving averages of run and start times.
PACE_WEIGHT = 0.2


class GaveUp(Exception):
    """acquire() stopped waiting for a runner: its `give_up` event was set, or the pool closed."""


@dataclasses.dataclass(frozen=True, slots=True)
class RunnerKey:
    """What a runner serves: one model on one GPU (None: no GPU)."""

    model: str
    gpu: int | None


@dataclasses.dataclass(frozen=True, slots=True)
class Closed:
    """A runner the pool closed; the worker may keep its memory counted until NVML shows it free."""

    key: RunnerKey
    pid: int | None
    hold_mb: int
    reason: str


@dataclasses.dataclass(frozen=True, slots=True)
class _Held:
    """What the pool knows of a runner."""

    key: RunnerKey
    hold_mb: int


@dataclasses.dataclass(slots=True)
class Pace:
    """A key's moving averages, in seconds: a job's time in a runner, and a runner's start."""

    run_s: float | None = None
    start_s: float | None = None

    def ran(self, seconds: float) -> None:
        self.run_s = scheduler.moving_average(self.run_s, seconds, weight=PACE_WEIGHT)

    def started(self, seconds: float) -> None:
        self.start_s = scheduler.moving_average(self.start_s, seconds, weight=PACE_WEIGHT)


class WarmPool:
    """The warm runners of one worker."""

    def __init__(self, *, kill_grace_s: float = 5.0, paced: bool = False, max_log_bytes: int = 0) -> None:
        self._grace = kill_grace_s
        self._max_log_bytes = max_log_bytes  # each runner's log, and each of its jobs' (0: no cap)
        self._paced = paced
        self._held: dict[warm.WarmRunner, _Held] = {}  # oldest first
        self._in_use: dict[warm.WarmRunner, float] = {}  # runner -> when it was handed out
        # Jobs waiting for a runner of a key, first come first: each gets a runner, or None (start one).
        self._waiting: dict[RunnerKey, collections.deque[asyncio.Future[warm.WarmRunner | None]]] = {}
        self.pace: dict[RunnerKey, Pace] = {}
        self.starts: collections.Counter[RunnerKey] = collections.Counter()  # runners launched, ever

    def runners(self) -> dict[warm.WarmRunner, RunnerKey]:
        """Every runner held now (in use, idle or closing) and its key, oldest first."""
        return {runner: held.key for runner, held in self._held.items()}

    def idle(self, key: RunnerKey | None = None, *, gpu: int | None = None) -> list[warm.WarmRunner]:
        """Idle runners not in use (of `key`, on `gpu`), most recently used first."""
        found = [
            runner for runner, held in self._held.items()
            if runner.state is warm.RunnerState.IDLE and runner not in self._in_use
            and (key is None or held.key == key) and (gpu is None or held.key.gpu == gpu)
        ]  # fmt: skip
        return sorted(found, key=lambda runner: runner.last_used_s, reverse=True)

    async def acquire(
        self, key: RunnerKey, launch: LaunchOf, *, hold_mb: int, give_up: asyncio.Event | None = None
    ) -> warm.WarmRunner:
        """The most recently used idle runner of `key`, else a new one or, paced, the first busy one
        to come free (see the module doc); in use until release(). GaveUp if `give_up` is set while
        it waits, or while the runner it started loads (that start is then stopped).

        `launch` says how to start a runner, or is a function that says it: called only when one
        must start (a job that finds an idle runner builds no environment or argv)."""
        self._prune()
        while True:
            idle = self.idle(key)
            if idle:
                return self._hand_out(idle[0])
            if not self._paced or self._should_start(key, waiting=len(self._queue(key)) + 1):
                break
            runner = await self._wait_turn(key, give_up)
            if runner is None:
                break  # this job was told to start one
            if runner.state is warm.RunnerState.IDLE:
                return runner
            self.release(runner)  # it ended between its hand-over and now: look again
        runner = self._new_runner(key, launch, hold_mb)
        try:
            await self._start(runner, give_up)
        except BaseException:
            self.release(runner)
            raise
        assert runner.load_s is not None, "a runner that started has its load time"
        self.pace.setdefault(key, Pace()).started(runner.load_s)
        self._in_use[runner] = time.monotonic()  # handed out again: its job's pace counts from the load's end
        self._serve(key)  # a start measured, or one fewer starting: the jobs waiting may want another
        return runner

    def _new_runner(self, key: RunnerKey, launch: LaunchOf, hold_mb: int) -> warm.WarmRunner:
        """A runner of `key`, held (its VRAM counted) and in use, not started yet."""
        try:
            how = launch if isinstance(launch, warm.Launch) else launch()
        except BaseException:
            self._serve(key)  # this job leaves the line's turn to start one: the next may take it
            raise
        runner = warm.WarmRunner(how, kill_grace_s=self._grace, max_log_bytes=self._max_log_bytes)
        self._held[runner] = _Held(key, hold_mb)
        self.starts[key] += 1
        return self._hand_out(runner)

    @staticmethod
    async def _start(runner: warm.WarmRunner, give_up: asyncio.Event | None) -> None:
        """Start `runner`; if `give_up` is set meanwhile, stop the load and raise GaveUp (a cancel
        or a lost lease must not wait out a load of minutes, nor leave a runner nobody asked for)."""
        if give_up is None:
            await runner.start()
            return

        def stop(_: object) -> None:
            if give_up.is_set():
                runner.stop("given up while loading")

        watch = asyncio.ensure_future(give_up.wait())
        watch.add_done_callback(stop)
        try:
            await runner.start()
        except warmresult.StartFailed as exc:
            if give_up.is_set():
                raise GaveUp("stopped while its warm runner loaded") from exc
            raise
        finally:
            watch.cancel()

    def _hand_out(self, runner: warm.WarmRunner) -> warm.WarmRunner:
        self._in_use[runner] = time.monotonic()
        runner.clear_stop()
        return runner

    def _queue(self, key: RunnerKey) -> collections.deque[asyncio.Future[warm.WarmRunner | None]]:
        """The jobs waiting for a runner of `key`, those that stopped waiting dropped."""
        queue = self._waiting.setdefault(key, collections.deque())
        while queue and queue[0].done():
            queue.popleft()
        return queue

    def _should_start(self, key: RunnerKey, *, waiting: int) -> bool:
        """Whether `waiting` jobs for `key` (the asking one included) are better served by one more
        runner than by waiting for those it has: none is alive; or none is starting while its pace
        is not known yet; or, known, they would wait longer than a start takes."""
        live = [runner for runner, held in self._held.items() if held.key == key and runner.state in _LIVE]
        if not live:
            return True
        pace = self.pace.get(key)
        if pace is None or pace.run_s is None or pace.start_s is None:
            return not any(runner.state is warm.RunnerState.STARTING for runner in live)
        return waiting * pace.run_s / len(live) > pace.start_s

    async def _wait_turn(self, key: RunnerKey, give_up: asyncio.Event | None) -> warm.WarmRunner | None:
        """Wait in line for a runner of `key`: the runner handed over, or None to start one."""
        turn: asyncio.Future[warm.WarmRunner | None] = asyncio.get_running_loop().create_future()
        self._queue(key).append(turn)
        waits: list[asyncio.Future[Any]] = [turn]
        stop = asyncio.ensure_future(give_up.wait()) if give_up is not None else None
        if stop is not None:
            waits.append(stop)
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # the waiting task was cancelled
            self._abandon(key, turn)
            raise
        finally:
            if stop is not None:
                stop.cancel()
        if turn.done():
            return turn.result()  # GaveUp if the pool closed meanwhile
        self._abandon(key, turn)
        raise GaveUp("stopped while waiting for a warm runner")

    def _abandon(self, key: RunnerKey, turn: asyncio.Future[warm.WarmRunner | None]) -> None:
        """Leave the line: a turn that came meanwhile (a runner, or a start to make) goes to the next."""
        if not turn.done():
            turn.cancel()
            return
        if turn.cancelled() or turn.exception() is not None:
            return
        runner = turn.result()
        if runner is not None:
            self._in_use.pop(runner, None)
        self._serve(key)

    def _serve(self, key: RunnerKey) -> None:
        """Hand idle runners of `key` to the jobs waiting, first come first; then, if those still
        waiting are better served by one more runner, tell the first of them to start it."""
        if not self._queue(key):  # always so unpaced: nothing to look at on the hot path
            return
        for runner in self.idle(key):
            queue = self._queue(key)  # the turns given up meanwhile dropped from its head
            if not queue:
                return
            queue.popleft().set_result(self._hand_out(runner))
        queue = self._queue(key)
        if queue and self._should_start(key, waiting=len(queue)):
            queue.popleft().set_result(None)

    def release(self, runner: warm.WarmRunner, *, hold_mb: int | None = None) -> None:
        """Take a runner back: to the first job waiting for its key, else idle again when alive
        (holding `hold_mb` now, if given), else forgotten."""
        handed_s = self._in_use.pop(runner, None)
        runner.last_used_s = time.monotonic()
        held = self._held.get(runner)
        if held is not None and hold_mb is not None:
            self._held[runner] = held = dataclasses.replace(held, hold_mb=hold_mb)
        if held is not None and handed_s is not None and runner.state is warm.RunnerState.IDLE:
            self.pace.setdefault(held.key, Pace()).ran(runner.last_used_s - handed_s)
        self._prune()
        if held is not None:
            self._serve(held.key)

    @contextlib.asynccontextmanager
    async def use(self, key: RunnerKey, launch: LaunchOf, *, hold_mb: int) -> AsyncIterator[warm.WarmRunner]:
        """acquire() for the block, release() after it."""
        runner = await self.acquire(key, launch, hold_mb=hold_mb)
        try:
            yield runner
        finally:
            self.release(runner)

    def reserved_mb(self, gpu: int | None) -> int:
        """VRAM held on `gpu` by runners not in use (idle, or closing and not yet gone)."""
        return sum(
            held.hold_mb for runner, held in self._held.items()
            if held.key.gpu == gpu and runner not in self._in_use and runner.state != warm.RunnerState.DEAD
        )  # fmt: skip

    def report(self, gpu: int | None) -> list[dict[str, Any]]:
        """The live runners on `gpu`, oldest first, for the worker's heartbeat snapshot: model, pid,
        state (starting, idle, busy, closing), jobs answered, seconds since its launch (`up_s`), how
        long its start took (`load_s`, None while starting), seconds since its last job when idle
        (`idle_s`), and the VRAM it holds while idle (`vram_mb`; busy, its job's reservation
        covers it)."""
        now, rows = time.monotonic(), []
        for runner, held in self._held.items():
            if held.key.gpu != gpu or runner.state is warm.RunnerState.DEAD:
                continue
            state = _REPORTED.get(runner.state) or ("busy" if runner in self._in_use else "idle")
            rows.append({
                "model": held.key.model, "pid": runner.pid, "state": state, "jobs": runner.jobs_done,
                "up_s": round(now - runner.created_s, 1),
                "load_s": None if runner.load_s is None else round(runner.load_s, 3),
                "idle_s": round(now - runner.last_used_s, 1) if state == "idle" else None,
                "vram_mb": held.hold_mb,
            })  # fmt: skip
        return rows

    def starts_on(self, gpu: int | None) -> dict[str, int]:
        """Runners launched on `gpu` since the pool began, by model (a count that keeps rising while
        the jobs do not is a runner that keeps dying or being evicted)."""
        return {key.model: count for key, count in sorted(self.starts.items(), key=str) if key.gpu == gpu}

    def idle_hold_mb(self, key: RunnerKey) -> int:
        """What the runner acquire(key) would reuse holds now (0: it would start a new one)."""
        idle = self.idle(key)
        return self._held[idle[0]].hold_mb if idle else 0

    def warm_keys(self) -> set[RunnerKey]:
        """The keys with a live runner, idle or busy: what a claim may prefer. A job claimed while its
        model's runners are busy still finds one loaded: paced, it waits for one; claimed ahead, it
        waits for a GPU slot, which the end of a busy runner's job frees."""
        return {held.key for runner, held in self._held.items() if runner.state in _LIVE}

    async def evict_lru(
        self, gpu: int | None, need_mb: int, *, keep: RunnerKey | None = None
    ) -> list[Closed]:
        """Close idle runners on `gpu`, least recently used first, until need_mb is freed; the one
        runner acquire(keep) would reuse is spared (other idle runners of `keep` may go).

        Runners already closing there (idle too long, say) count first, and are waited for too:
        `reserved_mb` counts their memory as theirs until they are gone, so the planner took it
        as there to evict, and a job claimed for it started its model beside a runner that still
        held it. Whoever closes them says what they held (the returned list is this call's)."""
        closing = [
            runner for runner, held in self._held.items()
            if held.key.gpu == gpu and runner.state is warm.RunnerState.CLOSING and runner not in self._in_use
        ]  # fmt: skip
        spared = self.idle(keep)[:1] if keep is not None else []
        chosen, freed = [], sum(self._held[runner].hold_mb for runner in closing)
        for runner in reversed(self.idle(gpu=gpu)):
            if freed >= need_mb:
                break
            if runner not in spared:
                chosen.append(runner)
                freed += self._held[runner].hold_mb
        going = [runner.close() for runner in closing]  # the tasks that end them already
        closed = await self._close(chosen, f"evicted: {need_mb} MB needed on GPU {gpu}")
        if going:
            await asyncio.shield(asyncio.gather(*going))
            self._prune()
        return closed

    async def idle_close(self, older_than_s: float) -> list[Closed]:
        """Close the runners idle for `older_than_s` or longer."""
        now = time.monotonic()
        old = [runner for runner in self.idle() if now - runner.last_used_s >= older_than_s]
        return await self._close(old, f"idle for {older_than_s:g} s")

    async def close_all(self, reason: str = "worker stopping") -> list[Closed]:
        """Stop the jobs in runners and waiting for them, and close every runner."""
        for queue in self._waiting.values():
            for turn in queue:
                if not turn.done():
                    turn.set_exception(GaveUp(f"stopped while waiting for a warm runner: {reason}"))
        self._waiting.clear()
        for runner in self._in_use:
            runner.stop(reason)
        alive = [runner for runner in self._held if runner.state is not warm.RunnerState.DEAD]
        return await self._close(alive, reason)

    def kill_all(self) -> int:
        """SIGKILL every live runner now (the worker stops at once; close_all() then reaps them); how many."""
        live = [runner for runner in self._held if runner.state is not warm.RunnerState.DEAD]
        for runner in live:
            runner.kill()
        return len(live)

    async def _close(self, runners: list[warm.WarmRunner], reason: str) -> list[Closed]:
        """Close runners (each is marked closing at once) and forget them once they are gone."""
        closed = [Closed(self._held[r].key, r.pid, self._held[r].hold_mb, reason) for r in runners]
        ending = [runner.close(reason) for runner in runners]
        for entry in closed:
            _LOG.info("closing warm runner %s: %s", entry.pid, reason, extra={"action": "runner_closing"})
        await asyncio.shield(asyncio.gather(*ending))  # a cancelled caller must not cut a kill short
        self._prune()
        return closed

    def _prune(self) -> None:
        """Forget dead runners that nobody uses."""
        for runner in [r for r in self._held if r.state is warm.RunnerState.DEAD and r not in self._in_use]:
            del self._held[runner]
