"""Times and clocks: what a host's time zone, or the database server's, does to the times we show;
a worker host whose wall clock is off, and a database whose clock steps.

A job's life is timed by the database's clock (docs/operations.md, "Clocks"). A worker host's clock
is skewed here for real: its `python -m app worker` process starts with a sitecustomize that shifts
`time.time` (the database's clock stays real). A step of the database's clock is shown by moving
every stored time the other way: for each comparison of a stored time with `now()` (leases,
heartbeats, retries) that is the same as `now()` jumping, on a server up for longer than a lease."""

from __future__ import annotations

import asyncio
import logging
import signal
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import text
from sqlalchemy.engine import make_url

from app import logs
from app.queue.jobs import JobState
from tests import dbadmin
from tests.conftest import api_client, worker_env, worker_name
from tests.integration.test_durability import alive, kinds, running, until
from tests.integration.test_observability import capture
from tests.integration.test_worker import enqueue


async def test_a_retry_time_in_a_jobs_history_is_utc_whatever_the_servers_zone(
    server_url, database_url, settings, manager, make_worker
):
    """A PostgreSQL server in another zone (initdb takes the host's: `timezone` in
    postgresql.conf) wrote the `run_after` of a `retry_scheduled` event in that zone
    ("...+05:30"), where every other time the API answers is in UTC."""
    name = make_url(database_url).database
    await dbadmin.admin(server_url, f"ALTER DATABASE {name} SET timezone = 'Asia/Kolkata'")
    job_id = await enqueue(manager, exit_code=3, max_attempts=2)
    await make_worker(retry_base_s=600, retry_max_s=600).run()  # scheduled in 10 minutes
    async with api_client(settings) as http:
        job = (await http.get(f"/jobs/{job_id}")).json()
        events = (await http.get(f"/jobs/{job_id}/events")).json()
    [retry] = [e for e in events if e["kind"] == "retry_scheduled"]
    run_after = retry["detail"]["run_after"]
    assert datetime.fromisoformat(run_after).utcoffset() == timedelta(0), run_after
    assert datetime.fromisoformat(run_after) == datetime.fromisoformat(job["next_run_at"])
    assert all(datetime.fromisoformat(e["at"]).utcoffset() == timedelta(0) for e in events), events


def test_a_text_log_line_says_its_time_in_utc_whatever_the_hosts_zone(monkeypatch):
    """A text line began with the host's local time and no zone ("2026-11-26 07:00:00,123"): the
    lines of a worker in New York and of an API in Frankfurt, read side by side, were hours apart
    for the same moment. JSON lines were UTC already."""
    handler, stop = capture(logs.TextFormatter())
    monkeypatch.setenv("TZ", "Etc/GMT+5")  # five hours behind UTC, as New York in winter
    time.tzset()
    try:
        logging.getLogger("gpujobs.clock_test").warning("hello", extra={"action": "demo"})
    finally:
        stop()
        monkeypatch.undo()
        time.tzset()
    [line] = handler.lines
    written = datetime.fromisoformat(line.split(" ", 1)[0])
    assert written.utcoffset() == timedelta(0), line
    assert abs(written - datetime.now(UTC)) < timedelta(seconds=60), line


SKEWED_CLOCK = """
import os
import time

_offset_s = float(os.environ["TEST_CLOCK_SKEW_S"])
_time, _time_ns = time.time, time.time_ns
time.time = lambda: _time() + _offset_s
time.time_ns = lambda: _time_ns() + int(_offset_s * 1e9)
"""

TIMESTAMP_COLUMNS = text(
    "SELECT table_name, column_name FROM information_schema.columns"
    " WHERE table_schema = current_schema() AND data_type = 'timestamp with time zone'"
)


