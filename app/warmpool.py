"""WarmPool: a worker's warm runners by (model, GPU), with the VRAM they hold while idle.

A runner is *in use* from `acquire()` to `release()`: its memory is then part of its job's
reservation. A runner not in use holds its `hold_mb` on its GPU (`reserved_mb`) until it is closed:
idle too long (`idle_close`), evicted for another model's job (`evict_lru`), or at shutdown
(`close_all`). A runner that died or was ended (crash, timeout, stop, model error) is dropped when
it comes back; the next `acquire()` of its key starts a fresh one. Several runners may share a key
when jobs of one model run side by side on one GPU. Use from the event loop's thread only: the
checks and marks in `acquire()` and the close methods happen without awaiting in between.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable

from app import warm

_LOG = logging.getLogger("gpujobs.warm")


# How to start a runner, or a function that says it (see WarmPool.acquire).
LaunchOf = warm.Launch | Callable[[], warm.Launch]


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


class WarmPool:
    """The warm runners of one worker."""

    def __init__(self, *, kill_grace_s: float = 5.0) -> None:
        self._grace = kill_grace_s
        self._held: dict[warm.WarmRunner, _Held] = {}  # oldest first
        self._in_use: set[warm.WarmRunner] = set()

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

    async def acquire(self, key: RunnerKey, launch: LaunchOf, *, hold_mb: int) -> warm.WarmRunner:
        """The most recently used idle runner of `key`, else a new one; in use until release().

        `launch` says how to start a runner, or is a function that says it: called only when one
        must start (a job that finds an idle runner builds no environment or argv)."""
        self._prune()
        idle = self.idle(key)
        if idle:
            self._in_use.add(idle[0])
            idle[0].clear_stop()
            return idle[0]
        how = launch if isinstance(launch, warm.Launch) else launch()
        runner = warm.WarmRunner(how, kill_grace_s=self._grace)
        self._held[runner] = _Held(key, hold_mb)
        self._in_use.add(runner)
        try:
            await runner.start()
        except BaseException:
            self.release(runner)
            raise
        return runner

    def release(self, runner: warm.WarmRunner, *, hold_mb: int | None = None) -> None:
        """Take a runner back: idle again when alive (holding `hold_mb` now, if given), else forgotten."""
        self._in_use.discard(runner)
        runner.last_used_s = time.monotonic()
        if hold_mb is not None and runner in self._held:
            self._held[runner] = dataclasses.replace(self._held[runner], hold_mb=hold_mb)
        self._prune()

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

    def idle_hold_mb(self, key: RunnerKey) -> int:
        """What the runner acquire(key) would reuse holds now (0: it would start a new one)."""
        idle = self.idle(key)
        return self._held[idle[0]].hold_mb if idle else 0

    def warm_keys(self) -> set[RunnerKey]:
        """The keys with an idle runner: what a claim may prefer."""
        return {self._held[runner].key for runner in self.idle()}

    async def evict_lru(
        self, gpu: int | None, need_mb: int, *, keep: RunnerKey | None = None
    ) -> list[Closed]:
        """Close idle runners on `gpu` but of `keep`, least recently used first, until need_mb is freed."""
        chosen, freed = [], 0
        for runner in reversed(self.idle(gpu=gpu)):
            if freed >= need_mb:
                break
            if self._held[runner].key != keep:
                chosen.append(runner)
                freed += self._held[runner].hold_mb
        return await self._close(chosen, f"evicted: {need_mb} MB needed on GPU {gpu}")

    async def idle_close(self, older_than_s: float) -> list[Closed]:
        """Close the runners idle for `older_than_s` or longer."""
        now = time.monotonic()
        old = [runner for runner in self.idle() if now - runner.last_used_s >= older_than_s]
        return await self._close(old, f"idle for {older_than_s:g} s")

    async def close_all(self, reason: str = "worker stopping") -> list[Closed]:
        """Stop the jobs in runners and close every runner."""
        for runner in self._in_use:
            runner.stop(reason)
        alive = [runner for runner in self._held if runner.state is not warm.RunnerState.DEAD]
        return await self._close(alive, reason)

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
