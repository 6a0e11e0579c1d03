"""`gpujobs worker` asked to stop twice: the first SIGTERM shuts down gracefully, waiting for the
database to write what its jobs became; a second SIGTERM or Ctrl-C stops it now, killing its models
and warm runners and handing its jobs back if the database answers at once, else leaving them to
its restart or their leases.

Real worker processes (conftest's `spawn_worker`), their database reached through a link the test
cuts (tests/netcut.py)."""

from __future__ import annotations

import asyncio
import signal
import socket
import time
import uuid
from pathlib import Path
from typing import Any

from sqlalchemy import text

from app.queue import leftovers
from app.queue.jobs import JobState
from app.queue.manager import JobManager
from tests.conftest import worker_name
from tests.integration.test_durability import alive, kinds, until
from tests.integration.test_worker import enqueue
from tests.netcut import CuttableLink


def marked(name: str) -> set[int]:
    """The live process groups of the models and warm runners worker `name` started."""
    worker = f"{socket.gethostname()}:{worker_name(name)}"
    return {pgid for pgid in leftovers.find_worker_models(worker) if alive(pgid)}


async def two_running(manager: JobManager) -> list[uuid.UUID]:
    """A one-shot job and a warm runner's job, each for 30 s, both started."""
    jobs = [
        await enqueue(manager, sleep=30, steps=30),
        await enqueue(manager, model="warm_b", sleep=30, steps=30),
    ]
    for job_id in jobs:
        await until(manager, job_id, lambda j: j.state is JobState.running and j.pid is not None)
    return jobs


async def stopped_at_once(worker: Any, sig: signal.Signals) -> tuple[int, float]:
    """Send `sig` (the second) to a stopping worker: its exit code, and the seconds it took."""
    worker.send_signal(sig)
    started = time.monotonic()
    code = await asyncio.to_thread(worker.wait, 20)
    return code, time.monotonic() - started


def left_no_model(name: str, log: Path, jobs: list[uuid.UUID]) -> None:
    """Worker `name` killed its models and runners, and one line of its `log` names every job left."""
    assert marked(name) == set()
    [line] = [line for line in log.read_text().splitlines() if "action=worker_stopped_now" in line]
    assert all(str(job_id) in line for job_id in jobs), line


async def test_a_second_signal_stops_a_worker_waiting_for_the_database(
    manager, spawn_worker, settings, tmp_path
):
    """SIGTERM while the database is away: the worker stops its models after the grace and keeps
    trying to hand the jobs back, so nothing is lost (and stays so). A second SIGTERM or Ctrl-C did
    nothing: the worker waited for the database forever. Now it exits at once (exit code 1), its
    jobs left running in the database (its hand-back fails), to be taken back by its restart (or
    after their leases)."""
    assert settings.database_url
    link = CuttableLink(settings.database_url, tmp_path / "link")
    url = await link.start()
    try:
        worker = spawn_worker("outage", database_url=url, shutdown_grace_s=1)
        jobs = await two_running(manager)
        link.cut()
        worker.send_signal(signal.SIGTERM)
        await asyncio.sleep(3)  # the grace passed; the models were stopped; the hand-backs wait
        assert worker.poll() is None  # the first signal still waits for the database
        code, stopped_s = await stopped_at_once(worker, signal.SIGINT)
    finally:
        await link.close()
    assert (code, stopped_s < 5) == (1, True), (code, stopped_s)
    log = next(tmp_path.glob("worker-outage-*.log"))
    left_no_model("outage", log, jobs)
    [line] = [line for line in log.read_text().splitlines() if "action=jobs_left" in line]
    assert all(str(job_id) in line for job_id in jobs), line
    for job_id in jobs:  # not handed back, not failed: still the stopped worker's
        job = await manager.get(job_id)
        assert (job.state, job.attempt) == (JobState.running, 1)
    spawn_worker("outage")  # its restart takes them back at once, no attempt lost
    for job_id in jobs:
        await until(manager, job_id, lambda j: j.attempt == 2, timeout_s=15)
        assert "recovered" in await kinds(manager, job_id)


async def handed_back(manager: JobManager, jobs: list[uuid.UUID]) -> None:
    """Each job is queued again by the worker stopped at once, its attempt not spent (its budget
    grown by one, as a graceful stop's hand-back does) and no abnormal death counted."""
    for job_id in jobs:
        job = await manager.get(job_id)
        assert (job.state, job.attempt, job.max_attempts, job.abnormal_runs) == (JobState.queued, 1, 4, 0)
        assert (await kinds(manager, job_id))[-1] == "released"


