"""Persistent models through the real worker: warm runners loaded once, restarted after a crash,
killed on cancel, timeout and a lost lease, stopped when idle, evicted for another model's VRAM,
and shown in the workers view, the metrics and the admin page."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import text

from app.queue import verdict
from app.queue.jobs import JobState
from app.runlog import TAIL_BYTES
from tests.conftest import WARM_TOY, api_client, client_for, signed_in, warm_model, worker_id, worker_name
from tests.fakes import FakeInventory
from tests.integration.test_durability import alive, running, until
from tests.integration.test_observability import scrape, value
from tests.integration.test_worker import enqueue


@pytest.fixture
def models_file(models_file: Path, tmp_path: Path) -> Path:
    """The test models, `warm_slow`, a persistent model whose load takes 30 s, `warm_missing`,
    whose runner program is not there, `warm_linger`, whose runner outlives its stdin by 30 s,
    deaf to SIGTERM (closing it takes two kill graces), and `warm_oom_load`, whose runner exits
    while loading with 77, one of its out-of-memory exit codes."""
    loads = tmp_path / "loads-warm_slow.txt"
    serve = json.dumps(["{python}", str(WARM_TOY), "--loads", str(loads)])
    slow = json.dumps(["{python}", str(WARM_TOY), "--loads", str(loads), "--load-sleep", "30"])
    missing = json.dumps([str(tmp_path / "no-such-runner")])
    linger = json.dumps(
        ["{python}", str(WARM_TOY), "--loads", str(tmp_path / "loads-warm_linger.txt"), "--linger", "30"]
    )
    with models_file.open("a") as f:
        f.write(warm_model("warm_slow", loads).replace(serve, slow))
        f.write(warm_model("warm_missing", loads).replace(serve, missing))
        f.write(warm_model("warm_linger", loads, idle_vram_mb=6000).replace(serve, linger))
        oom = json.dumps(["{python}", "-c", "raise SystemExit(77)"])
        oom_codes = "max_attempts = 3\noom_exit_codes = [77]\n"
        f.write(
            warm_model("warm_oom_load", loads).replace(serve, oom).replace("max_attempts = 3\n", oom_codes)
        )
    return models_file


def loads(tmp_path: Path, model: str) -> list[int]:
    """The pids that loaded `model`, in order."""
    path = tmp_path / f"loads-{model}.txt"
    return [int(line) for line in path.read_text().split()] if path.exists() else []


async def first_load(tmp_path: Path, model: str, timeout_s: float = 20) -> int:
    """The pid of the first process to load `model`, once it has (a runner's start takes a
    Python start-up and its imports, longer on a busy machine)."""
    deadline = time.monotonic() + timeout_s
    while not (pids := loads(tmp_path, model)):
        assert time.monotonic() < deadline, f"no runner of {model} loaded in {timeout_s} s"
        await asyncio.sleep(0.05)
    return pids[0]


async def test_one_warm_process_answers_many_jobs(manager, make_worker, store, tmp_path):
    ids = [await enqueue(manager, model="warm_a", vram_mb=2000, sleep=0.6, steps=2) for _ in range(4)]
    await make_worker(max_jobs_per_gpu=1).run()
    jobs = [await manager.get(i) for i in ids]
    assert [j.state for j in jobs] == [JobState.succeeded] * 4
    [pid] = loads(tmp_path, "warm_a")  # the model loaded once
    assert {j.pid for j in jobs} == {pid}  # and every job ran in that process
    texts = [store.resolve(j, "out.txt")[0].read_text() for j in jobs]
    assert all(f"pid {pid}" in t for t in texts)
    assert not alive(pid)  # the burst worker closed its runners on the way out
    # Each success says which runner served it; the first job also waited for the model's load.
    details = []
    for i in ids:
        [succeeded] = [e.detail for e in await manager.events(i) if e.kind == "succeeded"]
        details.append(succeeded)
    assert [(d["runner_pid"], d["runner_job"]) for d in details] == [(pid, n) for n in (1, 2, 3, 4)]
    assert details[0]["load_s"] > 0 and not any("load_s" in d for d in details[1:])


async def test_a_quiet_jobs_log_makes_no_file_and_is_served_empty(settings, manager, make_worker, store):
    quiet = await enqueue(manager, model="warm_a", vram_mb=2000, steps=0)
    chatty = await enqueue(manager, model="warm_a", vram_mb=2000, steps=1)
    await make_worker(max_jobs_per_gpu=1).run()
    assert not list((store.root / "logs").glob(f"*/{quiet}.*"))  # no file made for nothing said
    async with api_client(settings) as http:
        for job_id, said in ((quiet, ""), (chatty, "PROGRESS 1.000 step 1")):
            job = (await http.get(f"/jobs/{job_id}")).json()
            assert job["state"] == "succeeded" and job["links"]["log"], job
            log = await http.get(job["links"]["log"])
            assert log.status_code == 200 and log.headers["content-type"].startswith("text/plain")
            assert (said in log.text) if said else log.text == ""


async def test_a_runners_log_rotates_at_the_cap_and_its_jobs_logs_are_capped(manager, make_worker, store):
    """Three jobs print 256 KiB each through one runner, with a 32 KiB cap: the runner's log is
    runner.log and runner.log.1, each within the cap, and each job's log is capped as a one-shot
    job's is (its head, what was left out, its last lines)."""
    ids = [await enqueue(manager, model="warm_a", vram_mb=2000, noise_kb=256) for _ in range(3)]
    await make_worker(max_jobs_per_gpu=1, max_log_mb=1 / 32).run()
    assert [(await manager.get(i)).state for i in ids] == [JobState.succeeded] * 3
    folder = store.runner_dir("warm_a", 0)
    files = sorted(folder.glob("runner.log*"))
    assert [p.name for p in files] == ["runner.log", "runner.log.1"]
    assert all(p.stat().st_size <= 32 * 1024 for p in files)
    newest = files[0].read_bytes().splitlines()
    assert newest[-1].startswith(b"[warm] runner pid ") and b" ended: " in newest[-1]
    for job_id in ids:
        log = store.log_path(job_id, 1).read_bytes()
        assert len(log) < 32 * 1024 + TAIL_BYTES + 200
        head, marker, end = log.partition(b"[warm] log cap of 32768 bytes reached: ")
        assert marker and head.startswith(b"[warm] job ") and b"noise line 00000000" in head
        assert b"noise line 00004095" in end and end.splitlines()[-1].startswith(b"[warm] done after")


