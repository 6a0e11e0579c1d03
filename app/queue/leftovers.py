"""Leftover model processes: a dead worker's runs, found by pid and host, killed before their job
is queued again (so an old run never overlaps a new attempt, and no orphan keeps holding VRAM)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import logging
import os
import resource
import signal
import socket
import struct
from collections.abc import Callable, Set
from pathlib import Path

from app import errors, procgroup, subreaper
from app.queue import records
from app.queue.jobs import Job

log = logging.getLogger("gpujobs.worker")

# The marker of the queue (the database: its server's system identifier and its name, from
# `Fleet.database_id`) a worker's runs and runners carry beside their job's or runner's: a restore
# drill on the same host runs the same jobs (same ids, same attempts) from a restored copy of the
# database, and its reaper must not take the live installation's runs for the leftovers of the
# jobs it takes back.
QUEUE = "GPUJOBS_QUEUE"


class LastLook:
    """What a worker saw when it last looked for strays (`kill_strays(..., last=...)`): the kernel's
    totals for this process's ended children, and the runs and runners live then."""

    def __init__(self) -> None:
        self.seen: tuple[tuple[float, ...], frozenset[str]] | None = None


def hold_identity(worker_id: str) -> socket.socket | None:
    """Hold `worker_id` on this host for as long as the returned socket stays open.

    A worker's start takes what its id left on the host for the leftovers of a crashed previous
    life: it requeues the id's running jobs, kills the id's model processes and empties its
    scratch lanes. A second live worker of the same id (two `gpujobs worker` on one host, neither
    with its own GPUJOBS_WORKER_NAME) would do that to the first. So the id is held by a Unix
    socket bound to an abstract name: the kernel frees it when the process ends, SIGKILL
    included, and it leaves no file behind. ConfigError if a live process holds it. None where
    abstract names do not exist (not Linux), and nothing is held there.
    """
    name = b"\0gpujobs-worker:" + hashlib.sha256(worker_id.encode()).hexdigest()[:40].encode()
    held = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        held.bind(name)
    except OSError as exc:
        held.close()
        if exc.errno == errno.EADDRINUSE:
            raise errors.ConfigError(
                f"another worker with the id {worker_id!r} is running on this host{_holder(name)}: "
                "give each worker on a host its own GPUJOBS_WORKER_NAME"
            ) from exc
        log.debug("no abstract Unix socket names here: the worker id is not held (%s)", exc)
        return None
    held.listen(8)  # lets a second worker ask for the holder's pid
    return held


def _holder(name: bytes) -> str:
    """The pid of the process holding the abstract socket `name`, as " (pid N)"; "" if unknown."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1)
        try:
            probe.connect(name)
            pid, _, _ = struct.unpack("3i", probe.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        except OSError:
            return ""
    return f" (pid {pid})"


def _run_of(job_id: object, attempt: int | None) -> Callable[[bytes], bool]:
    """Whether an environment holds the GPUJOBS_JOB marker of `job_id`'s run `attempt` (None: any
    attempt). Only that attempt's: the job may have been claimed again since, here too."""
    if attempt is None:
        prefix = f"GPUJOBS_JOB={job_id}:".encode()
        return lambda environ: any(v.startswith(prefix) for v in environ.split(b"\0"))
    marker = f"GPUJOBS_JOB={job_id}:{attempt}".encode()
    return lambda environ: marker in environ.split(b"\0")


async def kill_adopted(worker_id: str, live: Callable[[], Set[str]], *, job: Job | None = None) -> int:
    """Kill (and reap) the worker's children (app/subreaper.py) that runs of `worker_id` started
    and that outlived their run: `job`'s run (which just ended), or one `live()` does not name (as
    `find_marked` names runs). A process of another worker, of a runner, or with no marker is not."""
    origin = _origin(worker_id)
    own = None if job is None else f"run {job.id}:{job.attempt}"

    def stray(environ: bytes) -> bool:  # live() asked only for a process a run marked
        name = origin(environ)
        return (
            name is not None
            and name.startswith("run ")
            and name != "run "
            and (name == own or name not in live())
        )

    extra = {} if job is None else {"job_id": str(job.id)}
    return await subreaper.kill_strays(stray, **extra)


def is_model_of(pid: int, job_id: object, attempt: int | None = None) -> bool:
    """True if `pid` is a model process started for `job_id` (guards against pid reuse), for its
    run `attempt` if given."""
    environ = _environ(pid)
    return environ is not None and _run_of(job_id, attempt)(environ)


