"""Watch: what an attempt follows of its model while it runs: its pid, recorded once the run lasts
(a restart kills the orphan of a lasting run by it), and the GPU memory its processes hold (NVML),
which the worker plans with and an out-of-memory retry grows the job's estimate by."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from app import errors, gpu

T = TypeVar("T")

PID_AFTER_S = 0.5
RECORD_PID_WAIT_S = 5.0  # the most a run's end waits for its pid's statement to finish


class Watch:
    """The pid recording and GPU memory sampling of one attempt's model, and what was seen."""

    def __init__(
        self,
        job_id: object,
        inventory: gpu.GpuInventory | None,
        sample_interval_s: float,
        stopped: asyncio.Event,
        record_pid: Callable[[int], Coroutine[Any, Any, None]],
    ) -> None:
        self._job_id = job_id  # for its tasks' names
        self._inventory = inventory
        self._interval_s = sample_interval_s
        self._stopped = stopped  # set once the attempt was stopped: no pid is recorded after it
        self._record_pid = record_pid  # the attempt's: it honours what the answer says (a cancel)
        self.peak_mb: int | None = None  # most GPU memory the model's processes were seen using
        self.gpu_pids: set[int] = set()  # the model's processes seen holding GPU memory
        self.seen_mb = 0  # what they held at the last reading, at least what is known to be loaded
        self.readings = 0  # NVML readings taken (none, for a job quicker than the first)
        self._loaded_mb = 0  # a warm runner's model, in GPU memory before the job came

    def loaded(self, mb: int) -> None:
        """The model was in GPU memory before the job came (a warm runner's): `mb` is seen at least."""
        self.seen_mb = self._loaded_mb = mb

    async def over(self, pgid: int, work: Awaitable[T]) -> T:
        """Await `work` while recording the pid once it lasts and sampling its GPU memory.

        The pid is recorded once the run has lasted PID_AFTER_S: only a lasting run leaves an
        orphan worth killing after a crash, and quick jobs are spared the round trip (and the
        task: a timer costs less).
        """
        side: list[asyncio.Task[None]] = []
        recording: list[asyncio.Task[None]] = []

        def record_pid() -> None:
            if not self._stopped.is_set():
                recording.append(asyncio.create_task(self._record_pid(pgid), name=f"pid:{self._job_id}"))

        timer = asyncio.get_running_loop().call_later(PID_AFTER_S, record_pid)
        if self._inventory is not None and not isinstance(self._inventory, gpu.VirtualInventory):
            side.append(asyncio.create_task(self._sample_memory(pgid), name=f"vram:{self._job_id}"))
        try:
            return await work
        finally:
            timer.cancel()
            # A pid being recorded is one short statement, let it end: cut off, it would roll back
            # its `started` event and leave a hole in the event ids, which the metrics then wait on.
            if recording:
                await asyncio.wait(recording, timeout=RECORD_PID_WAIT_S)
            for task in (*side, *recording):
                task.cancel()
            await asyncio.gather(*side, *recording, return_exceptions=True)

    async def _sample_memory(self, pgid: int) -> None:
        """Track the peak GPU memory of the model's process group while it runs (NVML)."""
        assert self._inventory is not None
        while True:
            try:
                usage = await asyncio.to_thread(gpu.group_usage_mb, self._inventory, pgid)
            except errors.AppError:  # NVML failed (a driver hiccup): read again at the next tick
                await asyncio.sleep(self._interval_s)
                continue
            self.gpu_pids.update(usage)
            total = sum(usage.values())
            self.seen_mb = max(total, self._loaded_mb)
            self.readings += 1
            if total and total > (self.peak_mb or 0):
                self.peak_mb = total
            await asyncio.sleep(self._interval_s)