async def test_a_runner_that_dies_mid_job_is_restarted_and_the_job_retried(manager, make_worker, tmp_path):
    job_id = await enqueue(manager, model="warm_a", vram_mb=2000, crash_attempts=1, steps=2)
    async with running(make_worker(burst=False)):
        job = await until(manager, job_id, lambda j: j.state.final)
    assert job.state is JobState.succeeded and job.attempt == 2
    assert len(loads(tmp_path, "warm_a")) == 2  # a fresh runner for the retry
    failed = [e for e in await manager.events(job_id) if e.kind == "retry_scheduled"]
    assert failed and "warm runner died" in failed[0].detail["error"]
    assert job.abnormal_runs == 1


async def test_a_runner_that_retires_between_jobs_costs_the_next_job_nothing(manager, make_worker, tmp_path):
    """Each runner answers one job, then exits 0 a moment later without taking another, as a
    runner that retires itself between jobs does. The next job was written to it before its exit
    was seen, and was judged a crash of its run: an attempt spent and a strike towards quarantine,
    for a job no model ever read. Now such a job goes to another runner."""
    ids = [await enqueue(manager, model="warm_a", vram_mb=2000, steps=0, retire_ms=300) for _ in range(3)]
    await make_worker(max_jobs_per_gpu=1).run()
    jobs = [await manager.get(i) for i in ids]
    assert [(j.state, j.attempt, j.abnormal_runs) for j in jobs] == [(JobState.succeeded, 1, 0)] * 3
    assert len(loads(tmp_path, "warm_a")) == 3  # one runner a job
    for i in ids:
        assert "retry_scheduled" not in [e.kind for e in await manager.events(i)]


def daemons(tmp_path: Path, model: str) -> list[int]:
    """The pids of the daemons `model`'s runners left (the warm_toy param `daemon`)."""
    path = tmp_path / f"loads-{model}.txt.daemon"
    return [int(line) for line in path.read_text().split()] if path.exists() else []


async def test_a_dead_runners_daemon_is_killed_while_another_runner_of_its_model_lives(
    manager, make_worker, tmp_path
):
    """A runner left a process in a session of its own and died; the job went on in a new runner of
    the same model and GPU. The reap round named runners by model and GPU, so the dead one's
    daemon counted as a helper of the live one, and lived as long as it did."""
    job_id = await enqueue(manager, model="warm_a", vram_mb=2000, daemon=True, crash_attempts=1)
    async with running(make_worker(burst=False)):
        job = await until(manager, job_id, lambda j: j.state.final)
        assert (job.state, job.attempt) == (JobState.succeeded, 2)
        first, second = daemons(tmp_path, "warm_a")
        deadline = time.monotonic() + 10
        while alive(first):
            assert time.monotonic() < deadline, "the dead runner's daemon lives on"
            await asyncio.sleep(0.1)
        assert alive(second)  # the live runner's helper is left alone
    assert not alive(second)


async def test_a_graceful_stop_leaves_no_runners_daemon(manager, make_worker, tmp_path):
    """A worker that stopped gracefully closed its runners, but a process one of them had started
    in a session of its own lived on after the worker, its parent now init."""
    job_id = await enqueue(manager, model="warm_a", vram_mb=2000, daemon=True)
    await make_worker().run()
    assert (await manager.get(job_id)).state is JobState.succeeded
    [daemon] = daemons(tmp_path, "warm_a")
    assert not alive(daemon)