def _a_runner_of(worker_id: str | None, environ: bytes) -> bool:
    """Whether `environ` is that of a warm runner `worker_id` started (a job's recorded pid is its
    runner's: the runner carries its worker's marker, not the job's)."""
    return worker_id is not None and (_origin(worker_id)(environ) or "").startswith("runner ")


def _environ(pid: int) -> bytes | None:
    """The environment `pid` started with, if it may be read (None: gone, or another user's)."""
    try:
        return Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None


def find_models(job_id: object, attempt: int | None = None) -> set[int]:
    """Process groups on this host of model processes started for `job_id` (for its run `attempt`
    if given), found in /proc by the GPUJOBS_JOB marker in their environment (for runs that ended
    before their pid was recorded)."""
    return _groups_where(_run_of(job_id, attempt))


def find_worker_models(worker_id: str) -> set[int]:
    """Process groups on this host of model processes and warm runners started by `worker_id` (a
    previous life of this worker), found in /proc by their GPUJOBS_WORKER / GPUJOBS_RUNNER marker,
    whatever became of their jobs since."""
    return set(find_marked(worker_id))


def find_marked(worker_id: str) -> dict[int, str]:
    """The process groups of every process `worker_id`'s runs and runners started, each with
    what started it: `run <job id>:<attempt>` (GPUJOBS_WORKER, and GPUJOBS_JOB) or
    `runner <model>:<gpu>#<n>` (GPUJOBS_RUNNER `<worker_id>:<model>:<gpu>#<n>`, the worker's n-th
    runner; earlier versions wrote no `#<n>`)."""
    return _scan(_origin(worker_id))


def _origin(worker_id: str) -> Callable[[bytes], str | None]:
    """What started a process, from its environment, as `find_marked` names it: `run <job
    id>:<attempt>`, `runner <model>:<gpu>#<n>`, or None (not `worker_id`'s)."""
    worker, runner_ = f"GPUJOBS_WORKER={worker_id}".encode(), f"GPUJOBS_RUNNER={worker_id}:".encode()
    job = b"GPUJOBS_JOB="

    def origin(environ: bytes) -> str | None:
        variables = environ.split(b"\0")
        for v in variables:
            # A runner's marker is <worker id>:<model>:<gpu>#<n>, and no colon follows the worker
            # id's but the one before <gpu>: the runner of worker "h:w:b" is not one of worker "h:w".
            if v.startswith(runner_) and v.count(b":", len(runner_)) == 1:
                return "runner " + v[len(runner_) :].decode(errors="replace")
        if worker not in variables:
            return None
        run = next((v[len(job) :] for v in variables if v.startswith(job)), b"")
        return "run " + run.decode(errors="replace")

    return origin


async def kill_strays(worker_id: str, live: Callable[[], Set[str]], *, last: LastLook | None = None) -> int:
    """Kill, at once, the processes this worker's runs and runners started that outlived them: a
    process a model started in a session of its own (setsid) is not in its run's process group,
    so the group's kill missed it. `live()` names (as `find_marked` does) the runs and runners
    still going: a helper of one of those (a daemon, say) lives on with it. Asked after the scan,
    so a run that started meanwhile is live.

    Given the worker's `last` look (a reap round), nothing is read unless a child of this process
    ended since then, or the runs and runners live then are not those live now: a stray
    outlives a run or runner that ended. Reading every process's environment cost 112 ms of CPU
    beside 2,000 processes (as root, tests/bench/bench_reap.py), every round, idle or not."""
    ended = _children_ended()  # before the scan: a run reaped during it is looked for next time
    if last is not None and last.seen == (ended, frozenset(live())):
        return 0
    marked = await asyncio.to_thread(find_marked, worker_id)
    going = live()
    if last is not None:
        last.seen = (ended, frozenset(going))
    groups = {pgid for pgid, origin in marked.items() if origin not in going}
    return await _kill_groups(groups, grace_s=0, why="a process its run left behind")


def _children_ended() -> tuple[float, ...]:
    """The kernel's totals for this process's children that ended and were reaped: one more (a run,
    a warm runner) changes them, if only by the page faults it took."""
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (used.ru_utime, used.ru_stime, used.ru_minflt, used.ru_majflt, used.ru_nvcsw, used.ru_nivcsw)


