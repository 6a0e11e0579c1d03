"""One warm runner answering no-op jobs one after another: what the exchange costs on each side.

Run on demand: `.venv/bin/python -m tests.bench.bench_warm [--jobs N] [--rounds R]`. It starts one
`app.warm.WarmRunner` on a `modelkit.serve` runner whose job does nothing, sends it N jobs in turn
(no database, no worker), and prints per job: the wall time, this process's CPU (the worker's side:
the job line, the reply, the stderr marker, the result) and the runner process's CPU (from
/proc/<pid>/stat). Best and median of R rounds. Before that, it starts S runners one after another
and prints what a start costs until the runner says it is ready: wall time and the runner's CPU
(the interpreter, `import app.modelkit`, the kit's set-up; a real model's load comes on top).
Prints, asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from app import modelkit, runner, warm
from tests.bench import bench_queue as bq

ROOT = Path(__file__).resolve().parents[2]
RUNNER = """
import sys
sys.path.insert(0, {root!r})
from app import modelkit
sys.exit(modelkit.serve(lambda: None, lambda model, job: [], name="noop"))
"""


def noop_launch(tmp: Path) -> warm.Launch:
    """The no-op runner's launch, its script and folders made in `tmp`."""
    script = tmp / "noop_runner.py"
    script.write_text(RUNNER.format(root=str(ROOT)))
    (tmp / "runner").mkdir(exist_ok=True)
    return warm.Launch(
        name="noop", argv=(sys.executable, str(script)), env=runner.minimal_env(None, {}),
        cwd=tmp / "runner", log_path=tmp / "runner.log",
    )  # fmt: skip


async def one_start(tmp: Path) -> tuple[float, float]:
    """(wall ms from launch to the ready line, runner CPU ms over its whole life: it does nothing
    but start and, once its stdin closes, exit). The CPU is the reaped child's (getrusage), exact
    to the microsecond where /proc's ticks are 10 ms."""
    warm_runner = warm.WarmRunner(noop_launch(tmp))
    before = children_cpu_s()
    wall = time.perf_counter()
    await warm_runner.start()
    wall = time.perf_counter() - wall
    await warm_runner.close()
    return wall * 1e3, (children_cpu_s() - before) * 1e3


def children_cpu_s() -> float:
    """User + system CPU seconds of this process's reaped children."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


async def one_round(tmp: Path, jobs: int) -> tuple[float, float, float]:
    """(wall, worker CPU, runner CPU) per job in µs, over `jobs` jobs on a fresh runner."""
    launch = noop_launch(tmp)
    (tmp / "out").mkdir(exist_ok=True)
    (tmp / "in.png").write_bytes(b"not read")
    warm_runner = warm.WarmRunner(launch)
    pid = await warm_runner.start()

    async def on_progress(fraction: float, message: str) -> None:
        """No progress is reported."""

    try:
        wall, mine, theirs = time.perf_counter(), bq.own_cpu_s(), bq.process_cpu_s(pid)
        for i in range(jobs):
            request = modelkit.Request(f"job{i}:1", tmp / "in.png", tmp / "out", {})
            result = await warm_runner.run_job(
                request, timeout_s=30, log_path=tmp / "logs" / f"{i}.log", on_progress=on_progress
            )
            if not result.ok:
                raise RuntimeError(f"job {i}: {result}")
        wall, mine = time.perf_counter() - wall, bq.own_cpu_s() - mine
        theirs = bq.process_cpu_s(pid) - theirs
    finally:
        await warm_runner.close()
    return wall * 1e6 / jobs, mine * 1e6 / jobs, theirs * 1e6 / jobs


async def main_async(jobs: int, rounds: int, starts: int) -> None:
    results, started = [], []
    tmp = Path(tempfile.mkdtemp(prefix="gpujobs-bench-warm-"))
    try:
        for _ in range(starts):
            started.append(await one_start(tmp))
        for _ in range(rounds):
            results.append(await one_round(tmp, jobs))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{starts} no-op runners started in turn, until ready (load {os.getloadavg()[0]:.1f})")
    for name, values in zip(("wall", "runner CPU"), zip(*started, strict=True), strict=True):
        best, median = min(values), statistics.median(values)
        print(f"  {name:<11} per start: best {best:6.1f} ms, median {median:6.1f} ms")
    print(f"one warm runner, {jobs} no-op jobs in turn, {rounds} rounds (load {os.getloadavg()[0]:.1f})")
    for name, values in zip(("wall", "worker CPU", "runner CPU"), zip(*results, strict=True), strict=True):
        print(f"  {name:<11} per job: best {min(values):6.0f} us, median {statistics.median(values):6.0f} us")


def main() -> None:
    """Parse the arguments and run."""
    parser = argparse.ArgumentParser(
        prog="python -m tests.bench.bench_warm", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--jobs", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--starts", type=int, default=20, help="runner starts timed (default 20)")
    args = parser.parse_args()
    asyncio.run(main_async(args.jobs, args.rounds, args.starts))


if __name__ == "__main__":
    main()