async def test_cancel_and_timeout_kill_the_runner_and_the_next_job_gets_a_fresh_one(
    manager, make_worker, tmp_path
):
    async with running(make_worker(burst=False, max_jobs_per_gpu=1)) as worker:
        hung = await enqueue(manager, model="warm_a", vram_mb=2000, hang=True)
        await until(manager, hung, lambda j: j.state is JobState.running)
        first_pid = await first_load(tmp_path, "warm_a")  # 0.3 s after the claim was once too soon
        await manager.cancel(hung, owner=None, by="tester")
        job = await until(manager, hung, lambda j: j.state.final)
        assert job.state is JobState.canceled
        await asyncio.sleep(0.5)
        assert not alive(first_pid)

        timed = await enqueue(manager, model="warm_a", vram_mb=2000, hang=True, max_attempts=1)
        job = await until(manager, timed, lambda j: j.state.final, timeout_s=20)  # timeout_s = 3
        assert job.state is JobState.failed and job.error is not None and job.error.startswith("timed out")

        after = await enqueue(manager, model="warm_a", vram_mb=2000)
        assert (await until(manager, after, lambda j: j.state.final)).state is JobState.succeeded
        assert worker.pool.runners()
    assert len(loads(tmp_path, "warm_a")) == 3  # a runner for each: killed by cancel, by timeout, fresh


async def test_the_temporary_files_of_a_runner_killed_at_a_timeout_are_removed_with_it(
    manager, make_worker, store, tmp_path
):
    """A warm runner got the host's TMPDIR (none: /tmp), so the temporary files of a job whose
    runner was killed (at its timeout, or canceled) stayed there for good. Each runner now has a
    temporary folder of its own, in its runner folder, removed as it ends."""
    job_id = await enqueue(manager, model="warm_a", vram_mb=2000, temp=True, hang=True, max_attempts=1)
    note = tmp_path / "loads-warm_a.txt.temp"
    try:
        async with running(make_worker(burst=False)):
            job = await until(manager, job_id, lambda j: j.state.final, timeout_s=20)  # timeout_s = 3
            assert job.state is JobState.failed and (job.error or "").startswith("timed out"), job.error
            made = Path(note.read_text())
            assert made.is_relative_to(store.root / "runners"), made
            for _ in range(100):  # removed off the loop, not waited for
                if not await asyncio.to_thread(made.parent.exists):
                    break
                await asyncio.sleep(0.05)
            assert not await asyncio.to_thread(made.parent.exists)  # its folder, with what was in it
    finally:  # the old way: not to be left in /tmp by this test
        with contextlib.suppress(OSError):
            os.unlink(note.read_text())


async def test_a_runner_whose_temporary_folder_cannot_be_made_sends_its_job_back_unspent(
    manager, make_worker, store
):
    """That folder is made as a runner starts: when it cannot be (here its runner folder became a
    file), the job goes back to the queue as for any trouble of this host's storage, unspent, a
    few times (verdict.STORAGE_RETURNS_MAX), then its attempts are spent as any failure's."""
    folder = store.runner_dir("warm_a", 0)  # made, and known made, as the worker's first job would
    folder.rmdir()
    folder.write_text("in the way")
    job_id = await enqueue(manager, model="warm_a", vram_mb=2000, max_attempts=1)
    async with running(make_worker(burst=False, poll_interval_s=0.1)):
        job = await until(manager, job_id, lambda j: j.state.final, timeout_s=20)
    assert job.state is JobState.failed and job.abnormal_runs == 0, job.error
    returns = [e for e in await manager.events(job_id) if e.detail.get("reason") == verdict.STORAGE]
    assert len(returns) == verdict.STORAGE_RETURNS_MAX, returns  # unspent, then spent
    assert "could not make the runner's temporary folder" in (job.error or ""), job.error


async def test_a_job_canceled_while_its_runner_loads_ends_at_once_and_so_does_the_load(
    manager, make_worker, tmp_path
):
    job_id = await enqueue(manager, model="warm_slow", vram_mb=2000)
    async with running(make_worker(burst=False)) as worker:
        await until(manager, job_id, lambda j: j.state is JobState.running)
        pid = await first_load(tmp_path, "warm_slow")
        await manager.cancel(job_id, owner=None, by="tester")
        job = await until(manager, job_id, lambda j: j.state.final, timeout_s=10)  # not after the 30 s load
        assert job.state is JobState.canceled and job.error == "canceled while running"
        for _ in range(60):  # the load was stopped, not waited out
            if not alive(pid):
                break
            await asyncio.sleep(0.05)
        assert not alive(pid) and not worker.pool.runners()


