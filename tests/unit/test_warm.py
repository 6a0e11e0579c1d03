"""Tests for app.warm and app.warmpool with real runner processes (tests/models/warm_toy.py, relief)."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import signal
import sys
import textwrap
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trimesh
from PIL import Image

from app import logs, modelkit, runner, warm, warmpool, warmresult

ROOT = Path(__file__).resolve().parents[2]
WARM_TOY = ROOT / "tests" / "models" / "warm_toy.py"
GRACE_S = 0.3
GPU0 = 0


def _launch(tmp_path: Path, name: str, argv: list[str], load_timeout_s: float = 10.0) -> warm.Launch:
    (tmp_path / "runners" / name).mkdir(parents=True, exist_ok=True)
    return warm.Launch(
        name=name,
        argv=tuple(argv),
        env=runner.minimal_env(None, {"PYTHONPATH": str(ROOT)}),
        cwd=tmp_path / "runners" / name,
        log_path=tmp_path / "runners" / f"{name}.log",
        load_timeout_s=load_timeout_s,
    )


def _toy(tmp_path: Path, name: str = "toy", *args: str) -> warm.Launch:
    """warm_toy, counting its loads in tmp_path/<name>.loads."""
    argv = [sys.executable, str(WARM_TOY), "--loads", str(tmp_path / f"{name}.loads"), *args]
    return _launch(tmp_path, name, argv)


def _loads(tmp_path: Path, name: str = "toy") -> int:
    path = tmp_path / f"{name}.loads"
    return len(path.read_text().splitlines()) if path.exists() else 0


class Jobs:
    """Numbered jobs with their own output folder and log; records the progress they report."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.count = 0
        self.progress: list[tuple[float, str]] = []
        (tmp_path / "in.png").write_bytes(b"not really a png")

    async def on_progress(self, fraction: float, message: str) -> None:
        self.progress.append((fraction, message))

    def log(self, n: int) -> str:
        return (self.tmp_path / "logs" / f"job{n}.log").read_text()

    async def run(
        self, warm_runner: warm.WarmRunner, timeout_s: float = 10.0, source: Path | None = None, **params: Any
    ) -> warmresult.WarmResult:
        self.count += 1
        out = self.tmp_path / f"out{self.count}"
        request = modelkit.Request(f"job{self.count}:1", source or self.tmp_path / "in.png", out, params)
        log = self.tmp_path / "logs" / f"job{self.count}.log"
        return await warm_runner.run_job(
            request, timeout_s=timeout_s, log_path=log, on_progress=self.on_progress
        )


@pytest.fixture
async def pool() -> AsyncIterator[warmpool.WarmPool]:
    """A pool whose runners are all closed after the test."""
    pool = warmpool.WarmPool(kill_grace_s=GRACE_S)
    yield pool
    await pool.close_all("test over")


@pytest.fixture
async def paced() -> AsyncIterator[warmpool.WarmPool]:
    """The same, paced: jobs wait for a busy runner unless starting one would serve them sooner."""
    pool = warmpool.WarmPool(kill_grace_s=GRACE_S, paced=True)
    yield pool
    await pool.close_all("test over")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


async def _gone(pid: int, within_s: float = 3.0) -> bool:
    for _ in range(int(within_s / 0.02)):
        if not _alive(pid):
            return True
        await asyncio.sleep(0.02)
    return False


async def _eventually(check: Callable[[], bool], within_s: float = 5.0) -> bool:
    """Wait until `check()` holds; False if it still does not after `within_s`."""
    for _ in range(int(within_s / 0.01)):
        if check():
            return True
        await asyncio.sleep(0.01)
    return check()


async def _dead(warm_runner: warm.WarmRunner) -> bool:
    """Wait until the runner has noticed its end and cleaned up."""
    return await _eventually(lambda: warm_runner.state is warm.RunnerState.DEAD)


KEY = warmpool.RunnerKey("toy", GPU0)


@pytest.mark.asyncio
async def test_one_process_answers_many_jobs_and_loads_once(tmp_path: Path, pool: warmpool.WarmPool) -> None:
    jobs, pids = Jobs(tmp_path), set()
    for _ in range(5):
        async with pool.use(KEY, _toy(tmp_path), hold_mb=1000) as warm_runner:
            result = await jobs.run(warm_runner, steps=2)
            pids.add(warm_runner.pid)
        assert result.ok and result.outputs == ("out.txt",), result
    assert len(pids) == 1 and _loads(tmp_path) == 1
    (runner_,) = pool.runners()
    assert runner_.jobs_done == 5 and runner_.state is warm.RunnerState.IDLE
    assert (tmp_path / "out5" / "out.txt").read_text() == f"job5:1 pid {pids.pop()} input in.png\n"
    # Each job's last word reaches the callback; its first may be merged into it (the feed keeps
    # only the newest update it has not handed on: app/progress.py), as on a busy machine.
    delivered = jobs.progress
    assert delivered.count((1.0, "step 2")) == 5 and set(delivered) <= {(0.5, "step 1"), (1.0, "step 2")}
    assert delivered[-1] == (1.0, "step 2")
    log = jobs.log(3)
    assert log.startswith("[warm] job job3:1 sent to warm runner pid")
    assert "PROGRESS 0.500 step 1" in log and "done after" in log
    assert "job job1:1" not in log  # each job's log holds only its own lines
    assert pool.reserved_mb(GPU0) == 1000 and pool.reserved_mb(1) == 0


