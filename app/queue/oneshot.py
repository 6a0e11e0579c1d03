"""A one-shot run's surroundings: the environment its process starts with (its lane, its GPU, the
markers a restart and the reaper find it by), and what it left behind, killed before its outputs
are read and its lane goes to another job (app/queue/attempt.py runs it)."""

from __future__ import annotations

from collections.abc import Callable, Set
from pathlib import Path

from app import runner
from app.queue import leftovers
from app.queue.jobs import Job


def env(job: Job, lane: Path, worker_id: str, database: str) -> dict[str, str]:
    """The environment of a one-shot run: the minimal one, its GPU, and the markers a restart
    and the reaper find its processes by (`database`: leftovers.QUEUE). Its
    temporary files go in its lane (TMPDIR, and TMP and TEMP that some programs read instead),
    emptied after it: in the host's /tmp, those of a run killed at its timeout or canceled
    stayed for good. (The lane itself, not a folder made in it: every folder made and freed per
    run costs on a busy disk.)"""
    assert job.gpu is not None
    # PCI bus order makes CUDA's device numbers the same as NVML's (the inventory's).
    folder = str(lane)
    return runner.minimal_env(
        job.gpu,
        {
            "HOME": folder,
            "TMPDIR": folder,
            "TMP": folder,
            "TEMP": folder,
            "GPUJOBS_JOB": f"{job.id}:{job.attempt}",
            "GPUJOBS_WORKER": worker_id,  # a restart finds its runs by it
            leftovers.QUEUE: database,  # and tells them from a restored copy's
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        },
    )


async def kill_leftovers(
    job: Job, result: runner.RunResult, worker_id: str, live_runs: Callable[[], Set[str]]
) -> None:
    """Kill what the ended run left, before its outputs are read and its lane reused.

    First what came to the worker (a subreaper, app/subreaper.py) as the run's process exited: a
    daemon with its pipes let go of, which neither the group's kill nor the run's end saw, lived
    until the next reap round, while its lane went to the next job (another user's), whose outputs
    it replaced, as it did its own run's between their hash and their publishing. A look at the
    worker's own children: no scan of /proc. `live_runs` names the worker's runs still going.
    """
    await leftovers.kill_adopted(worker_id, live_runs, job=job)
    if result.escaped or not result.ok:  # what left the run's group dies before the lane is reused
        await leftovers.kill_run_strays(job.id, job.attempt)