async def test_a_runner_whose_program_is_missing_fails_its_job_at_once(manager, make_worker, store):
    """No retry can mend a missing program: the job fails on its first attempt, as a one-shot run's
    does, not after max_attempts rounds of backoff. Its log says why (a job whose runner did not
    start had no log at all, though a failed job always has one)."""
    job_id = await enqueue(manager, model="warm_missing", vram_mb=2000)
    await make_worker().run()
    job = await manager.get(job_id)
    assert (job.state, job.attempt) == (JobState.failed, 1), job
    assert job.error is not None and "could not be started" in job.error
    said = store.log_path(job.id, job.attempt).read_text()
    assert "[warm] the warm runner did not start:" in said and "could not be started" in said, said


async def test_a_runner_exiting_with_an_oom_exit_code_while_loading_is_out_of_memory(manager, make_worker):
    """docs/persistent.md: a runner that fails to load is handled as out of memory when its exit
    code is one of the model's `oom_exit_codes`. Only its text was checked (against oom_patterns):
    the job was retried as a crash, spending its attempts, with its estimate unchanged."""
    job_id = await enqueue(manager, model="warm_oom_load", vram_mb=2000, max_attempts=1)
    async with running(make_worker(burst=False, oom_max_retries=1)):
        job = await until(manager, job_id, lambda j: j.state.final)
    assert (job.state, job.oom_retries, job.vram_mb) == (JobState.failed, 1, 3000), job
    assert job.error is not None and "out of GPU memory: the warm runner did not load" in job.error
    assert "exit code 77" in job.error and "still out of memory with 1 larger retries" in job.error


async def test_idle_runners_stop(manager, make_worker, tmp_path):
    job_id = await enqueue(manager, model="warm_a", vram_mb=2000)
    async with running(make_worker(burst=False, warm_idle_s=0.5)) as worker:
        await until(manager, job_id, lambda j: j.state is JobState.succeeded)
        [pid] = loads(tmp_path, "warm_a")
        assert alive(pid)
        for _ in range(60):  # the process goes first, then the pool forgets the runner
            if not alive(pid) and not worker.pool.runners():
                break
            await asyncio.sleep(0.1)
        assert not alive(pid) and not worker.pool.runners()


async def test_eviction_frees_vram_for_another_model(manager, make_worker, tmp_path):
    a = await enqueue(manager, model="warm_a", vram_mb=6000)
    async with running(make_worker([10_240], burst=False)) as worker:
        await until(manager, a, lambda j: j.state is JobState.succeeded)
        [pid_a] = loads(tmp_path, "warm_a")
        assert alive(pid_a) and worker.pool.reserved_mb(0) == 6000  # idle, holding its memory
        b = await enqueue(manager, model="warm_b", vram_mb=6000)
        job = await until(manager, b, lambda j: j.state.final)
        assert job.state is JobState.succeeded
        assert not alive(pid_a)  # evicted: 6000 + 6000 do not fit in 10 GB
        assert len(loads(tmp_path, "warm_b")) == 1 and worker.pool.reserved_mb(0) == 6000


async def test_jobs_claimed_while_runners_are_evicted_for_them_keep_their_leases(
    manager, make_worker, tmp_path
):
    """Evicting a runner slow to close (here 2 x 2.5 s of kill grace) takes longer than a lease
    (2 s); 6000 + 2 x 3000 MB do not fit in 10 GB. The job claimed for that room was not renewed
    by the heartbeat meanwhile: the worker's own reaper took it back as a lost worker's, and it ran
    a second attempt."""
    old = await enqueue(manager, model="warm_linger", vram_mb=6000)
    config = {"burst": False, "lease_s": 2, "kill_grace_s": 2.5, "max_jobs_per_gpu": 2}
    async with running(make_worker([10_240], **config)):
        await until(manager, old, lambda j: j.state is JobState.succeeded)
        pid = await first_load(tmp_path, "warm_linger")
        jobs = [await enqueue(manager, model="warm_b", vram_mb=3000, sleep=1.0) for _ in range(2)]
        done = [await until(manager, j, lambda j: j.state.final, timeout_s=30) for j in jobs]
        assert not alive(pid)
    assert [(j.state, j.attempt) for j in done] == [(JobState.succeeded, 1)] * 2
    for job_id in jobs:
        assert "recovered" not in [e.kind for e in await manager.events(job_id)]


async def test_a_loaded_runners_memory_is_not_counted_twice_when_it_takes_a_job(manager, make_worker):
    """A job handed to a loaded runner adds nothing NVML does not show already: the runner's model
    is in GPU memory. Until the job's first memory reading (never, where NVML cannot tie memory to
    our processes) its whole need was taken off NVML's free figure again, and a job that fits
    beside it waited for it to end."""
    inventory = FakeInventory([20_000])
    first = await enqueue(manager, model="warm_a", vram_mb=6000)
    async with running(make_worker(inventory=inventory, burst=False)):
        await until(manager, first, lambda j: j.state is JobState.succeeded)
        inventory.set_free(0, 14_000)  # the idle runner's model, in GPU memory
        warm_job = await enqueue(manager, model="warm_a", vram_mb=6000, sleep=2.0, steps=2)
        await until(manager, warm_job, lambda j: j.state is JobState.running)
        other = await enqueue(manager, vram_mb=9000)  # 14 GB free beside the runner and its job
        done = await until(manager, other, lambda j: j.state.final)
        assert done.state is JobState.succeeded
        assert (await manager.get(warm_job)).state is JobState.running  # side by side