async def step_database_clock(engine: Any, seconds: float) -> None:
    """As if the database server's clock jumped by `seconds` (forward if positive): every stored
    time moves the other way, in one transaction."""
    async with engine.begin() as conn:
        columns: dict[str, list[str]] = {}
        for table, column in (await conn.execute(TIMESTAMP_COLUMNS)).all():
            columns.setdefault(table, []).append(column)
        for table, names in columns.items():
            moved = ", ".join(f"{c} = {c} - make_interval(secs => :s)" for c in names)
            await conn.execute(text(f"UPDATE {table} SET {moved}"), {"s": seconds})


def spawn_skewed(settings: Any, tmp_path: Path, name: str, skew_s: float) -> subprocess.Popen[bytes]:
    """A `gpujobs worker` process whose host clock (time.time) is `skew_s` off the database's."""
    site = tmp_path / f"site-{name}"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SKEWED_CLOCK)
    env = {**worker_env(settings, name), "PYTHONPATH": str(site), "TEST_CLOCK_SKEW_S": str(skew_s)}
    with (tmp_path / f"worker-{name}.log").open("wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "app", "worker"], env=env, stdout=log, stderr=subprocess.STDOUT
        )


async def worker_states(engine: Any) -> dict[str, str]:
    async with engine.connect() as conn:
        return dict((await conn.execute(text("SELECT id, state FROM workers"))).all())


async def test_workers_on_hosts_a_minute_ahead_and_behind_run_and_recover_jobs_once(
    settings, manager, engine, tmp_path
):
    """Two worker hosts, one 60 s ahead of the database, one 60 s behind: a job that outlives
    several leases runs once, neither worker is taken for dead, and the job of one that is killed
    is taken back by the other within a lease and a reap round or two."""
    workers = [
        spawn_skewed(settings, tmp_path, "ahead", 60),
        spawn_skewed(settings, tmp_path, "behind", -60),
    ]
    try:
        first = await enqueue(manager, sleep=4, steps=4)  # lease_s is 3: renewed on the way
        done = await until(manager, first, lambda j: j.state.final)
        assert (done.state, done.attempt) == (JobState.succeeded, 1), done.error
        assert "recovered" not in await kinds(manager, first)
        assert set((await worker_states(engine)).values()) == {"running"}

        second = await enqueue(manager, sleep=60, steps=60)
        job = await until(manager, second, lambda j: j.pid is not None)
        victim = workers[0 if job.worker_id.endswith(":" + worker_name("ahead")) else 1]
        victim.send_signal(signal.SIGKILL)
        victim.wait(5)
        killed_at = time.monotonic()
        back = await until(manager, second, lambda j: j.attempt == 2 and j.pid is not None, timeout_s=20)
        assert back.worker_id != job.worker_id
        assert time.monotonic() - killed_at < 3 * settings.lease_s + 2
        assert (await kinds(manager, second)).count("recovered") == 1
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
            worker.wait(10)


async def test_a_database_clock_that_steps_forward_does_not_take_running_jobs_back(
    manager, make_worker, engine
):
    """The database host's clock steps a minute forward (NTP after a suspended VM resumes, say)
    while a healthy worker runs a job. Every lease then lies in the past by `now()`, though its
    worker renewed it a moment ago and is alive: the job must still run once, on its first (here
    its only) attempt, rather than be taken from its worker as if that worker were lost."""
    job_id = await enqueue(manager, sleep=4, steps=4, max_attempts=1)
    async with running(make_worker(burst=False)):
        await until(manager, job_id, lambda j: j.pid is not None)
        await step_database_clock(engine, 60)
        done = await until(manager, job_id, lambda j: j.state.final)
    history = await kinds(manager, job_id)
    assert (done.state, done.attempt, done.abnormal_runs) == (JobState.succeeded, 1, 0), (done.error, history)
    assert "recovered" not in history and "failed" not in history


async def test_step_database_clock_moves_every_time(manager, engine):
    """The helper itself: a lease and a creation time move by the step."""
    job_id: uuid.UUID = await enqueue(manager)
    before = await manager.get(job_id)
    await step_database_clock(engine, 60)
    after = await manager.get(job_id)
    assert (before.created_at - after.created_at).total_seconds() == 60
    assert (before.run_after - after.run_after).total_seconds() == 60


