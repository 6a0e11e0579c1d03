"""The worker: claims by priority and VRAM fit, runs real subprocesses, stores results."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from app import errors, images
from app.queue import attempt as attempt_
from app.queue import records, verdict, watch
from app.queue.jobs import JobState
from app.queue.manager import JobManager
from app.runlog import TAIL_BYTES
from tests.conftest import png_bytes, script_model


async def enqueue(
    manager: JobManager,
    *,
    model: str = "toy",
    priority: int = 0,
    vram_mb: int = 1000,
    max_attempts: int = 3,
    image: bytes | None = None,
    queue_limit: int = 100_000,
    owner: str = "tester",
    **params: Any,
) -> uuid.UUID:
    """Queue a job directly through the manager (the API is tested elsewhere)."""
    checked = images.inspect(image or png_bytes(), max_pixels=10**8)
    spec_defaults = {
        "sleep": 0.0,
        "steps": 2,
        "oom_attempts": 0,
        "exit_code": 0,
        "fail_attempts": 0,
        "signal": "none",
        "output": True,
        "trace": "none",
    }
    job, _ = await manager.enqueue(
        records.NewJob(
            owner,
            model,
            {**(spec_defaults if model.startswith("toy") else {}), **params},
            priority,
            vram_mb,
            max_attempts,
        ),
        checked,
        queue_limit=queue_limit,
    )
    return job.id


def trace(path: Path) -> list[dict[str, Any]]:
    """Runs recorded by the toy model, in the order they ended."""
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def peak_overlap(runs: list[dict[str, Any]]) -> int:
    """The most runs (trace lines with a start and an end) that overlapped at one moment."""
    edges = sorted([(r["start"], 1) for r in runs] + [(r["end"], -1) for r in runs])
    peak = now = 0
    for _, step in edges:
        now += step
        peak = max(peak, now)
    return peak


async def test_toy_job_runs_and_its_result_is_stored(manager, make_worker, store):
    job_id = await enqueue(manager, steps=4, sleep=0.8)  # long enough to record its pid
    worker = make_worker()
    await worker.run()
    job = await manager.get(job_id)
    assert job.state is JobState.succeeded, job.error
    assert job.attempt == 1 and job.progress == 1
    [result] = job.results
    path, media_type, _ = store.resolve(job, "out.txt")
    assert path.read_text() == f"done {job_id}:1\n" and media_type == "text/plain"
    assert result.bytes == path.stat().st_size
    log = store.log_path(job_id, 1).read_text()
    assert "toy model stderr line" in log and "PROGRESS" in log
    kinds = [e.kind for e in await manager.events(job_id)]
    assert kinds[:2] == ["submitted", "claimed"] and "started" in kinds
    assert "progress" in kinds and kinds[-1] == "succeeded"
    assert list((store.root / "scratch").glob("*/*")) == []  # the stopped worker removed its lanes


async def test_a_model_that_floods_its_log_leaves_a_capped_log_and_succeeds(manager, make_worker, store):
    """8 MiB of stderr against a 64 KiB cap: the log keeps its head, a line of the worker's saying
    how much was left out, and the run's last lines. The pipes were read to the end all along (a
    model must never stall on a full log), so the run ended by itself and the job succeeded."""
    job_id = await enqueue(manager, noise_kb=8192)
    await make_worker(max_log_mb=1 / 16).run()
    job = await manager.get(job_id)
    assert job.state is JobState.succeeded and job.progress == 1, job.error
    log = store.log_path(job_id, 1).read_bytes()
    assert len(log) < 64 * 1024 + TAIL_BYTES + 200
    head, marker, end = log.partition(b"[runner] log cap of 65536 bytes reached: ")
    assert marker and head.startswith(b"[runner] started pid ") and b"noise line 00000000" in head
    left_out = int(end.split(b" ", 1)[0])
    assert 8 * 2**20 - 64 * 1024 - TAIL_BYTES < left_out < 8 * 2**20
    last = b"noise line 00131071 " + b"." * 43 + b"\ntoy model stderr line\n[runner] exit code 0\n"
    assert end.endswith(last)


def overlaps(runs: list[dict[str, Any]]) -> int:
    """The largest number of runs that were going on at the same moment."""
    edges = sorted(
        [(r["start"], 1) for r in runs] + [(r["end"], -1) for r in runs], key=lambda e: (e[0], e[1])
    )
    level = peak = 0
    for _, step in edges:
        level += step
        peak = max(peak, level)
    return peak


async def test_priority_orders_a_single_slot(manager, make_worker, tmp_path):
    log = tmp_path / "trace.jsonl"
    order = [0, 5, -3, 5, 10]
    ids = [await enqueue(manager, priority=p, trace=str(log)) for p in order]
    await make_worker(max_jobs_per_gpu=1).run()
    ran = [r["job"].split(":")[0] for r in trace(log)]
    expected = [str(ids[i]) for i in (4, 1, 3, 0, 2)]  # higher first, then older first
    assert ran == expected


async def test_six_gb_jobs_never_overlap_on_a_ten_gb_gpu(manager, make_worker, tmp_path):
    log = tmp_path / "trace.jsonl"
    for _ in range(4):
        await enqueue(manager, vram_mb=6 * 1024, sleep=0.3, trace=str(log))
    await make_worker([10 * 1024]).run()
    runs = trace(log)
    assert len(runs) == 4
    assert overlaps(runs) == 1


async def test_four_gb_jobs_run_two_at_a_time_on_a_ten_gb_gpu(manager, make_worker, tmp_path):
    log = tmp_path / "trace.jsonl"
    for _ in range(6):
        await enqueue(manager, vram_mb=4 * 1024, sleep=0.4, trace=str(log))
    await make_worker([10 * 1024]).run()
    runs = trace(log)
    assert len(runs) == 6
    assert overlaps(runs) == 2


async def test_a_gpu_slot_is_handed_on_while_the_last_outcome_is_written(manager, make_worker, tmp_path):
    # One slot, two jobs; the first job's success takes a second to write. The second job's model
    # must start meanwhile (the GPU is free once the first model exited), not after the write.
    log = tmp_path / "trace.jsonl"
    first = await enqueue(manager, priority=1, trace=str(log))
    second = await enqueue(manager, priority=0, trace=str(log))
    writes: dict[uuid.UUID, tuple[float, float]] = {}
    succeed = manager.succeed

    async def slow_succeed(job, results, detail):
        began = time.time()
        if job.id == first:
            await asyncio.sleep(1.0)
        await succeed(job, results, detail)
        writes[job.id] = (began, time.time())

    manager.succeed = slow_succeed
    await make_worker(max_jobs_per_gpu=1).run()
    runs = {r["job"].split(":")[0]: r for r in trace(log)}
    assert [(await manager.get(i)).state for i in (first, second)] == [JobState.succeeded] * 2
    assert overlaps(list(runs.values())) == 1  # the models themselves never shared the slot
    assert runs[str(first)]["end"] <= writes[first][0]
    assert runs[str(second)]["start"] < writes[first][1] - 0.5, (runs, writes)


async def test_a_job_whose_outcome_is_being_written_keeps_its_lease(manager, make_worker):
    # Its slot is handed on when the model ends, but the job stays the worker's until the outcome
    # is written: a write slower than the lease must not let another worker's reaper take it back.
    job_id = await enqueue(manager)
    succeed = manager.succeed

    async def slow_succeed(job, results, detail):
        await asyncio.sleep(3.0)  # longer than the lease
        await succeed(job, results, detail)

    manager.succeed = slow_succeed
    # Ten heartbeats a lease: a busy CI machine once stalled the worker past a 1 s lease.
    run = asyncio.create_task(make_worker(lease_s=2.0, heartbeat_interval_s=0.2).run())
    taken = []
    while not run.done():
        taken += await manager.fleet.recover_expired(by_worker="test:other")
        await asyncio.sleep(0.2)
    await run
    job = await manager.get(job_id)
    assert taken == [] and job.state is JobState.succeeded and job.attempt == 1


async def test_a_success_whose_answer_was_lost_keeps_its_files(manager, make_worker, store):
    """The connection can drop after the success committed and before its answer came back. The
    write is tried again and finds the job no longer running; it is this attempt's success, so the
    result files stay (they were deleted as a lost lease's)."""
    job_id = await enqueue(manager)
    succeed = manager.succeed
    tries: list[uuid.UUID] = []

    async def answer_lost(job, results, detail):
        tries.append(job.id)
        await succeed(job, results, detail)
        if len(tries) == 1:
            raise ConnectionResetError("the connection closed before the answer came")

    manager.succeed = answer_lost
    await make_worker().run()
    job = await manager.get(job_id)
    assert job.state is JobState.succeeded and tries == [job_id, job_id]
    path, _, _ = store.resolve(job, "out.txt")
    assert path.read_text() == f"done {job_id}:1\n"


async def test_a_pid_being_recorded_when_the_run_ends_is_recorded(manager, make_worker, engine):
    # The pid is recorded once a run lasts PID_AFTER_S (0.5 s). Here the statement is slow and the
    # run ends first: the statement must be let finish, not cut off (rolled back, it left a hole
    # in the event ids that held the metrics' counting back for 10 s).
    job_id = await enqueue(manager, sleep=0.6)
    set_pid = manager.set_pid

    async def slow_set_pid(job, pid):
        await asyncio.sleep(1.5)
        return await set_pid(job, pid)

    manager.set_pid = slow_set_pid
    await make_worker().run()
    job = await manager.get(job_id)
    kinds = [e.kind for e in await manager.events(job_id)]
    assert job.state is JobState.succeeded and "started" in kinds, kinds
    async with engine.connect() as conn:
        ids = (await conn.execute(text("SELECT id FROM job_events ORDER BY id"))).scalars().all()
    assert ids == list(range(ids[0], ids[0] + len(ids)))  # no hole


async def test_two_gpus_are_both_used_and_jobs_placed_tightly(manager, make_worker, tmp_path):
    log = tmp_path / "trace.jsonl"
    ids = [await enqueue(manager, vram_mb=7 * 1024, sleep=0.4, trace=str(log)) for _ in range(2)]
    await make_worker([8 * 1024, 24 * 1024]).run()
    gpus = {r["gpu"] for r in trace(log)}
    assert gpus == {"0", "1"}  # CUDA_VISIBLE_DEVICES of each run
    first = await manager.get(ids[0])
    assert first.gpu == 0  # the tightest fit: 7 GB goes on the 8 GB GPU first


async def test_jobs_that_fit_no_gpu_wait_without_blocking_others(manager, make_worker):
    big = await enqueue(manager, vram_mb=40_000, priority=10)
    small = await enqueue(manager, vram_mb=2_000)
    await make_worker([24 * 1024]).run()
    assert (await manager.get(big)).state is JobState.queued
    assert (await manager.get(small)).state is JobState.succeeded


async def test_timeout_kills_the_whole_process_group(manager, make_worker, store):
    """The worker's timeout fails the job and kills its model (the pid read while it ran: a failed
    job's row keeps none). The kill goes to the model's group: tests/unit/test_runner.py's
    test_timeout_kills_the_whole_group sees a forked helper die with it."""
    from tests.integration.test_durability import running, until  # it imports this module

    job_id = await enqueue(manager, model="toy_timeout", sleep=20, steps=1, max_attempts=1)
    async with running(make_worker(burst=False)):
        pid = (await until(manager, job_id, lambda j: j.pid is not None)).pid
        job = await until(manager, job_id, lambda j: j.state.final)
    assert job.state is JobState.failed
    assert job.error is not None and job.error.startswith("timed out after 1 s")
    assert pid is not None and not _alive(pid)
    kinds = [e.kind for e in await manager.events(job_id)]
    assert kinds[-1] == "failed"


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


async def test_missing_output_fails_without_retry(manager, make_worker):
    job_id = await enqueue(manager, output=False)
    await make_worker().run()
    job = await manager.get(job_id)
    assert job.state is JobState.failed and job.attempt == 1
    assert job.error == "bad output: output 'out.txt' was not written"


async def test_refuses_to_start_when_no_gpu_fits_the_smallest_model(manager, make_worker):
    from app import errors

    worker = make_worker([512])
    try:
        await worker.run()
    except errors.ConfigError as exc:
        assert "smallest model needs 1000 MB" in exc.message and "512 MB" in exc.message
    else:
        raise AssertionError("the worker started without a usable GPU")


async def test_a_buffer_larger_than_the_gpu_is_named_not_a_negative_size(manager, make_worker):
    """The refusal said "the largest GPU offers -512 MB after the 1024 MB buffer"."""
    from app import errors

    worker = make_worker([512], vram_buffer_mb=1024)
    try:
        await worker.run()
    except errors.ConfigError as exc:
        assert "-512" not in exc.message
        assert "GPUJOBS_VRAM_BUFFER_MB (1024 MB) leaves nothing of the largest GPU (512 MB)" in exc.message
    else:
        raise AssertionError("the worker started without a usable GPU")


async def test_a_quick_run_skips_the_pid_write(manager, make_worker, monkeypatch):
    # "Quick" is under PID_AFTER_S (0.5 s). The toy model is a Python process, which a host busy
    # with other tests once kept alive longer than that: the test asks for less than 5 s.
    monkeypatch.setattr(watch, "PID_AFTER_S", 5.0)
    job_id = await enqueue(manager, steps=0)
    await make_worker().run()
    job = await manager.get(job_id)
    assert job.state is JobState.succeeded and job.pid is None
    assert [e.kind for e in await manager.events(job_id)] == ["submitted", "claimed", "succeeded"]


async def test_an_idle_workers_lanes_keep_no_users_image(manager, make_worker, store):
    """A lane kept its last job's input for the next job to overwrite: on an idle worker a user's
    image stayed on disk for as long as the worker ran, after retention had deleted it too. The
    reaper now removes the inputs of free lanes each round."""
    from tests.integration.test_durability import running, until  # it imports this module

    job_id = await enqueue(manager)
    async with running(make_worker(burst=False)):
        await until(manager, job_id, lambda j: j.state is JobState.succeeded)
        deadline = time.monotonic() + 5  # a reap round is 0.5 s here
        while inputs := list((store.root / "scratch").rglob("input*")):
            assert time.monotonic() < deadline, inputs
            await asyncio.sleep(0.1)


RUNNING_UNDER = text(
    "UPDATE jobs SET state = 'running', attempt = 1, worker_id = :worker, started_at = now(), pid = 4242,"
    " lease_expires_at = now() + interval '1 minute', cancel_requested = :cancel WHERE id = :id"
)


async def test_a_worker_stopped_at_once_hands_back_its_running_jobs_unspent(manager, engine):
    """Fleet.release_stopped, the hand-back of a worker stopped at once (its models dead): its
    running jobs go back to the queue, the attempt not spent and no abnormal death counted; one whose
    cancel is pending ends canceled. Another worker's running job and a finished one stay as they are."""
    mine, canceling, theirs, done = [await enqueue(manager) for _ in range(4)]
    async with engine.begin() as conn:
        for job_id, worker, cancel in (
            (mine, "h:me", False),
            (canceling, "h:me", True),
            (theirs, "h:other", False),
            (done, "h:me", False),
        ):
            await conn.execute(RUNNING_UNDER, {"id": job_id, "worker": worker, "cancel": cancel})
        await conn.execute(text("UPDATE jobs SET state = 'succeeded' WHERE id = :id"), {"id": done})
    back = await manager.fleet.release_stopped(worker_id="h:me", reason=attempt_.SHUTDOWN)
    assert {j.id: (j.state, j.attempt) for j in back} == {
        mine: (JobState.queued, 1),
        canceling: (JobState.canceled, 1),
    }
    job = await manager.get(mine)
    assert (job.state, job.attempt, job.max_attempts, job.abnormal_runs) == (JobState.queued, 1, 4, 0)
    assert (job.pid, job.lease_expires_at, job.finished_at) == (None, None, None)
    [released] = [e for e in await manager.events(mine) if e.kind == "released"]
    assert (released.attempt, released.worker_id) == (1, "h:me")
    assert released.detail == {"reason": attempt_.SHUTDOWN}
    job = await manager.get(canceling)
    assert (job.state, job.max_attempts, job.finished_at is not None) == (JobState.canceled, 3, True)
    assert (await manager.get(theirs)).state is JobState.running
    assert (await manager.get(done)).state is JobState.succeeded


async def test_a_job_goes_back_for_the_hosts_storage_a_bounded_number_of_times(manager, engine):
    """JobManager.release_storage: a running job whose files its host could not write goes back
    to the queue unspent, its error saying why, `most` times; then nothing is written (its attempt
    is failed instead). A job whose cancel is pending is refused, as a hand-back is (LeaseLost)."""
    job_id = await enqueue(manager)
    for n in range(1, 4):
        async with engine.begin() as conn:
            await conn.execute(RUNNING_UNDER, {"id": job_id, "worker": "h:me", "cancel": False})
        job = await manager.get(job_id)
        back = await manager.release_storage(job, reason=verdict.STORAGE, error="disk full\nmore", most=2)
        assert back is (n <= 2)
        job = await manager.get(job_id)
        assert job.state is (JobState.queued if n <= 2 else JobState.running)
    assert (job.max_attempts, job.error) == (5, "disk full\nmore")  # two returns: 3 + 2
    events = [e for e in await manager.events(job_id) if e.kind == "released"]
    assert [e.detail for e in events] == [{"reason": verdict.STORAGE, "error": "disk full"}] * 2
    async with engine.begin() as conn:
        await conn.execute(RUNNING_UNDER, {"id": job_id, "worker": "h:me", "cancel": True})
    with pytest.raises(errors.LeaseLost):
        await manager.release_storage(await manager.get(job_id), reason="other", error="x", most=9)


async def test_results_a_newer_attempt_removed_are_a_lost_job_not_storage_trouble(
    manager, make_worker, engine, store, settings, caplog
):
    """A worker paused while it stored a job's results lost the job to another, whose success
    removed the files of the attempts before it, this one's staged files included. Resumed, the
    worker took the missing file for its storage failing: it logged `storage_unusable` and paused
    its claims. The job is no longer its own: that is a lost job, nothing more."""
    from tests.integration.test_durability import running, until  # it imports this module

    # A model that reports no progress (its write would find the job gone) and takes a while.
    quiet = "import sys, time; time.sleep(1.5); open(sys.argv[1] + '/out.txt', 'w').write('x')"
    with settings.models_file.open("a") as f:
        f.write(script_model("quiet", ["{python}", "-c", quiet, "{output_dir}"]))
    job_id = await enqueue(manager, model="quiet")
    caplog.set_level(logging.INFO, logger="gpujobs")
    # No heartbeat meets the take-over before the model ends: the outcome's write is what finds it.
    async with running(make_worker(burst=False, heartbeat_interval_s=60, lease_s=120)):
        await until(manager, job_id, lambda j: j.pid is not None)
        async with engine.begin() as conn:  # taken over, as after a pause past the lease
            await conn.execute(TAKEN_OVER, {"id": job_id})
        # The newer attempt's success removed this attempt's results; its folder is not one now.
        (store.root / "results" / str(job_id)).write_text("not a folder")
        deadline = time.monotonic() + 20
        while not any(getattr(r, "action", None) == "lease_lost" for r in caplog.records):
            assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
            await asyncio.sleep(0.05)
    actions = [getattr(r, "action", None) for r in caplog.records]
    assert "storage_unusable" not in actions and "job_released" not in actions
    job = await manager.get(job_id)
    assert (job.state, job.attempt, job.worker_id) == (JobState.running, 2, "test:other")


TAKEN_OVER = text(
    "UPDATE jobs SET attempt = attempt + 1, worker_id = 'test:other',"
    " lease_expires_at = now() + interval '60 seconds' WHERE id = :id"
)