async def test_an_idle_runner_holds_what_nvml_showed_it_using_if_more(manager, make_worker, tmp_path):
    """docs/persistent.md: idle, a runner keeps `idle_vram_mb` reserved, or what NVML last showed it
    holding during its job, if more (a model's cache allocator keeps what the job used). The pool
    went on holding `idle_vram_mb` (6000 for warm_a), whatever NVML read."""
    inventory = FakeInventory([20_000])
    job_id = await enqueue(manager, model="warm_a", vram_mb=2000, sleep=1.5, steps=2)
    async with running(make_worker(inventory=inventory, burst=False)) as worker:
        inventory.set_process(await first_load(tmp_path, "warm_a"), 8000)
        await until(manager, job_id, lambda j: j.state is JobState.succeeded)
        [runner] = worker.pool.report(0)
        assert (runner["state"], runner["vram_mb"], worker.pool.reserved_mb(0)) == ("idle", 8000, 8000)


async def test_two_runners_of_a_model_side_by_side_have_folders_of_their_own(manager, make_worker, tmp_path):
    """docs/persistent.md: a runner's HOME and working folder are its own, for as long as it lives.
    Two runners of one model on one GPU (two jobs side by side) were both given the folder of
    their model and GPU, which outlives them: a scratch file a model keeps in its working folder
    or HOME (as a one-shot model may, its folder being its job's) was the other runner's too,
    another user's job's."""
    ids = [await enqueue(manager, model="warm_a", vram_mb=2000, sleep=3.0, steps=2) for _ in range(2)]
    async with running(make_worker(burst=False, max_jobs_per_gpu=2)):
        deadline = time.monotonic() + 20
        while len(pids := loads(tmp_path, "warm_a")) < 2:
            assert time.monotonic() < deadline, "the two jobs did not get a runner each"
            await asyncio.sleep(0.05)
        folders = [_folders_of(pid) for pid in pids]
        for job_id in ids:
            await until(manager, job_id, lambda j: j.state.final)
    (cwd_1, home_1, temp_1), (cwd_2, home_2, temp_2) = folders
    assert cwd_1 != cwd_2 and home_1 != home_2, f"both runners work in {cwd_1} with HOME={home_1}"
    assert (cwd_1, home_1) == (temp_1, temp_1) and (cwd_2, home_2) == (temp_2, temp_2)


def _folders_of(pid: int) -> tuple[str, str, str]:
    """A process's working folder, HOME and TMPDIR."""
    with open(f"/proc/{pid}/environ", "rb") as f:
        said = dict(v.decode().partition("=")[::2] for v in f.read().split(b"\0") if v)
    return os.readlink(f"/proc/{pid}/cwd"), said["HOME"], said["TMPDIR"]


async def test_a_job_that_needs_a_closing_runners_memory_waits_for_it_to_go(manager, make_worker, tmp_path):
    """A runner being closed (idle too long; it outlives its stdin, deaf to SIGTERM, so its close
    takes two kill graces) still holds its memory, which the planner counts as there to evict. A
    job claimed for that room must not start its model until the runner is gone: eviction looked
    at idle runners only, and the job started at once beside the closing one (6000 + 6000 MB on a
    10 GB GPU)."""
    inventory = FakeInventory([10_240])
    old = await enqueue(manager, model="warm_linger", vram_mb=6000)
    config = {"burst": False, "kill_grace_s": 2.0, "warm_idle_s": 0.5}
    async with running(make_worker(inventory=inventory, **config)) as worker:
        await until(manager, old, lambda j: j.state is JobState.succeeded)
        pid = await first_load(tmp_path, "warm_linger")
        inventory.set_free(0, 10_240 - 6000)  # NVML: the runner's model is in GPU memory
        deadline = time.monotonic() + 10
        while not any(r.state == "closing" for r in worker.pool.runners()):  # the idle close began
            assert time.monotonic() < deadline, "the idle runner was not closed"
            await asyncio.sleep(0.02)
        assert alive(pid) and worker.pool.reserved_mb(0) == 6000
        new = await enqueue(manager, model="warm_b", vram_mb=6000)
        await first_load(tmp_path, "warm_b")  # the new job's model has started
        still_alive = alive(pid)
        await until(manager, new, lambda j: j.state.final)
    assert not still_alive, "warm_b loaded while the closing warm_linger runner still held its 6000 MB"