@pytest.mark.asyncio
async def test_how_to_start_a_runner_is_worked_out_only_when_one_starts(
    tmp_path: Path, pool: warmpool.WarmPool
) -> None:
    built: list[warm.Launch] = []

    def launch() -> warm.Launch:
        built.append(_toy(tmp_path))
        return built[-1]

    jobs = Jobs(tmp_path)
    for _ in range(3):  # one after another: the first starts the runner, the others reuse it
        async with pool.use(KEY, launch, hold_mb=0) as warm_runner:
            assert (await jobs.run(warm_runner)).ok
    assert len(built) == 1 and _loads(tmp_path) == 1


@pytest.mark.asyncio
async def test_a_runner_that_dies_mid_job_is_replaced(tmp_path: Path, pool: warmpool.WarmPool) -> None:
    jobs = Jobs(tmp_path)
    async with pool.use(KEY, _toy(tmp_path), hold_mb=1000) as first:
        assert (await jobs.run(first)).ok
        crashed = await jobs.run(first, crash=True)
    assert crashed.outcome is warmresult.Outcome.CRASHED and crashed.exit_code == 13
    assert crashed.error == "the runner exited during the job"
    assert first.state is warm.RunnerState.DEAD and pool.runners() == {}
    assert pool.reserved_mb(GPU0) == 0
    async with pool.use(KEY, _toy(tmp_path), hold_mb=1000) as second:
        assert (await jobs.run(second)).ok
    assert second.pid != first.pid and _loads(tmp_path) == 2


@pytest.mark.asyncio
async def test_timeout_kills_the_group_and_the_next_job_gets_a_fresh_runner(
    tmp_path: Path, pool: warmpool.WarmPool
) -> None:
    jobs = Jobs(tmp_path)
    async with pool.use(KEY, _toy(tmp_path), hold_mb=0) as first:
        result = await jobs.run(first, timeout_s=0.5, spawn=True, hang=True)
    assert result.outcome is warmresult.Outcome.TIMED_OUT and result.error == "timed out after 0.5 s"
    assert result.signal is None and result.exit_code is None  # the kill was ours, not a crash
    child = int((tmp_path / "out1" / "child.pid").read_text())
    assert first.pid is not None and await _gone(first.pid) and await _gone(child)
    async with pool.use(KEY, _toy(tmp_path), hold_mb=0) as second:
        assert (await jobs.run(second)).ok
    assert second.pid != first.pid


@pytest.mark.asyncio
async def test_stop_ends_the_job_and_the_runner(tmp_path: Path, pool: warmpool.WarmPool) -> None:
    jobs = Jobs(tmp_path)
    async with pool.use(KEY, _toy(tmp_path), hold_mb=0) as first:
        task = asyncio.create_task(jobs.run(first, hang=True))
        # The feed may coalesce step 1 into step 2 (app/progress.py): the last step says the job hangs.
        assert await _eventually(lambda: jobs.progress[-1:] == [(1.0, "step 2")])
        first.stop("canceled")
        result = await task
    assert result.outcome is warmresult.Outcome.STOPPED and result.stopped == "canceled"
    assert first.state is warm.RunnerState.DEAD and first.pid is not None and await _gone(first.pid)
    assert result.error == "canceled" and "[warm] stopped: canceled after" in result.log_tail
    async with pool.use(KEY, _toy(tmp_path), hold_mb=0) as second:
        second.stop("canceled before the job was sent")
        early = await jobs.run(second)
    assert early.outcome is warmresult.Outcome.STOPPED and not (tmp_path / "out2").exists()
    async with pool.use(KEY, _toy(tmp_path), hold_mb=0) as third:
        assert (await jobs.run(third)).ok
        third.stop("too late: the job has ended")  # forgotten when the runner is handed out again
    async with pool.use(KEY, _toy(tmp_path), hold_mb=0) as again:
        assert again is third and (await jobs.run(again)).ok
    assert _loads(tmp_path) == 3


@pytest.mark.asyncio
async def test_model_errors_keep_or_end_the_runner(tmp_path: Path, pool: warmpool.WarmPool) -> None:
    jobs = Jobs(tmp_path)
    async with pool.use(KEY, _toy(tmp_path), hold_mb=0) as warm_runner:
        with pytest.raises(ValueError):  # a request that cannot be encoded changes nothing
            await jobs.run(warm_runner, sleep=float("nan"))
        bad = await jobs.run(warm_runner, bad_input=True)
        oom = await jobs.run(warm_runner, oom=True)
        assert warm_runner.state is warm.RunnerState.IDLE  # bad input and OOM leave the model usable
        failed = await jobs.run(warm_runner, fail=True)
    assert bad.outcome is warmresult.Outcome.BAD_INPUT and bad.error == "the input is not what warm_toy wants"
    assert oom.outcome is warmresult.Outcome.OOM and "CUDA out of memory" in (oom.error or "")
    assert (
        failed.outcome is warmresult.Outcome.FAILED
        and failed.error == "ValueError: warm_toy failed on purpose"
    )
    assert "Traceback" in failed.log_tail
    assert warm_runner.state is warm.RunnerState.DEAD and _loads(tmp_path) == 1