async def one_of_two_workers_killed_mid_job(manager: Any, spawn_worker: Any) -> tuple[uuid.UUID, Any, Any]:
    """Two worker processes, one long job: the one running it killed (kill -9). The job's id, the
    job as it ran, and the worker left."""
    job_id = await enqueue(manager, sleep=60, steps=60)
    workers = {name: spawn_worker(name) for name in ("survives", "dies")}
    job = await until(manager, job_id, lambda j: j.pid is not None)
    ran_it = next(name for name in workers if job.worker_id.endswith(":" + worker_name(name)))
    workers[ran_it].send_signal(signal.SIGKILL)
    workers[ran_it].wait(5)
    return job_id, job, next(w for name, w in workers.items() if name != ran_it)


async def test_a_dead_workers_job_is_still_taken_back_after_a_forward_step_of_the_database_clock(
    manager, engine, spawn_worker, settings
):
    """The other side of the above: the reapers hold off for one lease after a step, and then a
    job whose worker died is taken back as before."""
    job_id, job, other = await one_of_two_workers_killed_mid_job(manager, spawn_worker)
    await step_database_clock(engine, 60)
    stepped_at = time.monotonic()
    back = await until(manager, job_id, lambda j: j.attempt == 2, timeout_s=6 * settings.lease_s + 10)
    assert back.worker_id != job.worker_id
    assert time.monotonic() - stepped_at >= settings.lease_s - 1  # held off for a lease first
    assert other.poll() is None


BEAT_AT = text("SELECT heartbeat_at FROM workers WHERE id = :id")


async def just_beaten(engine: Any, worker: str, timeout_s: float = 10) -> None:
    """Return right after `worker`'s row took a new beat (its heartbeat_at changed)."""
    async with engine.connect() as conn:
        first = (await conn.execute(BEAT_AT, {"id": worker})).scalar()
    deadline = time.monotonic() + timeout_s
    while True:
        async with engine.connect() as conn:
            if (await conn.execute(BEAT_AT, {"id": worker})).scalar() != first:
                return
        assert time.monotonic() < deadline, f"{worker} took no beat"
        await asyncio.sleep(0.01)


async def test_a_worker_stopping_gracefully_when_the_database_clock_steps_keeps_its_job(
    manager, make_worker, engine
):
    """A graceful stop writes the worker's heartbeat_at (SET_WORKER_STATE) without its BeatClock
    knowing: a step of the database's clock just before it is then counted from after the step, so
    the stopping worker's next beat sees none, refuses to renew the lease the step ran out, and the
    job it was finishing in its grace ends failed, 'lease expired'."""
    job_id = await enqueue(manager, sleep=4, steps=4, max_attempts=1)
    worker = make_worker(burst=False, shutdown_grace_s=30, heartbeat_interval_s=1.0)
    task = asyncio.create_task(worker.run())
    try:
        await until(manager, job_id, lambda j: j.pid is not None)
        await just_beaten(engine, worker.id)
        await step_database_clock(engine, 60)
        worker.stop()  # graceful: the job may finish within its grace
    finally:
        worker.stop()
        await task
    done = await manager.get(job_id)
    history = await kinds(manager, job_id)
    assert (done.state, done.attempt) == (JobState.succeeded, 1), (done.error, history)


async def test_a_worker_started_just_after_a_step_takes_no_live_workers_job(manager, make_worker, engine):
    """A worker that registers after the database's clock stepped has no beat before the step to
    see it by: its first reap round found the live worker's lease run out (by the step) and killed
    its run and took the job back before that worker's next beat could renew it."""
    job_id = await enqueue(manager, sleep=6, steps=6, max_attempts=1)
    # The default heartbeat is a quarter of the lease (5 s of 20 s): the same ratio here.
    first = make_worker(burst=False, name="first", heartbeat_interval_s=0.75)
    async with running(first):
        job = await until(manager, job_id, lambda j: j.pid is not None)
        await just_beaten(engine, first.id)
        await step_database_clock(engine, 60)
        async with running(make_worker(burst=False, name="second")):
            done = await until(manager, job_id, lambda j: j.state.final, timeout_s=30)
    history = await kinds(manager, job_id)
    assert (done.state, done.attempt, done.worker_id) == (JobState.succeeded, 1, job.worker_id), (
        done.error,
        history,
    )


