"""What starting and reaping a one-shot model costs: runner.ModelProcess against bare process starts.

Run on demand: `.venv/bin/python -m tests.bench.bench_spawn [--runs N] [--concurrency K]`. It prints,
asserts nothing. Each line gives the best of `--rounds` rounds of N runs of `/bin/true`: runs/s, and the
median CPU per run of this process (user, system) and of its children (the `/bin/true` processes),
from getrusage. With vfork, a child's time before its exec counts as the child's.

- subprocess.run: `subprocess.run(["/bin/true"])` in a loop, one at a time: the reference line.
- asyncio exec: `asyncio.create_subprocess_exec("/bin/true")` + `wait()`, no pipes, K at a time.
- ModelProcess: `start()` + `wait()` of `/bin/true` with a log file per run, K at a time, the way a
  worker runs a one-shot model (its environment from `minimal_env`, a progress callback, the pidfd
  child watcher on).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from app import childprocess, runner

TRUE = "/bin/true"


Figures = tuple[float, float, float, float]  # runs/s; CPU ms per run: own user, own system, children


def _cpu() -> tuple[float, float, float]:
    """CPU seconds so far: this process's user and system time, its reaped children's user + system."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime, own.ru_stime, children.ru_utime + children.ru_stime


def _measure(runs: int, go: Callable[[], None]) -> Figures:
    """The figures of one round."""
    before = _cpu()
    started = time.perf_counter()
    go()
    took_s = time.perf_counter() - started
    after = _cpu()
    user, system, children = ((b - a) * 1000 / runs for a, b in zip(before, after, strict=True))
    return runs / took_s, user, system, children


def _bare(runs: int) -> None:
    """The reference: a plain blocking start and reap, one at a time."""
    for _ in range(runs):
        subprocess.run([TRUE], check=True)


async def _in_parallel(runs: int, concurrency: int, one: Callable[[int], Awaitable[None]]) -> None:
    """Call `one(i)` for i in range(runs), `concurrency` at a time."""
    counter = iter(range(runs))

    async def lane() -> None:
        for i in counter:
            await one(i)

    await asyncio.gather(*(asyncio.create_task(lane(), name=f"bench-lane-{k}") for k in range(concurrency)))


async def _asyncio_exec(i: int) -> None:
    """asyncio's own subprocess machinery, no pipes."""
    proc = await asyncio.create_subprocess_exec(TRUE)
    if await proc.wait() != 0:
        raise RuntimeError(f"{TRUE} failed")


def _model_process(tmp: Path) -> Callable[[int], Awaitable[None]]:
    """A run as a worker makes it: its own log file, a minimal environment."""
    env = runner.minimal_env(None, {"HOME": str(tmp)})

    async def on_progress(fraction: float, message: str) -> None:
        """A worker always passes one; /bin/true never calls it."""

    async def one(i: int) -> None:
        log_path = tmp / "logs" / f"{i % 64}.log"
        process = runner.ModelProcess(
            [TRUE], cwd=tmp, env=env, log_path=log_path, timeout_s=60.0, on_progress=on_progress
        )
        await process.start()
        if not (await process.wait()).ok:
            raise RuntimeError(f"{TRUE} failed")

    return one


def _run_async(runs: int, concurrency: int, one: Callable[[int], Awaitable[None]]) -> Callable[[], None]:
    """A round on a fresh event loop with the pidfd child watcher, as in a worker."""

    async def main() -> None:
        childprocess.prefer_pidfd_watcher()
        await _in_parallel(runs, concurrency, one)

    return lambda: asyncio.run(main())


def _line(name: str, figures: list[Figures]) -> None:
    """Print the best round (by runs/s), the median CPU per run, and every round's rate."""
    rate = max(f[0] for f in figures)
    user, system, children = (statistics.median(f[i] for f in figures) for i in (1, 2, 3))
    rates = " ".join(f"{f[0]:,.0f}" for f in figures)
    print(
        f"{name:<36} {rate:>6,.0f} runs/s   CPU ms/run: this process {user:.3f} user + {system:.3f} "
        f"system, /bin/true {children:.3f}   (rounds: {rates})"
    )


def main() -> None:
    """Parse the arguments, measure, print."""
    parser = argparse.ArgumentParser(
        prog="python -m tests.bench.bench_spawn", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--runs", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    runs, k = args.runs, args.concurrency
    print(f"load average (1 min) at start: {os.getloadavg()[0]:.2f}; cores: {os.cpu_count()}")
    tmp = Path(tempfile.mkdtemp(prefix="gpujobs-spawn-"))
    try:
        cases: list[tuple[str, Callable[[], None]]] = [
            ("subprocess.run, 1 at a time", lambda: _bare(runs)),
            (f"asyncio exec, no pipes, {k} at a time", _run_async(runs, k, _asyncio_exec)),
            (f"ModelProcess, {k} at a time", _run_async(runs, k, _model_process(tmp))),
        ]
        for name, go in cases:
            _line(name, [_measure(runs, go) for _ in range(args.rounds)])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"load average (1 min) at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