@pytest.mark.asyncio
async def test_junk_on_the_models_stdout_does_not_break_the_protocol(
    tmp_path: Path, pool: warmpool.WarmPool
) -> None:
    jobs = Jobs(tmp_path)
    async with pool.use(KEY, _toy(tmp_path), hold_mb=0) as warm_runner:
        result = await jobs.run(warm_runner, junk=True)
        assert result.ok and warm_runner.state is warm.RunnerState.IDLE
    assert "junk from print()" in jobs.log(1) and "junk from fd 1" in jobs.log(1)


@pytest.mark.asyncio
async def test_idle_runners_are_closed(tmp_path: Path, pool: warmpool.WarmPool) -> None:
    jobs, other = Jobs(tmp_path), warmpool.RunnerKey("other", GPU0)
    async with pool.use(KEY, _toy(tmp_path), hold_mb=700) as old:
        assert (await jobs.run(old)).ok
    await asyncio.sleep(0.3)
    async with pool.use(other, _toy(tmp_path, "other"), hold_mb=300) as recent:
        assert (await jobs.run(recent)).ok
    assert pool.reserved_mb(GPU0) == 1000
    closed = await pool.idle_close(older_than_s=0.2)
    assert [(c.key, c.pid, c.hold_mb) for c in closed] == [(KEY, old.pid, 700)]
    assert old.state is warm.RunnerState.DEAD and old.pid is not None and not _alive(old.pid)
    assert list(pool.runners()) == [recent] and pool.reserved_mb(GPU0) == 300
    assert await pool.idle_close(older_than_s=60) == []


@pytest.mark.asyncio
async def test_eviction_frees_the_least_recently_used_runner(tmp_path: Path, pool: warmpool.WarmPool) -> None:
    jobs = Jobs(tmp_path)
    a, b, c = (warmpool.RunnerKey(m, g) for m, g in (("a", GPU0), ("b", GPU0), ("c", 1)))
    started = {}
    for key in (a, b, c):
        async with pool.use(key, _toy(tmp_path, key.model), hold_mb=1000) as warm_runner:
            assert (await jobs.run(warm_runner)).ok
            started[key] = warm_runner
    assert pool.warm_keys() == {a, b, c} and pool.idle_hold_mb(b) == 1000
    assert await pool.evict_lru(GPU0, 5000, keep=b) != []  # only a could go: b is kept
    assert pool.warm_keys() == {b, c}
    async with pool.use(a, _toy(tmp_path, "a"), hold_mb=1000):  # a is back, and in use
        assert pool.reserved_mb(GPU0) == 1000
        assert await pool.evict_lru(GPU0, 1, keep=a) == [
            warmpool.Closed(b, started[b].pid, 1000, "evicted: 1 MB needed on GPU 0")
        ]
        assert pool.reserved_mb(GPU0) == 0 and await pool.evict_lru(GPU0, 1) == []  # a is in use
    assert pool.reserved_mb(GPU0) == 1000 and pool.reserved_mb(1) == 1000
    assert started[b].pid is not None and not _alive(started[b].pid)
    assert started[c].state is warm.RunnerState.IDLE
    again = await pool.acquire(c, _toy(tmp_path, "c"), hold_mb=1000)
    assert again is started[c] and pool.reserved_mb(1) == 0  # in use: its job's reservation covers it
    pool.release(again, hold_mb=2500)  # e.g. what NVML shows the runner holding after the job
    assert pool.reserved_mb(1) == 2500 and pool.idle_hold_mb(c) == 2500


@pytest.mark.asyncio
async def test_start_failures(tmp_path: Path, pool: warmpool.WarmPool) -> None:
    with pytest.raises(warmresult.StartFailed, match=r"exited while loading \(exit code 3\)") as failed:
        await pool.acquire(KEY, _toy(tmp_path, "toy", "--fail-load"), hold_mb=0)
    assert "load failed on purpose" in str(failed.value) and failed.value.exit_code == 3
    slow = _launch(
        tmp_path, "slow", [sys.executable, str(WARM_TOY), "--load-sleep", "30"], load_timeout_s=0.5
    )
    with pytest.raises(warmresult.StartFailed, match=r"not ready after 0\.5 s") as failed:
        await pool.acquire(KEY, slow, hold_mb=0)
    assert failed.value.exit_code is None  # killed by us: its exit code says nothing of the model
    missing = _launch(tmp_path, "missing", [str(tmp_path / "no-such-program")])
    with pytest.raises(warmresult.StartFailed, match="could not be started"):
        await pool.acquire(KEY, missing, hold_mb=0)
    stopping = asyncio.create_task(pool.acquire(KEY, slow, hold_mb=0))
    await asyncio.sleep(0.2)
    for warm_runner in pool.runners():
        warm_runner.stop("canceled")
    with pytest.raises(warmresult.StartFailed, match="stopped while loading: canceled"):
        await stopping
    assert pool.runners() == {} and pool.reserved_mb(GPU0) == 0


@pytest.mark.asyncio
async def test_giving_up_while_a_runner_loads_stops_the_load(tmp_path: Path, pool: warmpool.WarmPool) -> None:
    """A job canceled (or its lease lost, or the worker stopping) while its runner loads does not
    wait out the load: the start is stopped and acquire() gives up, holding nothing."""
    stop = asyncio.Event()
    slow = _toy(tmp_path, "toy", "--load-sleep", "30")  # load_timeout_s is 10
    acquiring = asyncio.create_task(pool.acquire(KEY, slow, hold_mb=500, give_up=stop))
    assert await _eventually(lambda: _loads(tmp_path) == 1)
    [loading] = pool.runners()
    stop.set()
    with pytest.raises(warmpool.GaveUp):
        await asyncio.wait_for(acquiring, 5)
    assert loading.pid is not None and not _alive(loading.pid)
    assert pool.runners() == {} and pool.reserved_mb(GPU0) == 0 and pool.warm_keys() == set()


