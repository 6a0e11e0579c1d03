"""Leftover model processes: a dead worker's runs, found by pid and host, killed before their job
is queued again (so an old run never overlaps a new attempt, and no orphan keeps holding VRAM)."""

from __future__ import annotations

import logging
from pathlib import Path

from app import runner
from app.queue import manager as manager_

log = logging.getLogger("gpujobs.worker")


def is_model_of(pid: int, job_id: object) -> bool:
    """True if `pid` is a model process started for `job_id` (guards against pid reuse)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    return f"GPUJOBS_JOB={job_id}:".encode() in environ


async def kill_leftover(taken: manager_.TakenBack, *, host: str, grace_s: float) -> bool:
    """Kill the model process group of a job taken back from a dead worker on this host."""
    if taken.pid is None or taken.host != host or not is_model_of(taken.pid, taken.id):
        return False
    try:
        killed = await runner.kill_process_group(taken.pid, grace_s=grace_s)
    except ValueError:  # the pid is now our own group or init's: not a leftover model
        return False
    if killed:
        log.warning(
            "killed leftover model process",
            extra={"action": "orphan_killed", "pid": taken.pid, "job_id": str(taken.id)},
        )
    return killed