async def test_a_second_signal_during_the_grace_kills_models_and_runners(manager, spawn_worker, tmp_path):
    """The database is up, the running jobs in their grace: a second SIGTERM ended nothing before
    the grace had passed. It now kills the models and the warm runner at once and exits (code 1).
    Its jobs were left running under its name, and the reaper that took them back counted an
    attempt and an abnormal death for each, as for a crashed worker: an operator who asked twice
    made the jobs pay. Now they are handed back, no attempt spent, once the models are dead."""
    worker = spawn_worker("grace", shutdown_grace_s=60)
    jobs = await two_running(manager)
    assert len(marked("grace")) == 2
    worker.send_signal(signal.SIGTERM)
    await asyncio.sleep(1.5)  # a second signal within a second is the first delivered twice
    assert worker.poll() is None and len(marked("grace")) == 2
    code, stopped_s = await stopped_at_once(worker, signal.SIGTERM)
    assert (code, stopped_s < 5) == (1, True), (code, stopped_s)
    left_no_model("grace", next(tmp_path.glob("worker-grace-*.log")), jobs)
    await handed_back(manager, jobs)
    spawn_worker("other")
    for job_id in jobs:
        job = await until(manager, job_id, lambda j: j.attempt == 2, timeout_s=15)
        assert job.abnormal_runs == 0


async def test_a_second_signal_leaves_the_jobs_when_the_database_does_not_answer_in_time(
    manager, spawn_worker, engine, tmp_path
):
    """The hand-back of a worker stopped at once waits for the database a bounded time: here its
    statement waits on row locks another session holds. The worker still exits at once, its jobs
    left running under its name, as before, and says so; its restart takes them back."""
    worker = spawn_worker("stuck", shutdown_grace_s=60)
    jobs = await two_running(manager)
    worker.send_signal(signal.SIGTERM)
    await asyncio.sleep(1.5)
    async with engine.begin() as conn:  # held until the worker has exited
        await conn.execute(text("SELECT id FROM jobs WHERE id = ANY(:ids) FOR UPDATE"), {"ids": jobs})
        code, stopped_s = await stopped_at_once(worker, signal.SIGTERM)
    assert (code, stopped_s < 5) == (1, True), (code, stopped_s)
    log = next(tmp_path.glob("worker-stuck-*.log"))
    left_no_model("stuck", log, jobs)
    [line] = [line for line in log.read_text().splitlines() if "action=jobs_left" in line]
    assert "did not answer within 1.5 s" in line and all(str(job_id) in line for job_id in jobs), line
    for job_id in jobs:
        job = await manager.get(job_id)
        assert (job.state, job.attempt) == (JobState.running, 1)
    spawn_worker("stuck")
    for job_id in jobs:
        await until(manager, job_id, lambda j: j.attempt == 2, timeout_s=15)


async def test_a_job_a_forced_stop_ends_canceled_loses_its_dead_attempts_folders(
    manager, make_worker, engine, store
):
    """A forced stop ends a job whose cancel is pending canceled, but left the folder a dead
    worker's attempt had half stored until retention, where every other end of a job drops it."""
    job_id = await enqueue(manager, max_attempts=3, sleep=30, steps=30)
    await manager.claim(worker_id="t:gone", host="h", models=["toy"], budgets={0: 9000}, lease_s=60)
    dead = store.root / "results" / str(job_id) / ".1.partial"  # attempt 1's worker died storing it
    dead.mkdir(parents=True)
    (dead / "out.txt").write_text("half stored")
    async with engine.begin() as conn:
        await conn.execute(
            text("UPDATE jobs SET lease_expires_at = now() - interval '1 hour' WHERE id = :id"),
            {"id": job_id},
        )
    [back] = await manager.fleet.recover_expired(by_worker="t:reaper")
    assert back.state is JobState.queued
    worker = make_worker(heartbeat_interval_s=30)
    task = asyncio.create_task(worker.run())
    await until(manager, job_id, lambda j: j.state is JobState.running and j.pid is not None)
    async with engine.begin() as conn:  # pending, its NOTIFY unseen (burst workers do not listen)
        await conn.execute(text("UPDATE jobs SET cancel_requested = true WHERE id = :id"), {"id": job_id})
    worker.stop()
    worker.stop_now()
    await asyncio.wait_for(task, 20)
    job = await manager.get(job_id)
    assert (job.state, job.attempt) == (JobState.canceled, 2)
    assert not (store.root / "results" / str(job_id)).exists() or not list(
        (store.root / "results" / str(job_id)).iterdir()
    )


async def test_a_worker_stopped_at_once_that_handed_its_jobs_back_is_not_left_for_dead(
    manager, spawn_worker, engine
):
    """Asked twice (Ctrl-C twice, `kill` twice), a worker kills its models, hands its jobs back
    (the database answered at once) and exits 1. Its row in `workers` stayed `stopping`: the
    other workers' reapers then marked it dead and logged `worker_dead`, and
    `gpujobs_worker_heartbeat_age_seconds` kept it for a day, its age growing, which the
    dead-worker alert of docs/operations.md fires on, as for a worker that crashed."""
    worker = spawn_worker("twice", shutdown_grace_s=60)
    job_id = await enqueue(manager, sleep=30, steps=30)
    await until(manager, job_id, lambda j: j.pid is not None)
    worker.send_signal(signal.SIGTERM)
    await asyncio.sleep(1.5)  # a second signal within a second is the first delivered twice
    code, _ = await stopped_at_once(worker, signal.SIGTERM)
    assert code == 1
    await handed_back(manager, [job_id])
    worker_id = f"{socket.gethostname()}:{worker_name('twice')}"
    async with engine.connect() as conn:
        state = await conn.scalar(text("SELECT state FROM workers WHERE id = :id"), {"id": worker_id})
    assert state == "stopped", f"the worker's row says {state!r} after it stopped"