@pytest.mark.asyncio
async def test_a_start_cancelled_while_spawning_leaves_nothing_held(
    tmp_path: Path, pool: warmpool.WarmPool
) -> None:
    acquiring = asyncio.create_task(pool.acquire(KEY, _toy(tmp_path), hold_mb=500))
    await asyncio.sleep(0)  # the process is forked; asyncio waits for its pipes
    acquiring.cancel()
    with pytest.raises(asyncio.CancelledError):
        await acquiring
    # Left "starting", it would hold its 500 MB and count as warm (paced: block every start) for good.
    assert pool.runners() == {} and pool.reserved_mb(GPU0) == 0 and pool.warm_keys() == set()


@pytest.mark.asyncio
async def test_a_runner_closed_while_it_is_spawned_is_killed_before_its_folder_goes(tmp_path: Path) -> None:
    """close() came while asyncio still connected the new process's pipes (a worker stopping, an
    eviction): the end found no process yet, so it killed none. The runner loaded and waited for
    jobs, alive, and its TMPDIR was removed under it (its temporary files then went to /tmp).
    Now the end waits for the spawn, kills what it made, and only then removes the folder."""
    temp = tmp_path / "runner-tmp"
    temp.mkdir()
    toy = _toy(tmp_path)
    launch = dataclasses.replace(toy, env={**toy.env, "TMPDIR": str(temp)}, temp_dir=temp)
    warm_runner = warm.WarmRunner(launch, kill_grace_s=GRACE_S)
    starting = asyncio.create_task(warm_runner.start())
    await asyncio.sleep(0)  # the process is forked; asyncio waits for its pipes
    closing = warm_runner.close("worker stopping")
    with pytest.raises(warmresult.StartFailed):
        await asyncio.wait_for(starting, 10)
    await asyncio.wait_for(closing, 10)
    assert warm_runner.pid is not None and not _alive(warm_runner.pid)
    assert warm_runner.state is warm.RunnerState.DEAD
    assert await _eventually(lambda: not temp.exists())  # removed off the loop, after the kill


def _script(tmp_path: Path, name: str, body: str) -> warm.Launch:
    """A runner that speaks the protocol by hand (badly)."""
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(body))
    return _launch(tmp_path, name, [sys.executable, str(path)])


READY = "import json, os, sys, time\nprint(json.dumps({'ready': True, 'pid': os.getpid()}), flush=True)\n"


@pytest.mark.asyncio
async def test_protocol_violations_end_the_runner(tmp_path: Path, pool: warmpool.WarmPool) -> None:
    jobs = Jobs(tmp_path)
    cases = {
        "chatty": READY + "sys.stdin.readline()\nprint('hello from the model', flush=True)\ntime.sleep(30)\n",
        "other_job": READY + "sys.stdin.readline()\nprint(json.dumps({'job': 'x:1', 'done': True}))\n",
        "no_newline": READY + "sys.stdin.readline()\nsys.stdout.write('{\"job\"')\n",
    }
    for name, body in cases.items():
        async with pool.use(KEY, _script(tmp_path, name, body), hold_mb=0) as warm_runner:
            result = await jobs.run(warm_runner)
        assert result.outcome is warmresult.Outcome.BROKE, name
        assert (result.error or "").startswith("protocol error"), result.error
        assert (result.exit_code, result.signal) == (None, None)  # ended by the worker: says nothing
        assert warm_runner.state is warm.RunnerState.DEAD
    assert "hello from the model" in jobs.log(1)


@pytest.mark.asyncio
async def test_a_runner_that_dies_or_talks_while_idle_is_replaced(
    tmp_path: Path, pool: warmpool.WarmPool
) -> None:
    chatty = _script(tmp_path, "idle_chatty", READY + "time.sleep(0.3)\nprint('out of turn', flush=True)\n")
    warm_runner = await pool.acquire(KEY, chatty, hold_mb=500)
    pool.release(warm_runner)
    assert await _dead(warm_runner) and pool.reserved_mb(GPU0) == 0
    victim = await pool.acquire(KEY, _toy(tmp_path), hold_mb=0)
    pool.release(victim)
    assert victim.pid is not None
    os.kill(victim.pid, signal.SIGKILL)
    assert await _dead(victim) and victim.describe_exit() == "killed by signal 9"
    replacement = await pool.acquire(KEY, _toy(tmp_path), hold_mb=0)
    assert replacement is not victim and (await Jobs(tmp_path).run(replacement)).ok
    pool.release(replacement)


@pytest.mark.asyncio
async def test_close_lets_the_runner_exit_by_itself_and_close_all_stops_jobs(
    tmp_path: Path, pool: warmpool.WarmPool
) -> None:
    jobs = Jobs(tmp_path)
    warm_runner = await pool.acquire(KEY, _toy(tmp_path), hold_mb=0)
    pool.release(warm_runner)
    await warm_runner.close()
    assert warm_runner.describe_exit() == "exit code 0"
    busy = await pool.acquire(KEY, _toy(tmp_path), hold_mb=0)
    task = asyncio.create_task(jobs.run(busy, hang=True))
    assert await _eventually(lambda: bool(jobs.progress))
    closed = await pool.close_all("worker stopping")
    result = await task
    assert [c.pid for c in closed] == [busy.pid]
    assert result.outcome is warmresult.Outcome.STOPPED and result.stopped == "worker stopping"
    pool.release(busy)
    assert pool.runners() == {}


