"""What a one-shot run leaves behind: a process it started outside its process group (in a
session of its own, which the group's kill misses) dies with the run, and writes nothing into
the next job's scratch lane; the files it left in its lane are removed off the event loop."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import signal
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from app.queue.jobs import JobState
from tests.conftest import script_model, toy_model
from tests.integration.test_durability import alive, running, until
from tests.integration.test_worker import enqueue

# Starts a process in a session of its own that writes its pid to argv[2], then (after argv[4]
# seconds) writes out.txt into the run's output folder, argv[1] (if it can), and lives on. Then, by argv[3]:
# "hang" sleeps (until its timeout), "exit" ends well, writing its own out.txt. With argv[5]
# "quiet" the stray closes its stdout and stderr first (as a daemon does).
STRAY = textwrap.dedent(
    """
    import os, sys, time
    out_dir, pid_file, then, delay_s, quiet = sys.argv[1:6]
    child = os.fork()
    if child == 0:
        os.setsid()
        if quiet == "quiet":
            null = os.open(os.devnull, os.O_RDWR)
            os.dup2(null, 1)
            os.dup2(null, 2)
        time.sleep(float(delay_s))
        try:
            with open(os.path.join(out_dir, "out.txt"), "w") as f:
                f.write("left behind by an earlier job")
        except OSError:  # the lane is gone: live on all the same
            pass
        time.sleep(60)
        os._exit(0)
    with open(pid_file + ".tmp", "w") as f:
        f.write(str(child))
    os.rename(pid_file + ".tmp", pid_file)
    if then == "hang":
        time.sleep(60)
    with open(os.path.join(out_dir, "out.txt"), "w") as f:
        f.write("mine")
    """
)

# Leaves a folder of argv[2] empty files in its scratch lane (a cache in its HOME), writes out.txt.
LITTER = textwrap.dedent(
    """
    import os, sys
    os.mkdir("cache")
    for i in range(int(sys.argv[2])):
        open(os.path.join("cache", str(i)), "w").close()
    with open(os.path.join(sys.argv[1], "out.txt"), "w") as f:
        f.write("done")
    """
)


# Writes out.txt into argv[1], then starts a daemon (a session of its own, its stdin, stdout and
# stderr on /dev/null) that writes its pid to argv[2] and, for 5 s, rewrites out.txt every 10 ms,
# both by the output folder's path and relative to its working folder; the run itself ends at once.
DAEMON = textwrap.dedent(
    """
    import os, sys, time
    out_dir, pid_file = sys.argv[1:3]
    with open(os.path.join(out_dir, "out.txt"), "w") as f:
        f.write("the daemon job's own")
    if os.fork() == 0:
        os.setsid()
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        with open(pid_file + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.rename(pid_file + ".tmp", pid_file)
        end, n = time.monotonic() + 5, 0
        while time.monotonic() < end:
            for folder in (out_dir, "out"):
                n += 1
                try:
                    os.makedirs(folder, exist_ok=True)
                    with open(os.path.join(folder, "out.txt.tmp"), "w") as f:
                        f.write("written by an earlier job's daemon: " + str(n))
                    os.replace(os.path.join(folder, "out.txt.tmp"), os.path.join(folder, "out.txt"))
                except OSError:
                    pass
            time.sleep(0.01)
        os._exit(0)
    else:
        time.sleep(0.2)  # the daemon has started writing
    """
)

# Writes its own out.txt and takes half a second more.
OWN = "import sys, time; open(sys.argv[1] + '/out.txt', 'w').write('bob: its own result'); time.sleep(0.5)"

# Writes out.txt, then starts a process in a session of its own that writes its pid to argv[2] and
# becomes, its environment cleared (so no marker tells whose it is), a shell that ends by itself
# after argv[3] seconds.
UNMARKED = textwrap.dedent(
    """
    import os, sys, time
    out_dir, pid_file, after_s = sys.argv[1:4]
    with open(os.path.join(out_dir, "out.txt"), "w") as f:
        f.write("done")
    if os.fork() == 0:
        os.setsid()
        with open(pid_file + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.rename(pid_file + ".tmp", pid_file)
        os.execve("/bin/sh", ["sh", "-c", "sleep " + after_s], dict())
    while not os.path.exists(pid_file):  # the run ends once its stray said who it is
        time.sleep(0.01)
    """
)

# Makes a temporary file where Python's tempfile puts them, says where in argv[1], and outlives its
# timeout (so it never removes the file itself).
TEMP_USER = textwrap.dedent(
    """
    import os, sys, tempfile, time
    fd, path = tempfile.mkstemp(suffix=".bin")
    os.write(fd, b"x" * 4096)
    with open(sys.argv[1], "w") as f:
        f.write(path)
    time.sleep(60)
    """
)


def _no_output_model(name: str, argv: list[str]) -> str:
    """A one-shot model with one optional output, which it does not write (as /bin/true)."""
    return script_model(name, argv).replace('name = "out.txt"', 'name = "out.txt"\nrequired = false')


@pytest.fixture
def models_file(tmp_path: Path) -> Path:
    """`toy`; `stray`, which leaves a process behind (see STRAY; timeout 10 s, its `then`, `delay_s`
    and `quiet` as params); `silent`, which waits 2 s and writes nothing; `daemon` (DAEMON), `own`
    (OWN), `unmarked` (UNMARKED) and `temp_user` (TEMP_USER, timeout 1 s); `true` and `false`."""
    path = tmp_path / "models.toml"
    stray = [
        "{python}",
        "-c",
        STRAY,
        "{output_dir}",
        str(tmp_path / "stray.pid"),
        "{then}",
        "{delay_s}",
        "{quiet}",
    ]
    params = "".join(
        f'[models.stray.params.{name}]\ntype = "str"\ndefault = "{default}"\n'
        for name, default in (("then", "exit"), ("delay_s", "3"), ("quiet", "loud"))
    )
    path.write_text(
        toy_model("toy")
        + script_model("stray", stray)
        + params
        + script_model("silent", ["{python}", "-c", "import time; time.sleep(2)"])
        + script_model("stray_timeout", stray).replace("timeout_s = 10", "timeout_s = 1")
        + params.replace("models.stray.", "models.stray_timeout.")
        + script_model("litter", ["{python}", "-c", LITTER, "{output_dir}", "100"])
        + script_model("daemon", ["{python}", "-c", DAEMON, "{output_dir}", str(tmp_path / "stray.pid")])
        + script_model("own", ["{python}", "-c", OWN, "{output_dir}"])
        + script_model(
            "unmarked", ["{python}", "-c", UNMARKED, "{output_dir}", str(tmp_path / "stray.pid"), "1"]
        )
        + script_model("temp_user", ["{python}", "-c", TEMP_USER, str(tmp_path / "temp.path")]).replace(
            "timeout_s = 10", "timeout_s = 1"
        )
        + _no_output_model("true", ["/bin/true"])
        + _no_output_model("false", ["/bin/false"])
    )
    return path


def _stray_pid(tmp_path: Path) -> int:
    return int((tmp_path / "stray.pid").read_text())


def _parent(pid: int) -> int | None:
    """The parent of process `pid` (None: there is no such process, not even a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rpartition(")")[2].split()[1])
    except FileNotFoundError:
        return None


async def _gone(pid: int, within_s: float) -> bool:
    for _ in range(int(within_s / 0.05)):
        if not alive(pid):
            return True
        await asyncio.sleep(0.05)
    return not alive(pid)


@pytest.fixture
def strays(tmp_path: Path):
    """Kills what the test's model left alive, whatever the test found."""
    yield
    if (tmp_path / "stray.pid").exists() and alive(pid := _stray_pid(tmp_path)):
        os.kill(pid, signal.SIGKILL)


async def test_a_process_that_left_a_timed_out_runs_group_dies_with_the_run(
    manager, make_worker, tmp_path, strays
):
    job_id = await enqueue(manager, model="stray_timeout", then="hang", max_attempts=1)
    await make_worker().run()
    job = await manager.get(job_id)
    assert job.state is JobState.failed and "timed out" in (job.error or ""), job.error
    assert await _gone(_stray_pid(tmp_path), within_s=2)


async def test_a_process_a_run_left_behind_writes_nothing_into_the_next_jobs_lane(
    manager, make_worker, tmp_path, strays
):
    """The stray of a run that ended well wrote its file into the lane the next job ran in (one
    lane: one job at a time), and that job, which wrote nothing, succeeded with it as its output."""
    first = await enqueue(manager, model="stray", max_attempts=1)  # the stray writes after 3 s
    second = await enqueue(manager, model="silent", max_attempts=1)
    await make_worker(max_jobs_per_gpu=1).run()
    assert (await manager.get(first)).state is JobState.succeeded
    job = await manager.get(second)
    assert job.state is JobState.failed and "out.txt" in (job.error or ""), (job.state, job.error)
    assert await _gone(_stray_pid(tmp_path), within_s=1)


async def test_a_quiet_stray_of_a_run_that_ended_well_is_killed_within_a_reap_round(
    manager, make_worker, tmp_path, strays
):
    """A stray that let go of the run's output pipes (a daemon) is not seen as the run ends; the
    worker's reaper finds it by the run's marker once the run is over."""
    job_id = await enqueue(manager, model="stray", quiet="quiet", delay_s="60", max_attempts=1)
    async with running(make_worker(burst=False, reap_interval_s=0.3)):
        await until(manager, job_id, lambda j: j.state.final)
        assert await _gone(_stray_pid(tmp_path), within_s=3)


async def test_a_daemon_of_a_run_that_ended_well_changes_neither_its_results_nor_the_next_jobs(
    manager, make_worker, store, tmp_path, strays
):
    """A daemon left by a run that succeeded (its pipes let go of, so not seen as the run ended)
    lived until the next reap round, and the lane went to the next job meanwhile: writing by path
    into the lane's out/, it replaced that job's output, which succeeded with the daemon's text
    (another user's) and a sha256 of it; it also replaced its own job's output between its hash
    and its publishing, so the file served did not match its recorded sha256. The worker, a
    subreaper, now kills it as the run ends, before its outputs are read (no reap round here)."""
    async with running(make_worker(burst=False, max_jobs_per_gpu=1, reap_interval_s=60)):
        first = await enqueue(manager, model="daemon", owner="alice", max_attempts=1)
        await until(manager, first, lambda j: j.state.final)
        second = await enqueue(manager, model="own", owner="bob", max_attempts=1)
        await until(manager, second, lambda j: j.state.final)
        jobs = [await manager.get(first), await manager.get(second)]
        assert [j.state for j in jobs] == [JobState.succeeded] * 2, [j.error for j in jobs]
        served = {}
        for job in jobs:
            [result] = job.results
            download = store.open(job, result.name)
            assert download.file is not None
            with download.file as f:
                served[job.owner] = data = f.read()
            assert (len(data), hashlib.sha256(data).hexdigest()) == (result.bytes, result.sha256), job.owner
        assert served["bob"] == b"bob: its own result"
        assert not alive(_stray_pid(tmp_path))  # dead as its run ended, no reap round having come


async def test_a_stray_that_ends_by_itself_is_reaped_and_no_run_loses_its_exit_code(
    manager, make_worker, tmp_path, strays
):
    """A process that escapes a run now comes to the worker (a child subreaper) as the run ends,
    and one that no marker names (its environment cleared) is left to end by itself: it was a
    zombie of the worker for good. The reap round now reaps such zombies, only those a round old,
    so that the worker's own quick runs, which asyncio and the runner reap themselves, keep their
    exit codes (a status taken from them made `false` succeed, or a run fail)."""
    first = await enqueue(manager, model="unmarked", max_attempts=1)
    async with running(make_worker(burst=False, reap_interval_s=0.05, max_jobs_per_gpu=4)):
        await until(manager, first, lambda j: j.state.final)
        pid = _stray_pid(tmp_path)
        assert _parent(pid) == os.getpid()  # the worker's child now (this process runs the worker)
        quick = [
            await enqueue(manager, model=("false" if i % 5 == 0 else "true"), max_attempts=1)
            for i in range(100)
        ]
        for job_id in quick:
            await until(manager, job_id, lambda j: j.state.final)
        deadline = time.monotonic() + 5
        while _parent(pid) is not None:  # a zombie until a reap round takes it
            assert time.monotonic() < deadline, "the stray's zombie was never reaped"
            await asyncio.sleep(0.05)
    assert (await manager.get(first)).state is JobState.succeeded
    ended = [await manager.get(job_id) for job_id in quick]
    assert [j.state for j in ended] == [
        JobState.failed if i % 5 == 0 else JobState.succeeded for i in range(100)
    ], [j.error for j in ended if j.error and "exit code 1" not in j.error]
    assert all("exit code 1" in (j.error or "") for j in ended[::5])


async def test_the_temporary_files_of_a_killed_run_are_removed_with_its_lane(
    manager, make_worker, store, tmp_path
):
    """A model got the host's TMPDIR (none: /tmp), so a run killed at its timeout (or canceled)
    left its temporary files there for good (100 MB each, seen). TMPDIR, TMP and TEMP are now
    the run's own scratch lane, emptied after it."""
    job_id = await enqueue(manager, model="temp_user", max_attempts=1)
    try:
        await make_worker().run()
        job = await manager.get(job_id)
        assert job.state is JobState.failed and "timed out" in (job.error or ""), job.error
        made = Path((tmp_path / "temp.path").read_text())
        assert made.is_relative_to(store.root / "scratch"), made
        assert not await asyncio.to_thread(made.exists)
    finally:  # the old way: not to be left in /tmp by this test
        with contextlib.suppress(OSError):
            os.unlink((tmp_path / "temp.path").read_text())


# Folders shutil.rmtree was asked to remove, with the thread that asked (see `_on_audit`).
_REMOVED: list[tuple[str, int]] = []
_WATCHING: list[bool] = []
# Reads of /proc's list of processes, while `_COUNTING` holds True (see `_on_audit`).
_PROC_SCANS: list[str] = []
_COUNTING: list[bool] = []


def _on_audit(event: str, args: tuple[Any, ...]) -> None:
    if event == "shutil.rmtree" and _WATCHING:
        _REMOVED.append((str(args[0]), threading.get_ident()))
    elif event == "os.scandir" and _COUNTING and str(args[0]) == "/proc":
        _PROC_SCANS.append(event)


def _watch() -> None:
    if not _WATCHING:
        sys.addaudithook(_on_audit)  # hooks stay for the process: this one records while watched
        _WATCHING.append(True)


async def test_a_lane_full_of_what_the_model_left_is_emptied_off_the_event_loop(manager, make_worker):
    """The lane was emptied on the worker's event loop: 40,000 files a model left in its HOME
    stopped the loop for 0.45 s (its heartbeats, the other jobs' pipes, the API under `serve`),
    a few million for longer than a lease. A lane holding more than its input and an empty out/
    is emptied in a thread."""
    _watch()
    _REMOVED.clear()
    job_id = await enqueue(manager, model="litter")
    await make_worker().run()
    assert (await manager.get(job_id)).state is JobState.succeeded
    threads = {thread for path, thread in _REMOVED if path.endswith(f"{os.sep}cache")}
    assert threads and threading.get_ident() not in threads, _REMOVED


async def test_an_idle_worker_looks_for_strays_only_after_a_run_ended(manager, make_worker, tmp_path, strays):
    """Every reap round read the environment of every process on the host to find strays: 75-85
    ms of CPU a round beside 2,000 processes (as root; 32-37 ms as a user of its own), idle or
    not. A round now looks only when a run or runner of the worker ended since it last looked."""
    _watch()
    _PROC_SCANS.clear()
    _COUNTING.append(True)
    try:
        async with running(make_worker(burst=False, reap_interval_s=0.1)):
            deadline = time.monotonic() + 30
            while not _PROC_SCANS:  # its first round looks, however long its start took
                assert time.monotonic() < deadline, "no round looked for strays"
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.3)  # its start's own children reaped, and looked after once
            _PROC_SCANS.clear()
            await asyncio.sleep(1.0)  # about ten rounds with nothing running
            idle = len(_PROC_SCANS)
            job_id = await enqueue(manager, model="stray", quiet="quiet", delay_s="60", max_attempts=1)
            await until(manager, job_id, lambda j: j.state.final)
            assert await _gone(_stray_pid(tmp_path), within_s=3)  # the round after its end looked
    finally:
        _COUNTING.clear()
    # Every round looked before (about ten here). One look is allowed: any child of this test
    # process reaped late (an earlier test's) changes the totals the worker compares.
    assert idle <= 1, idle


async def test_a_stray_of_a_killed_workers_run_dies_when_another_worker_on_the_host_takes_the_job_back(
    manager, spawn_worker, tmp_path, strays
):
    """A worker killed (kill -9) mid-job leaves its run's model and the process it started in a
    session of its own. Another worker on the host, taking the job back once its lease ran out,
    killed the model's group by its recorded pid and nothing else: the stray (which carries the
    run's GPUJOBS_JOB marker) lived on, holding what it held (its GPU memory), for as long as no
    worker of the dead one's id started again on the host."""
    job_id = await enqueue(manager, model="stray", then="hang", delay_s="60", quiet="quiet", max_attempts=2)
    first = spawn_worker("a")
    job = await until(manager, job_id, lambda j: j.pid is not None)
    deadline = time.monotonic() + 10
    while not (tmp_path / "stray.pid").exists():
        assert time.monotonic() < deadline, "the model started no stray"
        await asyncio.sleep(0.05)
    stray = _stray_pid(tmp_path)
    first.send_signal(signal.SIGKILL)
    first.wait(5)
    assert alive(job.pid or 0) and alive(stray)
    # b keeps its files elsewhere: it cannot see a's lock, so what kills the stray is the take-back's
    # own look for the run's marker (a worker sharing a's folder kills it sooner, by a's marker).
    spawn_worker("b", storage_dir=str(tmp_path / "b-storage"))
    await until(manager, job_id, lambda j: j.attempt == 2, timeout_s=30)  # taken back by b
    assert await _gone(job.pid or 0, within_s=3)  # the run's own group was killed...
    assert await _gone(stray, within_s=3), (
        "the stray of the killed worker's run still lives"
    )  # ...its stray too