class SlowReadings(FakeInventory):
    """NVML whose per-process listing, read off the event loop as a job's sampler reads it, takes a
    while (many GPUs, a busy driver): a quick job ends before its first reading."""

    def process_memory_mb(self) -> dict[int, int]:
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.3)
        return super().process_memory_mb()


async def test_a_quick_job_leaves_its_idle_runner_holding_what_nvml_last_showed(
    manager, make_worker, tmp_path
):
    """A job too quick for a memory reading reset its runner's hold to idle_vram_mb (6000), while
    NVML still showed the runner holding the 8000 its job before was seen using: the planner then
    counted 2000 MB fewer to evict than evicting it frees."""
    inventory = SlowReadings([20_000])
    first = await enqueue(manager, model="warm_a", vram_mb=2000, sleep=1.5, steps=2)
    async with running(make_worker(inventory=inventory, burst=False)) as worker:
        inventory.set_process(await first_load(tmp_path, "warm_a"), 8000)
        await until(manager, first, lambda j: j.state is JobState.succeeded)
        assert worker.pool.reserved_mb(0) == 8000
        quick = await enqueue(manager, model="warm_a", vram_mb=2000, steps=0)
        await until(manager, quick, lambda j: j.state is JobState.succeeded)
        [runner] = worker.pool.report(0)
        assert runner["jobs"] == 2 and inventory.process_memory_mb() == {runner["pid"]: 8000}
        assert worker.pool.reserved_mb(0) == 8000, worker.pool.report(0)


async def test_a_warm_model_is_preferred_among_equals(manager, make_worker, tmp_path):
    first = await enqueue(manager, model="warm_a", vram_mb=2000)
    # No claim ahead: after a first run shorter than claim_ahead_s the worker took `cold` ahead the
    # moment it was queued, before `warm` was, and the two never waited side by side.
    async with running(make_worker([24_576], burst=False, max_jobs_per_gpu=1, claim_ahead_s=0)):
        await until(manager, first, lambda j: j.state is JobState.succeeded)
        busy = await enqueue(manager, model="warm_a", vram_mb=2000, sleep=1.0)  # holds the one slot...
        await until(manager, busy, lambda j: j.state is JobState.running)
        cold = await enqueue(manager, model="warm_b", vram_mb=2000, sleep=0.2)  # ...while both wait
        warm = await enqueue(manager, model="warm_a", vram_mb=2000, sleep=0.2)
        done_warm = await until(manager, warm, lambda j: j.state is JobState.succeeded)
        done_cold = await until(manager, cold, lambda j: j.state is JobState.succeeded)
    assert done_warm.started_at < done_cold.started_at  # the loaded model went first
    assert len(loads(tmp_path, "warm_a")) == 1  # and it did not load again


async def test_quick_jobs_share_few_runners_and_a_job_waiting_for_one_can_be_canceled(
    manager, make_worker, tmp_path
):
    quick = [await enqueue(manager, model="warm_a", vram_mb=2000, steps=0) for _ in range(24)]
    async with running(make_worker(burst=False, max_jobs_per_gpu=8, warm_paced=True)) as worker:
        for job_id in quick:
            assert (await until(manager, job_id, lambda j: j.state.final)).state is JobState.succeeded
        started = loads(tmp_path, "warm_a")
        # 8 slots, but paced, a job of milliseconds waits for a busy runner (unpaced: 8 runners).
        assert len(started) <= 3
        # Every runner busy for seconds: a job of the same model waits in line, and can be canceled there.
        for _ in started:
            await enqueue(manager, model="warm_a", vram_mb=2000, sleep=2.5, steps=1)
        await asyncio.sleep(0.3)
        waiting = await enqueue(manager, model="warm_a", vram_mb=2000)
        await until(manager, waiting, lambda j: j.state is JobState.running)
        await manager.cancel(waiting, owner=None, by="tester")
        job = await until(manager, waiting, lambda j: j.state.final, timeout_s=2)
        assert job.state is JobState.canceled and job.pid is None  # it never reached a runner
        assert all(runner.pid in started for runner in worker.pool.runners())  # none killed, none new
    assert loads(tmp_path, "warm_a") == started