def _picture(path: Path) -> Path:
    ramp = np.linspace(0, 255, 64, dtype=np.float64)[None, :].repeat(32, axis=0)
    Image.fromarray(ramp.astype(np.uint8), "L").save(path)
    return path


@pytest.mark.asyncio
async def test_relief_serves_two_jobs_in_one_process(tmp_path: Path, pool: warmpool.WarmPool) -> None:
    jobs = Jobs(tmp_path)
    argv = [sys.executable, "-m", "app.relief", "--serve", "--device", "cpu"]
    source = _picture(tmp_path / "ramp.png")
    key = warmpool.RunnerKey("relief", None)
    async with pool.use(key, _launch(tmp_path, "relief", argv, load_timeout_s=60), hold_mb=0) as relief:
        first = await jobs.run(relief, source=source, format="glb", resolution=32)
        second = await jobs.run(relief, source=source, format="glb", width_mm=50, invert=True)
        bad = await jobs.run(relief, source=source, resolution=True)
        unreadable = await jobs.run(relief)  # in.png is not an image
        assert relief.state is warm.RunnerState.IDLE and relief.jobs_done == 4
    assert first.ok and second.ok and first.outputs == ("mesh.glb",), (first, second)
    for n in (1, 2):
        mesh = trimesh.load(tmp_path / f"out{n}" / "mesh.glb", force="mesh")
        assert isinstance(mesh, trimesh.Trimesh) and mesh.is_watertight and mesh.volume > 0
    assert bad.outcome is warmresult.Outcome.BAD_INPUT and "params.resolution" in (bad.error or "")
    assert unreadable.outcome is warmresult.Outcome.BAD_INPUT and "cannot read image" in (
        unreadable.error or ""
    )
    # Its updates come faster than the feed hands them on (app/progress.py): each job's last arrives.
    assert jobs.progress.count((1.0, "written")) == 2
    assert "relief: device cpu" in (tmp_path / "runners" / "relief.log").read_text()


async def test_the_kits_end_line_spares_the_stderr_wait(tmp_path: Path, pool: warmpool.WarmPool) -> None:
    jobs = Jobs(tmp_path)
    async with pool.use(KEY, _toy(tmp_path), hold_mb=1000) as warm_runner:
        await jobs.run(warm_runner, steps=0)  # loaded and warm
        started = asyncio.get_running_loop().time()
        for _ in range(20):
            assert (await jobs.run(warm_runner, steps=0, junk=True)).ok
        took_s = asyncio.get_running_loop().time() - started
    # Without the end line each job waits warm._STDERR_SETTLE_S (20 ms) for stderr: 0.4 s at least.
    assert took_s < 20 * warm._STDERR_SETTLE_S, took_s
    log = jobs.log(21)
    assert "junk from print()" in log and "junk from fd 1" in log  # its stderr was all there
    assert "[modelkit] job" not in log  # the end line is protocol: in no log


@pytest.mark.asyncio
async def test_a_slow_progress_callback_does_not_hold_up_the_jobs_answer(
    tmp_path: Path, pool: warmpool.WarmPool
) -> None:
    """Progress is written to the database; a slow write (the database away) must not keep the
    runner's answer unread until the job times out, as a one-shot run's pipes are not held up."""
    seen: list[float] = []

    async def slow(fraction: float, _message: str) -> None:
        await asyncio.sleep(3.0 if not seen else 0.0)
        seen.append(fraction)

    async with pool.use(KEY, _toy(tmp_path), hold_mb=0) as warm_runner:
        request = modelkit.Request("slow:1", tmp_path / "in.png", tmp_path / "out", {"steps": 2})
        result = await warm_runner.run_job(
            request, timeout_s=1.5, log_path=tmp_path / "job.log", on_progress=slow
        )
        assert result.outcome is warmresult.Outcome.DONE, result
        # The newest, in order, before run_job() returned: the feed may coalesce 0.5 into 1.0 when
        # both came before the first was handed on (app/progress.py), as under a loaded machine.
        assert seen in ([0.5, 1.0], [1.0]), seen
        assert warm_runner.state is warm.RunnerState.IDLE


@pytest.mark.asyncio
async def test_a_quiet_job_that_ended_well_makes_no_log_file(tmp_path: Path, pool: warmpool.WarmPool) -> None:
    jobs = Jobs(tmp_path)
    async with pool.use(KEY, _toy(tmp_path), hold_mb=1000) as warm_runner:
        quiet = await jobs.run(warm_runner, steps=0)
        hung = await jobs.run(warm_runner, timeout_s=0.3, steps=0, hang=True)  # says nothing either
    assert quiet.ok and "done after" in quiet.log_tail  # the worker's lines are in the tail ...
    assert not (tmp_path / "logs" / "job1.log").exists()  # ... but made no file for a quiet success
    log = jobs.log(2)  # a failure always has its log, printed or not
    assert hung.outcome is warmresult.Outcome.TIMED_OUT
    assert log.startswith("[warm] job job2:1 sent to warm runner pid") and "timed out after 0.3 s" in log
    runner_log = (tmp_path / "runners" / "toy.log").read_text()
    assert "ready: model" in runner_log and "[modelkit] job" not in runner_log


