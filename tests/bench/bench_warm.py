"""One warm runner answering no-op jobs one after another: what the exchange costs on each side.

Run on demand: `.venv/bin/python -m tests.bench.bench_warm [--jobs N] [--rounds R]`. It starts one
`app.warm.WarmRunner` on a `modelkit.serve` runner whose job does nothing, sends it N jobs in turn
(no database, no worker), and prints per job: the wall time, this process's CPU (the worker's side:
the job line, the reply, the stderr marker, the result) and the runner process's CPU (from
/proc/<pid>/stat). Best and median of R rounds. Prints, asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import os
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


async def one_round(tmp: Path, jobs: int) -> tuple[float, float, float]:
    """(wall, worker CPU, runner CPU) per job in µs, over `jobs` jobs on a fresh runner."""
    script = tmp / "noop_runner.py"
    script.write_text(RUNNER.format(root=str(ROOT)))
    (tmp / "runner").mkdir(exist_ok=True)
    (tmp / "out").mkdir(exist_ok=True)
    (tmp / "in.png").write_bytes(b"not read")
    launch = warm.Launch(
        name="noop", argv=(sys.executable, str(script)), env=runner.minimal_env(None, {}),
        cwd=tmp / "runner", log_path=tmp / "runner.log",
    )  # fmt: skip
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


async def main_async(jobs: int, rounds: int) -> None:
    results = []
    for _ in range(rounds):
        tmp = Path(tempfile.mkdtemp(prefix="gpujobs-bench-warm-"))
        try:
            results.append(await one_round(tmp, jobs))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
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
    args = parser.parse_args()
    asyncio.run(main_async(args.jobs, args.rounds))


if __name__ == "__main__":
    main()