async def test_a_database_clock_that_keeps_stepping_back_and_forth_still_lets_a_dead_workers_job_back(
    manager, engine, spawn_worker, settings
):
    """Two time sources fighting over the database host's clock (a hypervisor's sync setting it
    back, NTP stepping it forward again, each by a little over the 1 s tolerance): each forward
    step holds every reaper off for a lease again, so one step within each lease held them off for
    good, and a dead worker's job was never taken back (nor the worker marked dead)."""
    job_id, job, other = await one_of_two_workers_killed_mid_job(manager, spawn_worker)
    killed_at = time.monotonic()
    while (await manager.get(job_id)).attempt == 1 and time.monotonic() - killed_at < 10 * settings.lease_s:
        await step_database_clock(engine, -1.5)  # set back...
        await asyncio.sleep(1.0)
        await step_database_clock(engine, 1.5)  # ...and forward again: no drift in all
        await asyncio.sleep(1.0)
    job = await manager.get(job_id)
    assert job.attempt == 2, f"not taken back {time.monotonic() - killed_at:.0f} s after its worker died"
    assert other.poll() is None


async def test_a_worker_paused_past_its_lease_is_forgiven_nothing_on_resuming(
    manager, engine, spawn_worker, settings, tmp_path
):
    """SIGSTOP stops the worker, not its steady clock: resumed, its heartbeat sees no step, does not
    renew the lease that ran out meanwhile, and stops its run; the job is taken back once."""
    job_id = await enqueue(manager, sleep=60, steps=60)
    paused = spawn_worker("paused")
    job = await until(manager, job_id, lambda j: j.pid is not None)
    paused.send_signal(signal.SIGSTOP)
    try:
        await asyncio.sleep(2 * settings.lease_s)
    finally:
        paused.send_signal(signal.SIGCONT)
    # No other worker: nobody took the job back while it slept; its own heartbeat must drop it.
    await asyncio.sleep(3 * settings.heartbeat_interval_s + 1)
    assert not alive(job.pid), "its run still runs on a lease that ran out while its worker slept"
    log = (tmp_path / "worker-paused-0.log").read_text()
    assert "db_clock_stepped" not in log, log[-3000:]
    after = await until(manager, job_id, lambda j: j.attempt == 2 or j.state is not JobState.running)
    assert "recovered" in await kinds(manager, job_id) or after.attempt == 2


async def test_a_worker_paused_past_its_lease_while_a_neighbour_reaps_runs_its_job_once(
    manager, engine, spawn_worker, settings, tmp_path
):
    """The fencing the design promises: a worker paused past its lease has its run killed by a
    worker on its host before the job is queued again; resumed, it renews nothing."""
    job_id = await enqueue(manager, sleep=60, steps=60)
    paused = spawn_worker("paused")
    job = await until(manager, job_id, lambda j: j.pid is not None)
    paused.send_signal(signal.SIGSTOP)
    try:
        spawn_worker("neighbour")
        again = await until(manager, job_id, lambda j: j.attempt == 2 and j.pid is not None, timeout_s=30)
        assert not alive(job.pid)  # killed before the second attempt started
        assert again.worker_id.endswith(":" + worker_name("neighbour"))
    finally:
        paused.send_signal(signal.SIGCONT)
    await asyncio.sleep(3 * settings.heartbeat_interval_s + 1)
    now = await manager.get(job_id)
    assert (now.attempt, now.worker_id, now.state) == (2, again.worker_id, JobState.running)
    assert alive(again.pid)
    assert "db_clock_stepped" not in (tmp_path / "worker-paused-0.log").read_text()
