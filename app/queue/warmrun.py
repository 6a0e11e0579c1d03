"""A job's run in a warm runner of its model on its GPU (app/warmpool.py keeps the runners;
app/queue/attempt.py judges the run): the runner asked for, launched if need be (its own folder, log
and environment), the job run in it, and what its success says of that runner."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app import modelkit, progress, registry, runner, storage, warm, warmpool, warmresult
from app.queue import leftovers
from app.queue import watch as watch_
from app.queue.jobs import Job

_STARTS = itertools.count(1)  # the runners this process started


def origin(runner: warm.WarmRunner, worker_id: str) -> str:
    """How the reap round names what `runner` started (leftovers.find_marked): `runner
    <model>:<gpu>#<n>`."""
    return "runner " + runner.launch.env.get("GPUJOBS_RUNNER", "").removeprefix(f"{worker_id}:")


@dataclass(frozen=True, slots=True)
class WarmRun:
    """How one job runs in a warm runner of its model on its GPU."""

    job: Job
    spec: registry.ModelSpec
    pool: warmpool.WarmPool
    store: storage.ResultStore
    worker_id: str
    python: str
    database: str = ""  # leftovers.QUEUE

    @property
    def hold_mb(self) -> int:
        """What the runner holds on its GPU between jobs, as far as is known before it ran one."""
        spec = self.spec
        return spec.base_mb if spec.idle_vram_mb is None else spec.idle_vram_mb  # 0 is 0

    async def acquire(self, give_up: asyncio.Event) -> warm.WarmRunner:
        """An idle runner, else a new one or the first busy one to come free (app/warmpool.py);
        GaveUp once `give_up` is set (or the pool closes) meanwhile, StartFailed if it did not start."""
        key = warmpool.RunnerKey(self.spec.name, self.job.gpu)
        return await self.pool.acquire(key, lambda: self._launch(key), hold_mb=self.hold_mb, give_up=give_up)

    def _launch(self, key: warmpool.RunnerKey) -> warm.Launch:
        """How to start a warm runner: its own folder (its HOME, working folder and TMPDIR, removed
        as it ends), the log of its model and GPU, and a minimal environment. The runners of a
        model and GPU share that log's folder; given it as HOME and working folder, a model's
        scratch file there was another runner's too, another user's job's."""
        folder = self.store.runner_dir(key.model, key.gpu)
        temp = self.store.runner_temp(folder, self.worker_id)  # several runners may share `folder`
        env = runner.minimal_env(
            key.gpu,
            {
                "HOME": str(temp),
                "TMPDIR": str(temp),  # and TMP, TEMP, which some programs read instead
                "TMP": str(temp),
                "TEMP": str(temp),
                "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
                # Which runner (`#n`, one per start in this worker): a helper a runner left is
                # a stray once that runner is gone, while others of its model and GPU live on.
                "GPUJOBS_RUNNER": f"{self.worker_id}:{key.model}:{key.gpu}#{next(_STARTS)}",
                leftovers.QUEUE: self.database,  # whose jobs (leftovers.kill_leftover)
            },
        )
        argv = tuple(self.spec.build_serve_argv(python=self.python))
        return warm.Launch(
            f"{key.model} on GPU {key.gpu}",
            argv,
            env,
            temp,
            folder / "runner.log",
            load_timeout_s=self.spec.load_timeout_s,
            temp_dir=temp,
        )

    async def run(
        self,
        given: warm.WarmRunner,
        request: modelkit.Request,
        log_path: Path,
        *,
        watch: watch_.Watch,
        on_progress: progress.ProgressCallback,
    ) -> warmresult.WarmResult:
        """Run the job's request in the runner it was given, its pid and GPU memory watched, then
        give the runner back to the pool."""
        watch.loaded(self.hold_mb)  # NVML's free figure counts it already
        try:
            work = given.run_job(
                request, timeout_s=self.spec.timeout_s, log_path=log_path, on_progress=on_progress
            )
            result = await watch.over(given.pid or 0, work)
        finally:
            # Idle, it holds what NVML last showed it using, if more than it was given: a model's
            # cache allocator keeps what the job used (seen_mb starts at hold_mb). A job too quick
            # for a reading leaves what it held before, not the model's idle_vram_mb: reset so, it
            # fell below what NVML last showed, and the planner counted less to evict than it frees.
            self.pool.release(given, hold_mb=watch.seen_mb if watch.readings else None)
        if given.state is not warm.RunnerState.DEAD:
            watch.gpu_pids.clear()  # the pool counts a live runner's memory, not the settling list
        return result


def about(given: warm.WarmRunner) -> dict[str, Any]:
    """What the success event says of the runner a job was given, read before the job runs: its
    pid, which of its jobs this is, and the model's load when this job was its first (the job
    waited for it)."""
    said: dict[str, Any] = {"runner_pid": given.pid, "runner_job": given.jobs_done + 1}
    if given.jobs_done == 0 and given.load_s is not None:
        said["load_s"] = round(given.load_s, 3)
    return said