# -- pacing: how many runners a key gets ------------------------------------------------------


async def _concurrent_jobs(
    tmp_path: Path, pool: warmpool.WarmPool, count: int, *, load_s: float, **params: Any
) -> set[int | None]:
    """`count` jobs at once, each in a runner from `pool` (`load_s` to load); their runners' pids."""
    jobs, launch = Jobs(tmp_path), _toy(tmp_path, "toy", "--load-sleep", str(load_s))

    async def one() -> int | None:
        async with pool.use(KEY, launch, hold_mb=0) as warm_runner:
            assert (await jobs.run(warm_runner, **params)).outcome is warmresult.Outcome.DONE
            return warm_runner.pid

    return set(await asyncio.gather(*(one() for _ in range(count))))


@pytest.mark.asyncio
async def test_jobs_of_a_quick_model_wait_for_a_busy_runner_rather_than_start_one_each(
    tmp_path: Path, paced: warmpool.WarmPool
) -> None:
    pids = await _concurrent_jobs(tmp_path, paced, 8, load_s=0.6)
    # One start at a time while the pace is unknown: the first runner, and one more as it came up;
    # then a job takes milliseconds against a 0.6 s start, so the rest waited for those two.
    assert len(pids) <= 2 and _loads(tmp_path) == len(pids)
    pace = paced.pace[KEY]
    assert pace.start_s is not None and pace.start_s >= 0.6 and pace.run_s is not None and pace.run_s < 0.3


@pytest.mark.asyncio
async def test_an_unpaced_pool_starts_a_runner_for_every_job_that_finds_none_idle(
    tmp_path: Path, pool: warmpool.WarmPool
) -> None:
    pids = await _concurrent_jobs(tmp_path, pool, 8, load_s=0.6)
    assert len(pids) == 8 and _loads(tmp_path) == 8


@pytest.mark.asyncio
async def test_jobs_that_would_wait_longer_than_a_start_get_runners_of_their_own(
    tmp_path: Path, paced: warmpool.WarmPool
) -> None:
    pids = await _concurrent_jobs(tmp_path, paced, 4, load_s=0.05, sleep=1.0)
    # A runner starts only when none of the key is idle: four runners, so the jobs ran side by side.
    assert len(pids) == 4 and _loads(tmp_path) == 4


@pytest.mark.asyncio
async def test_a_waiting_job_gets_the_runner_that_frees_first_or_gives_up_when_stopped(
    tmp_path: Path, paced: warmpool.WarmPool
) -> None:
    jobs, launch = Jobs(tmp_path), _toy(tmp_path, "toy", "--load-sleep", "1.0")
    async with paced.use(KEY, launch, hold_mb=0) as warm_runner:  # the pace: a slow start, quick jobs
        await jobs.run(warm_runner)
    busy = await paced.acquire(KEY, launch, hold_mb=0)
    assert paced.idle(KEY) == [] and paced.warm_keys() == {KEY}  # busy, and still loaded for a claim
    stop = asyncio.Event()
    stopped = asyncio.create_task(paced.acquire(KEY, launch, hold_mb=0, give_up=stop))
    waiting = asyncio.create_task(paced.acquire(KEY, launch, hold_mb=0))
    await asyncio.sleep(0.1)
    assert not stopped.done() and not waiting.done()  # in line: a start would cost more than a wait
    stop.set()
    with pytest.raises(warmpool.GaveUp):
        await asyncio.wait_for(stopped, 1)
    paced.release(busy)
    assert await asyncio.wait_for(waiting, 1) is busy  # handed over, first come first served
    paced.release(busy)
    assert _loads(tmp_path) == 1
    held = await paced.acquire(KEY, launch, hold_mb=0)
    left = asyncio.create_task(paced.acquire(KEY, launch, hold_mb=0))
    await asyncio.sleep(0.05)
    await paced.close_all("worker stopping")  # the line is told too
    with pytest.raises(warmpool.GaveUp, match="worker stopping"):
        await asyncio.wait_for(left, 1)
    assert held.state is warm.RunnerState.DEAD


@pytest.mark.asyncio
async def test_a_runner_that_ends_as_it_is_handed_over_is_not_given_to_the_waiting_job(
    tmp_path: Path, paced: warmpool.WarmPool
) -> None:
    """A runner handed to the job waiting in line could end before that job woke up (it exited,
    it was killed): the job got a dead runner and failed as an internal error. Here it is closed
    in the same turn as its hand-over; the job must get a live runner instead, a new one here."""
    jobs, launch = Jobs(tmp_path), _toy(tmp_path, "toy", "--load-sleep", "0.5")
    async with paced.use(KEY, launch, hold_mb=0) as warm_runner:  # the pace: a slow start, quick jobs
        await jobs.run(warm_runner)
    busy = await paced.acquire(KEY, launch, hold_mb=0)
    waiting = asyncio.create_task(paced.acquire(KEY, launch, hold_mb=0))
    await asyncio.sleep(0.1)
    assert not waiting.done()  # in line for the busy one
    paced.release(busy)  # handed over to the waiting job...
    ended = busy.close("ended on its way")  # ...and gone before that job runs again
    got = await asyncio.wait_for(waiting, 10)
    await ended
    assert got is not busy and got.state is warm.RunnerState.IDLE
    assert (await jobs.run(got)).outcome is warmresult.Outcome.DONE
    paced.release(got)
    assert _loads(tmp_path) == 2