async def test_warm_runners_show_in_the_workers_view_the_metrics_and_the_admin_page(
    settings, manager, make_worker, make_key, tmp_path
):
    job_id = await enqueue(manager, model="warm_a", vram_mb=2000)
    root = await make_key("root", admin=True)
    async with api_client(settings, metrics_cache_s=0) as http, running(make_worker([8192], burst=False)):
        await until(manager, job_id, lambda j: j.state is JobState.succeeded)
        [pid] = loads(tmp_path, "warm_a")
        deadline = time.monotonic() + 10
        while True:  # the next heartbeat (every 0.5 s) shows the runner idle
            [gpu] = (await http.get("/admin/workers")).json()[0]["gpus"]
            if [r["state"] for r in gpu["warm"]] == ["idle"] or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        [runner] = gpu["warm"]
        assert (runner["model"], runner["pid"], runner["state"], runner["jobs"]) == ("warm_a", pid, "idle", 1)
        assert runner["vram_mb"] == gpu["reserved_mb"] == 6000  # idle, it holds its idle_vram_mb
        assert runner["load_s"] > 0 and runner["idle_s"] >= 0
        assert round(runner["load_s"], 1) <= runner["up_s"]  # up_s is rounded to 0.1 s, load_s to 1 ms
        assert gpu["warm_starts"] == {"warm_a": 1}

        samples = await scrape(http)
        labels = {"worker": worker_id("w1"), "gpu": "0", "model": "warm_a"}
        assert value(samples, "gpujobs_warm_runners", state="idle", **labels) == 1
        assert value(samples, "gpujobs_warm_runner_starts_total", **labels) == 1

        async with client_for(http, None) as browser:
            await signed_in(browser, root)
            page = await browser.get("/ui/admin/live")
        warm = page.text.split('aria-label="Warm runners on GPU 0"', 1)[1].split("</ul>", 1)[0]
        assert "warm_a" in warm and "idle for" in warm and f"pid {pid}" in warm and "1 job" in warm


async def test_a_dead_workers_last_report_is_not_drawn_as_memory_it_holds(
    settings, manager, make_key, spawn_worker
):
    """The admin page drew a worker killed with a warm runner from its last heartbeat as if it were
    current: its GPU's memory reserved by a runner that had died with it, the runner listed idle."""
    job_id = await enqueue(manager, model="warm_a", vram_mb=2000)
    root = await make_key("root", admin=True)
    gone = spawn_worker("gone")
    await until(manager, job_id, lambda j: j.state is JobState.succeeded, timeout_s=30)
    async with api_client(settings) as http:
        deadline = time.monotonic() + 10
        while [
            r["state"] for g in (await http.get("/admin/workers")).json()[0]["gpus"] for r in g["warm"]
        ] != ["idle"]:
            assert time.monotonic() < deadline, "the heartbeat never showed the idle runner"
            await asyncio.sleep(0.1)
        gone.kill()
        while (worker := (await http.get("/admin/workers")).json()[0])["live"]:
            assert time.monotonic() < deadline + 10, worker
            await asyncio.sleep(0.2)
        assert [r["model"] for r in worker["gpus"][0]["warm"]] == ["warm_a"]  # the API: its last report
        async with client_for(http, None) as browser:
            await signed_in(browser, root)
            page = await browser.get("/ui/admin/live")
    shown = page.text.split(f'aria-label="Worker {worker["id"]}"', 1)[1].split("</article>", 1)[0]
    assert "Warm runners on" not in shown and "reserved by jobs" not in shown and "<svg" not in shown, shown
    said = "GPU 0 · virtual-0 (24.0 GiB); not live, so its memory and warm runners are not drawn"
    assert said in shown, shown


async def test_a_job_whose_lease_is_lost_in_a_warm_runner_ends_it_and_writes_nothing(
    manager, make_worker, engine, store, tmp_path
):
    """Fencing holds in a warm runner: when another worker has taken the job over (a newer attempt),
    the next heartbeat stops the job and its runner is ended, long before the model's 30 s timeout,
    and the old attempt writes nothing. The job reports no progress: a fenced progress write would
    stop it too."""
    job_id = await enqueue(manager, model="warm_b", vram_mb=2000, hang=True, steps=0)
    async with running(make_worker(burst=False, max_jobs_per_gpu=1)) as worker:
        first = await until(manager, job_id, lambda j: j.pid is not None)
        pid = await first_load(tmp_path, "warm_b")
        async with engine.begin() as conn:  # as if its lease had run out and another worker claimed it
            await conn.execute(TAKEN_OVER, {"id": job_id})
        for _ in range(200):  # the next heartbeat (every 0.5 s) finds the job gone
            if not alive(pid):
                break
            await asyncio.sleep(0.05)
        assert not alive(pid)  # stopped mid-job, so its runner was ended
        after = await enqueue(manager, model="warm_b", vram_mb=2000)
        assert (await until(manager, after, lambda j: j.state.final)).state is JobState.succeeded
        assert len(loads(tmp_path, "warm_b")) == 2 and worker.pool.starts_on(0) == {"warm_b": 2}
    job = await manager.get(job_id)
    assert (job.state, job.attempt, job.worker_id) == (JobState.running, first.attempt + 1, "test:other")
    assert [e.kind for e in await manager.events(job_id)] == ["submitted", "claimed", "started"]
    assert not (store.root / "results" / str(job_id)).exists()


