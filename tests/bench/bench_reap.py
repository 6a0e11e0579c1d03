"""What a worker's looks for strays cost: the one after every run, and the reap round's read of /proc.

Run on demand: `.venv/bin/python -m tests.bench.bench_reap [--calls N] [--processes P] [--quick]`.
It prints, asserts nothing (Linux: it reads /proc). `--quick`: 2,000 calls, 200 processes. Like a
worker (`Worker.start`), this process first makes itself a child subreaper (`subreaper.become`).

0. machine: Python, kernel, CPUs, this process's uid (root reads every process's environment, a
   user only its own), load average (1 min) at the start; at the end its load average again.

1. the look after every run: each line calls a function N times, with one child of this process
   alive (a `sleep` noted by `subreaper.spawned`, as a concurrent run's or a warm runner's
   process is), and gives the median and p99 wall µs of a call (perf_counter, each call) and its
   CPU µs (process_time over the N calls, / N).
   - `children()`: the worker's own children, read from `/proc/self/task/<tid>/children` of the
     main thread and of the calling thread, here the same one: one read.
   - `children(every_thread=True)`: every thread's list, as the reap round reads it (`reap_zombies`).
   - `children()` from a thread that is not the main one: two reads.
   - `kill_adopted`: what a worker runs right after every run, success included
     (`oneshot.kill_leftovers` -> `leftovers.kill_adopted(worker_id, live_runs, job=job)` ->
     `subreaper.kill_strays`): the children read, those noted as spawned passed over, no stray.
   - the same with a second child, one nothing here started (as a re-parented process is), not
     noted: its environment is read (`/proc/<pid>/environ`) at every call, and it is spared.

2. the reap round's read of every process's environment, beside P more processes (`sleep 600`
   in a process group of their own, killed and reaped at the end, Ctrl-C and SIGTERM included),
   for a worker id no process carries, so nothing is killed. Each line: min / median / max over
   `--rounds` rounds (after one round not counted) of the CPU ms of this process (process_time:
   every thread, the scan's included) and the wall ms.
   - `find_marked`: the scan alone (`leftovers._scan`: every `/proc/<pid>/environ`).
   - `kill_strays`, something ended: `leftovers.kill_strays(worker_id, live, last=LastLook())`, as
     `Reaper._kill_strays` calls it when a run or runner of the worker ended since its last look:
     the scan in a thread (`asyncio.to_thread`), nothing to kill.
   - `kill_strays`, nothing ended: the same `LastLook` again: the totals of ended children
     (getrusage) and the live runs compared, no read of /proc.
   The header gives the processes on the host (numeric entries of /proc), how many of their
   environments this process may read, and the size of the extra processes' environment (this
   process's, which they inherit).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import time
import types
import uuid
from collections.abc import Awaitable, Callable, Iterator
from concurrent import futures
from contextlib import contextmanager
from typing import cast

from app import subreaper
from app.queue import leftovers
from app.queue.jobs import Job

WORKER_ID = f"bench-reap-{uuid.uuid4()}"  # no process carries it: nothing is killed
SLEEP = ("sleep", "600")

PerCall = tuple[float, float, float]  # µs per call: wall median, wall p99, CPU mean
PerRound = tuple[list[float], list[float]]  # ms per round: CPU, wall


def _per_call(walls_ns: list[int], cpu_ns: int) -> PerCall:
    """Median and p99 of the calls' wall times, and the mean CPU per call, in µs."""
    walls_ns.sort()
    p99 = walls_ns[min(len(walls_ns) - 1, int(len(walls_ns) * 0.99))]
    return statistics.median(walls_ns) / 1e3, p99 / 1e3, cpu_ns / len(walls_ns) / 1e3


def _calls(n: int, call: Callable[[], object]) -> PerCall:
    """Call `call` n times."""
    walls: list[int] = []
    cpu = time.process_time_ns()
    for _ in range(n):
        started = time.perf_counter_ns()
        call()
        walls.append(time.perf_counter_ns() - started)
    return _per_call(walls, time.process_time_ns() - cpu)