@pytest.mark.asyncio
async def test_the_pool_reports_its_runners_for_the_heartbeat(
    tmp_path: Path, pool: warmpool.WarmPool
) -> None:
    jobs, other = Jobs(tmp_path), warmpool.RunnerKey("toy", 1)
    starting = asyncio.ensure_future(
        pool.acquire(KEY, _toy(tmp_path, "toy", "--load-sleep", "0.5"), hold_mb=1000)
    )
    assert await _eventually(lambda: bool(pool.report(GPU0)))
    [row] = pool.report(GPU0)
    assert (row["model"], row["state"], row["jobs"], row["load_s"], row["vram_mb"]) == (
        "toy",
        "starting",
        0,
        None,
        1000,
    )
    warm_runner = await starting
    [row] = pool.report(GPU0)
    assert row["state"] == "busy" and row["pid"] == warm_runner.pid and row["load_s"] >= 0.5
    assert row["idle_s"] is None
    assert (await jobs.run(warm_runner)).ok
    pool.release(warm_runner)
    [row] = pool.report(GPU0)
    assert (row["state"], row["jobs"]) == ("idle", 1) and 0 <= row["idle_s"] < 5
    assert row["up_s"] >= round(row["load_s"], 1)  # up_s is rounded to 0.1 s, load_s to 1 ms
    assert pool.report(1) == [] and pool.starts_on(GPU0) == {"toy": 1} and pool.starts_on(1) == {}

    async with pool.use(other, _toy(tmp_path, "other"), hold_mb=500):
        assert [r["state"] for r in pool.report(1)] == ["busy"]
    assert warm_runner.pid is not None
    os.kill(warm_runner.pid, signal.SIGKILL)  # a runner that died is not reported; its start still counts
    assert await _dead(warm_runner)
    assert pool.report(GPU0) == [] and pool.starts_on(GPU0) == {"toy": 1}
    async with pool.use(KEY, _toy(tmp_path), hold_mb=1000):
        assert pool.starts_on(GPU0) == {"toy": 2} and [r["jobs"] for r in pool.report(GPU0)] == [0]


# Forks a helper that keeps the runner's stdout open (as a DataLoader worker or a multiprocessing
# child would) and writes its pid to argv[2], then exits with code 3: while loading, idle or in a job.
FORKS_AND_EXITS = """
import json, os, sys, time
where, helper_pid = sys.argv[1], sys.argv[2]
def fork_then_exit():
    if os.fork() == 0:
        time.sleep(30)
        os._exit(0)
    open(helper_pid, "w").write(str(os.getpid() + 1))
    os._exit(3)
if where == "loading":
    fork_then_exit()
print(json.dumps({"ready": True, "pid": os.getpid()}), flush=True)
if where == "idle":
    time.sleep(0.3)
    fork_then_exit()
sys.stdin.readline()
fork_then_exit()
"""


def _forks_and_exits(tmp_path: Path, where: str) -> tuple[warm.Launch, Path]:
    script, pid_file = tmp_path / "forks_and_exits.py", tmp_path / f"helper-{where}.pid"
    script.write_text(FORKS_AND_EXITS)
    return _launch(tmp_path, where, [sys.executable, str(script), where, str(pid_file)]), pid_file


def _helper_pid(pid_file: Path) -> int:
    return int(pid_file.read_text())


async def _helper_gone(pid_file: Path) -> bool:
    """The forked helper, once it wrote its pid, went with its runner (the group is killed)."""
    return await _eventually(pid_file.exists) and await _gone(_helper_pid(pid_file))


@pytest.mark.asyncio
async def test_a_runner_whose_forked_helper_holds_its_stdout_is_seen_to_exit(
    tmp_path: Path, pool: warmpool.WarmPool
) -> None:
    """A runner's end was seen only as its stdout's end, which a forked helper holding the pipe
    put off for as long as it lived: the load ran to its timeout, an idle runner stayed idle with
    its memory held, and a job ran out its timeout instead of ending as a crash."""
    loading, pid_file = _forks_and_exits(tmp_path, "loading")
    began = asyncio.get_running_loop().time()
    with pytest.raises(warmresult.StartFailed, match=r"exited while loading \(exit code 3\)"):
        await pool.acquire(KEY, loading, hold_mb=0)  # load_timeout_s is 10 s
    assert asyncio.get_running_loop().time() - began < 3 and await _helper_gone(pid_file)

    idle, pid_file = _forks_and_exits(tmp_path, "idle")
    warm_runner = await pool.acquire(KEY, idle, hold_mb=800)
    pool.release(warm_runner)
    assert await _eventually(lambda: warm_runner.state is warm.RunnerState.DEAD, within_s=3)
    assert pool.reserved_mb(GPU0) == 0 and pool.idle(KEY) == [] and await _helper_gone(pid_file)

    in_job, pid_file = _forks_and_exits(tmp_path, "job")
    async with pool.use(KEY, in_job, hold_mb=0) as warm_runner:
        result = await Jobs(tmp_path).run(warm_runner, timeout_s=10)
    assert (result.outcome, result.error, result.exit_code) == (
        warmresult.Outcome.CRASHED, "the runner exited during the job", 3,
    )  # fmt: skip
    assert result.duration_s < 3 and await _helper_gone(pid_file)