async def kill_run_strays(job_id: object, attempt: int) -> int:
    """Kill what is left of one run that is over (at once); how many groups were alive."""
    groups = await asyncio.to_thread(find_models, job_id, attempt)
    return await _kill_groups(groups, grace_s=0, why="a process its run left behind", job_id=str(job_id))


def _groups_where(marked: Callable[[bytes], bool]) -> set[int]:
    """Process groups of the processes on this host whose environment passes `marked`."""
    return set(_scan(lambda environ: "" if marked(environ) else None))


def _scan(label: Callable[[bytes], str | None]) -> dict[int, str]:
    """The process groups of the processes on this host whose environment (`/proc/<pid>/environ`,
    the ones we may read) `label` names (not None), with that name."""
    found: dict[int, str] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if (name := label(Path(entry.path, "environ").read_bytes())) is not None:
                    found[os.getpgid(int(entry.name))] = name
    return found


def kill_marked_now(worker_id: str) -> int:
    """SIGKILL, with no grace, every process group on this host that `worker_id`'s runs and
    runners started (a worker known to be gone: nothing of it is waited on); how many."""
    killed = 0
    for pgid in find_worker_models(worker_id):
        if not procgroup.refused(pgid) and procgroup.signal_group(pgid, signal.SIGKILL):
            killed += 1
            log.warning("killed leftover model process", extra={"action": "orphan_killed", "pid": pgid})
    return killed


async def kill_worker_models(worker_id: str, *, grace_s: float) -> int:
    """Kill what a previous life of `worker_id` left running on this host; how many groups."""
    groups = await asyncio.to_thread(find_worker_models, worker_id)
    return await _kill_groups(groups, grace_s=grace_s)


def _of_database(database: str) -> Callable[[bytes], bool]:
    """Whether an environment is that of a process run for jobs of `database`: it carries that
    database's marker, or none (an earlier version's run; any, where `database` is not known)."""
    if not database:
        return lambda environ: True
    ours, prefix = f"{QUEUE}={database}".encode(), f"{QUEUE}=".encode()

    def of_database(environ: bytes) -> bool:
        marks = [v for v in environ.split(b"\0") if v.startswith(prefix)]
        return not marks or ours in marks

    return of_database


async def kill_leftover(taken: records.TakenBack, *, host: str, grace_s: float, database: str = "") -> bool:
    """Kill the model process groups of a job taken back from a lost worker on this host: its
    run's (its recorded pid, and every process that carries the run's marker: one it started in a
    session of its own left the group), or the warm runner it was running in (its recorded pid, a
    runner of that worker, and what carries that runner's marker). Only the recorded group was
    killed while it lived: a helper in a session of its own lived on beside the job's next run,
    holding its GPU memory, for as long as no worker of the dead one's id started on the host.
    A process marked as another database's (a restore drill's copy, or the live one's seen from a
    drill) runs the same job for that database, and is left alone."""
    if taken.host != host:
        return False
    pid = taken.pid
    environ = None if pid is None else _environ(pid)
    ours = _of_database(database)
    if environ is not None and not ours(environ):
        environ = None  # the recorded pid runs for another database
    of_run = _run_of(taken.id, taken.attempt)
    groups: set[int] = set()
    runner: bytes | None = None  # the marker of the runner it ran in
    if environ is not None and (of_run(environ) or _a_runner_of(taken.worker_id, environ)):
        assert pid is not None  # environ is read only for a recorded pid
        groups.add(pid)  # the run's group, or its runner's (a runner's pid is its group's)
        runner = next((v for v in environ.split(b"\0") if v.startswith(b"GPUJOBS_RUNNER=")), None)

    def carries_its_marker(found: bytes) -> bool:
        return (of_run(found) or (runner is not None and runner in found.split(b"\0"))) and ours(found)

    groups |= await asyncio.to_thread(_groups_where, carries_its_marker)
    return await _kill_groups(groups, grace_s=grace_s, job_id=str(taken.id)) > 0


async def _kill_groups(groups: set[int], *, grace_s: float, **log_extra: str) -> int:
    """Kill these leftover process groups (TERM, then KILL after `grace_s`); how many were alive."""
    killed = 0
    for pgid in groups:
        try:
            killed += await procgroup.kill_process_group(pgid, grace_s=grace_s)
        except ValueError:  # our own group or init's: not a leftover model
            continue
        log.warning(
            "killed leftover model process", extra={"action": "orphan_killed", "pid": pgid, **log_extra}
        )
    return killed