async def _awaits(n: int, call: Callable[[], Awaitable[object]]) -> PerCall:
    """Await `call()` n times (with no stray it never suspends: the time is the call's own)."""
    walls: list[int] = []
    cpu = time.process_time_ns()
    for _ in range(n):
        started = time.perf_counter_ns()
        await call()
        walls.append(time.perf_counter_ns() - started)
    return _per_call(walls, time.process_time_ns() - cpu)


def _adopted_look(live_run: str) -> Callable[[], Awaitable[int]]:
    """The look after a run of this worker ended, while another run (`live_run`) goes on. Only the
    ended job's id and attempt are read (`kill_adopted`): a stand-in for the database's row."""
    job = cast(Job, types.SimpleNamespace(id=uuid.uuid4(), attempt=1))
    return lambda: leftovers.kill_adopted(WORKER_ID, lambda: {live_run}, job=job)


def _child(env: dict[str, str], *, noted: bool) -> subprocess.Popen[bytes]:
    """A `sleep` child in a session of its own, noted as spawned (as a run's process is) or not."""
    child = subprocess.Popen(SLEEP, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
    if noted:
        subreaper.spawned(child.pid)
    return child


def _end(children: list[subprocess.Popen[bytes]]) -> None:
    """Kill and reap our own children."""
    for child in children:
        child.kill()
        child.wait()
        subreaper.exited(child.pid)


def _row(name: str, figures: PerCall) -> None:
    """One line of part 1."""
    median, p99, cpu = figures
    print(f"  {name:<66} {median:>8.1f} {p99:>8.1f} {cpu:>8.1f}")


def per_run_look(n: int) -> None:
    """Part 1: the look at the worker's own children after every run."""
    run_id = uuid.uuid4()
    env = {**os.environ, "GPUJOBS_JOB": f"{run_id}:1", "GPUJOBS_WORKER": WORKER_ID}
    children = [_child(env, noted=True)]  # a run that goes on, in another lane
    try:
        print(f"\n1. the look after every run: {n:,} calls each, µs per call")
        print(f"  {'call (one child of ours alive, a run)':<66} {'median':>8} {'p99':>8} {'CPU':>8}")
        _row("subreaper.children()  (1 read)", _calls(n, subreaper.children))
        threads = len(os.listdir("/proc/self/task"))  # before a thread of ours (below) starts
        every = _calls(n, lambda: subreaper.children(every_thread=True))
        _row(f"subreaper.children(every_thread=True)  ({threads} thread(s))", every)
        with futures.ThreadPoolExecutor(1) as pool:
            off_main = pool.submit(_calls, n, subreaper.children).result()
        _row("subreaper.children(), off the main thread  (2 reads)", off_main)
        look = _adopted_look(f"run {run_id}:1")
        _row("leftovers.kill_adopted(..., job=job)  (after every run)", asyncio.run(_awaits(n, look)))
        children.append(_child(dict(os.environ), noted=False))  # came to us; not a run's
        with_other = asyncio.run(_awaits(n, look))
        _row("leftovers.kill_adopted, + 1 child not noted  (its environ read)", with_other)
    finally:
        _end(children)


@contextmanager
def idle_processes(count: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    """`count` idle `sleep` processes in one process group of their own, all killed and reaped at
    the end, however the block ends."""
    started: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(count):
            group = started[0].pid if started else 0  # the first one's group; it lives until killpg
            started.append(subprocess.Popen(SLEEP, stdin=subprocess.DEVNULL, process_group=group))
        yield started
    finally:
        if started:
            os.killpg(started[0].pid, signal.SIGKILL)  # its leader is not reaped yet: ours alone
        for process in started:
            process.wait()
        while started:  # one whose Popen a Ctrl-C broke off after the fork: killed, not listed
            try:
                os.waitpid(-started[0].pid, 0)
            except ChildProcessError:
                break


def _environ(pid: int) -> bytes:
    """A process's environment as /proc shows it."""
    with open(f"/proc/{pid}/environ", "rb") as f:
        return f.read()


def _host() -> tuple[int, int]:
    """Processes on the host, and how many of their environments this process may read."""
    pids = [name for name in os.listdir("/proc") if name.isdigit()]
    readable = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                f.read(1)
            readable += 1
        except OSError:
            continue
    return len(pids), readable


async def _rounds(rounds: int, call: Callable[[], Awaitable[object]]) -> PerRound:
    """CPU and wall ms of each of `rounds` rounds, after one not counted."""
    await call()
    cpu: list[float] = []
    wall: list[float] = []
    for _ in range(rounds):
        cpu_started, wall_started = time.process_time(), time.perf_counter()
        await call()
        wall.append((time.perf_counter() - wall_started) * 1e3)
        cpu.append((time.process_time() - cpu_started) * 1e3)
    return cpu, wall


async def _scans(rounds: int) -> list[tuple[str, PerRound]]:
    """Part 2's lines: the scan alone, a round that scans, a round that does not."""

    async def find_marked() -> object:
        return leftovers.find_marked(WORKER_ID)

    async def something_ended() -> object:
        return await leftovers.kill_strays(WORKER_ID, set, last=leftovers.LastLook())

    nothing_ended = leftovers.LastLook()
    await leftovers.kill_strays(WORKER_ID, set, last=nothing_ended)  # the look the next is compared with
    return [
        ("leftovers.find_marked  (the scan alone)", await _rounds(rounds, find_marked)),
        ("leftovers.kill_strays, something ended  (scans)", await _rounds(rounds, something_ended)),
        (
            "leftovers.kill_strays, nothing ended  (no scan)",
            await _rounds(rounds, lambda: leftovers.kill_strays(WORKER_ID, set, last=nothing_ended)),
        ),
    ]


def round_scan(processes: int, rounds: int) -> None:
    """Part 2: the reap round's read of every process's environment, beside `processes` more."""
    with idle_processes(processes) as started:  # each exec'd already: Popen waits for it
        total, readable = _host()
        env_bytes = len(_environ(started[0].pid)) if started else 0
        print(
            f"\n2. the reap round's scan, {processes:,} extra processes, {rounds} rounds: {total:,} "
            f"processes on the host, {readable:,} environments readable (a kernel thread has none), "
            f"the extra ones' {env_bytes:,} bytes"
        )
        print(f"  {'call':<50} {'CPU ms min / median / max':>27} {'wall ms min / median / max':>28}")
        for name, (cpu, wall) in asyncio.run(_scans(rounds)):
            print(f"  {name:<50} {_spread(cpu):>27} {_spread(wall):>28}")


def _spread(values: list[float]) -> str:
    """min / median / max."""
    return f"{min(values):.3f} / {statistics.median(values):.3f} / {max(values):.3f}"


def main() -> None:
    """Parse the arguments, measure, print."""
    parser = argparse.ArgumentParser(
        prog="python -m tests.bench.bench_reap", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--calls", type=int, default=20_000, help="calls per line of part 1")
    parser.add_argument("--processes", type=int, default=2_000, help="extra processes in part 2")
    parser.add_argument("--rounds", type=int, default=10, help="rounds per line of part 2")
    parser.add_argument("--quick", action="store_true", help="2,000 calls and 200 processes")
    args = parser.parse_args()
    calls, processes = (2_000, 200) if args.quick else (args.calls, args.processes)
    subreaper_ = "yes" if subreaper.become() else "no"
    print(
        f"python {sys.version.split()[0]}, kernel {os.uname().release}, {os.cpu_count()} CPUs, "
        f"uid {os.getuid()}, a child subreaper: {subreaper_}, "
        f"load average (1 min) at start: {os.getloadavg()[0]:.2f}"
    )
    # SIGTERM ends the run as Ctrl-C does: the processes started here are killed and reaped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    per_run_look(calls)
    round_scan(processes, args.rounds)
    print(f"\nload average (1 min) at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