@pytest.mark.asyncio
async def test_half_a_line_out_of_turn_ends_an_idle_runner_before_any_job_meets_it(
    tmp_path: Path, pool: warmpool.WarmPool
) -> None:
    """An unfinished line written while idle waited in the pipe and was read as the start of the
    next job's reply: that job crashed on a line it never caused."""
    body = READY + "time.sleep(0.2)\nsys.stdout.write('{\"job\":')\nsys.stdout.flush()\ntime.sleep(30)\n"
    warm_runner = await pool.acquire(KEY, _script(tmp_path, "half_line", body), hold_mb=0)
    pool.release(warm_runner)
    assert await _dead(warm_runner)
    async with pool.use(KEY, _toy(tmp_path), hold_mb=0) as fresh:
        assert fresh is not warm_runner and (await Jobs(tmp_path).run(fresh)).ok
    runner_log = (tmp_path / "runners" / "half_line.log").read_text()
    assert "spoke out of turn" in runner_log and "unfinished line" in runner_log


@pytest.mark.asyncio
async def test_eviction_spares_only_the_runner_the_kept_model_will_reuse(
    tmp_path: Path, pool: warmpool.WarmPool
) -> None:
    """Two idle runners of one model (two of its jobs ran side by side): a third job of it reuses
    one, and the claim counted the other's memory as free to take. Eviction spared both."""
    jobs = Jobs(tmp_path)
    first = await pool.acquire(KEY, _toy(tmp_path), hold_mb=3000)
    second = await pool.acquire(KEY, _toy(tmp_path), hold_mb=3000)
    assert (await jobs.run(first)).ok and (await jobs.run(second)).ok
    pool.release(first)
    pool.release(second)  # the most recently used: acquire(KEY) takes this one
    closed = await pool.evict_lru(GPU0, 3000, keep=KEY)
    assert [c.pid for c in closed] == [first.pid] and pool.idle(KEY) == [second]
    assert pool.idle_hold_mb(KEY) == 3000 and pool.reserved_mb(GPU0) == 3000


@pytest.mark.asyncio
async def test_a_start_that_cannot_be_worked_out_leaves_no_job_waiting_for_ever(
    tmp_path: Path, paced: warmpool.WarmPool
) -> None:
    """Paced, the job told to start a runner raised when working out how (its folder could not be
    made, say) and left the line without handing the turn on: the jobs behind it waited for ever."""
    launch = _toy(tmp_path, "toy", "--load-sleep", "0.5")
    first = asyncio.create_task(paced.acquire(KEY, launch, hold_mb=0))  # starts one; the pace is unknown
    await asyncio.sleep(0.05)
    calls = []

    def broken() -> warm.Launch:
        calls.append(1)
        raise OSError("No space left on device")

    behind = [asyncio.create_task(paced.acquire(KEY, broken, hold_mb=0)) for _ in range(2)]
    busy = await asyncio.wait_for(first, 10)  # its start measured, the first in line is told to start one
    for task in behind:
        with pytest.raises(OSError, match="No space left"):
            await asyncio.wait_for(task, 5)
    assert len(calls) == 2
    paced.release(busy)


class Contexts(logging.Handler):
    """Records each warm-runner log line's action with the log context it was written in."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.seen: list[tuple[str | None, str | None, int | None, str | None]] = []

    def emit(self, record: logging.LogRecord) -> None:
        action = getattr(record, "action", None)
        self.seen.append((action, logs.JOB_ID.get(), logs.ATTEMPT.get(), logs.WORKER.get()))


@pytest.mark.asyncio
async def test_a_runner_logs_its_life_after_its_first_job_under_no_job(
    tmp_path: Path, pool: warmpool.WarmPool
) -> None:
    """A runner's reader and exit-watcher tasks were made in the task of the job that started it,
    and copied its log context: its death while idle, hours later, was logged under that job and
    attempt, and the next jobs' progress callbacks ran under it too. Its tasks keep the worker only;
    each job's progress runs under that job."""
    handler, logger = Contexts(), logging.getLogger("gpujobs.warm")
    logger.addHandler(handler)
    logs.bind(worker="test:w")
    progress_of: list[str | None] = []

    async def on_progress(_fraction: float, _message: str) -> None:
        progress_of.append(logs.JOB_ID.get())

    async def job(name: str) -> warm.WarmRunner:
        logs.bind(job_id=name, attempt=1)  # as an attempt's task does
        async with pool.use(KEY, _toy(tmp_path), hold_mb=0) as warm_runner:
            request = modelkit.Request(f"{name}:1", tmp_path / "in.png", tmp_path / name, {"steps": 2})
            result = await warm_runner.run_job(
                request, timeout_s=10, log_path=tmp_path / f"{name}.log", on_progress=on_progress
            )
            assert result.ok, result
        return warm_runner

    try:
        (tmp_path / "in.png").write_bytes(b"not really a png")
        first = await asyncio.create_task(job("job-a"))
        assert await asyncio.create_task(job("job-b")) is first
        assert first.pid is not None
        os.kill(first.pid, signal.SIGKILL)
        assert await _dead(first)
    finally:
        logger.removeHandler(handler)
    [ended] = [seen for seen in handler.seen if seen[0] == "runner_ended"]
    assert ended == ("runner_ended", None, None, "test:w"), handler.seen
    # One or two updates of each (a second printed at once is coalesced), each under its own job.
    assert [name for name, _ in itertools.groupby(progress_of)] == ["job-a", "job-b"]