async def test_a_job_taken_back_from_a_paused_worker_ends_its_old_warm_run_first(manager, spawn_worker):
    """A worker paused past its lease (SIGSTOP) mid-job in a warm runner: the worker that took the
    job back found the job's recorded pid, its runner's, but that process carries the runner's
    marker, not the job's, so it killed nothing. The old runner went on with the job beside the new
    attempt (on a GPU, holding its memory under it). It is now killed before the job is queued
    again, as a one-shot run is."""
    job_id = await enqueue(manager, model="warm_a", vram_mb=2000, sleep=60, steps=1)
    paused = spawn_worker("paused", lease_s=2)
    first = await until(manager, job_id, lambda j: j.pid is not None, timeout_s=30)
    assert first.pid is not None and alive(first.pid)
    paused.send_signal(signal.SIGSTOP)
    try:
        spawn_worker("other", lease_s=2)
        again = await until(manager, job_id, lambda j: j.attempt == 2, timeout_s=30)
        assert not alive(first.pid)  # ended before the job was claimed again
        assert again.worker_id != first.worker_id
    finally:
        paused.send_signal(signal.SIGCONT)


TAKEN_OVER = text(
    "UPDATE jobs SET attempt = attempt + 1, worker_id = 'test:other',"
    " lease_expires_at = now() + interval '60 seconds' WHERE id = :id"
)


async def test_the_warm_preference_is_bounded_so_a_cold_model_gets_its_turn(manager, make_worker, tmp_path):
    """Jobs of a warm model keep coming at the priority of a cold model's older job: with
    warm_streak_max = 2 the cold job starts within the first three, not after all of them."""
    first = await enqueue(manager, model="warm_a", vram_mb=2000)
    worker = make_worker([24_576], burst=False, max_jobs_per_gpu=1, claim_ahead_s=0.0, warm_streak_max=2)
    async with running(worker):
        await until(manager, first, lambda j: j.state is JobState.succeeded)
        busy = await enqueue(manager, model="warm_a", vram_mb=2000, sleep=1.0)  # holds the one slot...
        await until(manager, busy, lambda j: j.state is JobState.running)
        cold = await enqueue(manager, model="warm_b", vram_mb=2000, sleep=0.1)  # ...while these queue
        stream = [await enqueue(manager, model="warm_a", vram_mb=2000, sleep=0.1) for _ in range(5)]
        done = [await until(manager, i, lambda j: j.state is JobState.succeeded) for i in [cold, *stream]]
    order = [job.id for job in sorted(done, key=lambda job: job.started_at)]
    assert order.index(cold) <= 2, order  # the preference takes at most two warm jobs ahead of it
    assert len(loads(tmp_path, "warm_a")) == 1  # and warm_a stayed loaded meanwhile


async def test_a_job_whose_worker_died_in_its_first_half_second_in_a_runner_never_runs_twice(
    manager, spawn_worker, tmp_path
):
    """A worker SIGKILLed in the first half second of a job in a warm runner (the runner's pid is
    recorded on the job only after that): the runner goes on with the job, and nothing marked it
    as the job's run (it carries its worker's marker, not the job's). The worker that took the job
    back killed nothing: two runs of the job were alive at once, each holding GPU memory."""
    job_id = await enqueue(manager, model="warm_b", vram_mb=2000, sleep=15, steps=1)
    doomed = spawn_worker("doomed", lease_s=2)
    runner = await first_load(tmp_path, "warm_b", timeout_s=30)
    await asyncio.sleep(0.25)  # the job is sent to it as it says it is ready
    doomed.send_signal(signal.SIGKILL)
    doomed.wait(5)
    first = await manager.get(job_id)
    assert first.pid is None and first.attempt == 1  # not recorded yet
    spawn_worker("other", lease_s=2)
    again = await until(manager, job_id, lambda j: j.attempt == 2, timeout_s=30)
    assert again.worker_id is not None and again.worker_id.endswith(worker_name("other"))
    assert not alive(runner), "the dead worker's runner still runs attempt 1 beside attempt 2"


async def test_a_runner_still_loading_when_its_worker_is_killed_is_gone_before_the_job_runs_again(
    manager, spawn_worker, tmp_path
):
    """A worker SIGKILLed while the runner it started for a job still loaded its model (the job's
    pid is recorded only once the job runs in it): the orphan went on loading, holding the GPU
    memory a real model's load takes, beside the job's next attempt, for as long as its load
    lasted; its HOME and TMPDIR were removed under it meanwhile."""
    job_id = await enqueue(manager, model="warm_slow", vram_mb=2000, sleep=0.1, steps=1)
    doomed = spawn_worker("doomed", lease_s=2)
    orphan = await first_load(tmp_path, "warm_slow", timeout_s=30)  # loading: 30 s
    assert (await manager.get(job_id)).pid is None  # the job has not reached it
    doomed.send_signal(signal.SIGKILL)
    doomed.wait(5)
    spawn_worker("other", lease_s=2)
    again = await until(manager, job_id, lambda j: j.attempt == 2, timeout_s=30)
    assert again.worker_id is not None and again.worker_id.endswith(worker_name("other"))
    assert not alive(orphan), "the killed worker's runner still loads beside the job's new attempt"
