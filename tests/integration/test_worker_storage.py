"""A worker whose storage folder fills: a real filesystem that runs out of room (ENOSPC).

The worker runs in a user and mount namespace of its own (`unshare -Urm`, which needs no root),
with a small tmpfs mounted over its storage folder, part of it taken by a ballast file. The test
reaches that folder through /proc/<worker pid>/root, and frees the room by removing the ballast."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from app.queue.jobs import JobState
from app.queue.manager import JobManager
from tests.conftest import api_client, script_model, toy_model, warm_model, worker_env
from tests.integration.test_durability import kinds, until
from tests.integration.test_worker import enqueue
from tests.netcut import CuttableLink

TMPFS_KB = 4096
BALLAST_KB = 3584  # leaves about 512 KiB: a job's input and a small output fit, the probe's 1 MiB not
# A model whose output (3 MiB) fits the empty tmpfs, but not beside the ballast.
WRITES_3_MB = "import sys; open(sys.argv[1] + '/out.bin', 'wb').write(bytes(3 << 20))"


def _namespaces_allowed() -> bool:
    if shutil.which("unshare") is None:
        return False
    done = subprocess.run(["unshare", "-Urm", "true"], capture_output=True, check=False)
    return done.returncode == 0


pytestmark = pytest.mark.skipif(
    not _namespaces_allowed(), reason="needs unshare and unprivileged user namespaces (a real full disk)"
)

# Mount the tmpfs over the storage folder, fill it but for what BALLAST_KB leaves, run the worker.
_WRAPPER = (
    'mount -t tmpfs -o size="$1"k gpujobs-test "$2" && dd if=/dev/zero of="$2/ballast" bs=1024 count="$3"'
    ' 2>/dev/null && shift 3 && exec "$@"'
)


@pytest.fixture
async def full_disk_worker(settings: Any, tmp_path: Path) -> AsyncIterator[Any]:
    """Start `gpujobs worker` on a nearly full storage folder (the module's docstring); killed at
    the end. It reaches the database through a link in tmp_path: in its namespace, root has no
    rights over folders of the host's other users (the embedded server's socket)."""
    link = CuttableLink(settings.database_url, tmp_path / "link")
    url = await link.start()
    started: list[subprocess.Popen[bytes]] = []

    def spawn(name: str, *, ballast_kb: int = BALLAST_KB, **overrides: Any) -> subprocess.Popen[bytes]:
        storage = settings.storage_dir
        storage.mkdir(parents=True, exist_ok=True)
        argv = [str(TMPFS_KB), str(storage), str(ballast_kb), sys.executable, "-m", "app", "worker"]
        with (tmp_path / f"worker-{name}.log").open("wb") as log:
            process = subprocess.Popen(
                ["unshare", "-Urm", "sh", "-c", _WRAPPER, "sh", *argv],
                env=worker_env(settings, name, **{"database_url": url, **overrides}),
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        started.append(process)
        return process

    yield spawn
    for process in started:
        if process.poll() is None:
            process.terminate()
        try:
            await asyncio.to_thread(process.wait, 15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    await link.close()


def seen_by(worker: subprocess.Popen[bytes], path: Path) -> Path:
    """`path` as the worker sees it: inside its mount namespace."""
    return Path(f"/proc/{worker.pid}/root") / path.relative_to("/")


def lines_with(log: Path, action: str) -> list[str]:
    """The worker's log lines with `action`."""
    return [line for line in log.read_text().splitlines() if f"action={action}" in line]


async def said(log: Path, action: str, timeout_s: float = 15) -> list[str]:
    """The worker's log lines with `action`, once there is one."""
    deadline = time.monotonic() + timeout_s
    while not (lines := lines_with(log, action)):
        assert time.monotonic() < deadline, f"no {action} line:\n" + "\n".join(lines_with(log, ""))[-3000:]
        await asyncio.sleep(0.1)
    return lines


async def a_job_that_fills_the_disk(
    settings: Any, manager: JobManager, full_disk_worker: Any, tmp_path: Path, **overrides: Any
) -> tuple[Any, Path, Any]:
    """A worker on the nearly full disk (its settings `overrides`), its log, and a job of one
    attempt whose model writes 3 MB there (models `big` and `toy`)."""
    settings.models_file.write_text(
        script_model("big", ["{python}", "-c", WRITES_3_MB, "{output_dir}"], output="out.bin")
        + toy_model("toy")
    )
    worker = full_disk_worker("full", **overrides)
    return worker, tmp_path / "worker-full.log", await enqueue(manager, model="big", max_attempts=1)


async def test_a_model_that_fills_the_disk_spends_no_attempt_and_claims_pause(
    settings: Any, manager: JobManager, full_disk_worker: Any, tmp_path: Path
) -> None:
    """The disk has room for a job's input but not for its outputs: the model dies of ENOSPC while it
    writes them. That counted as the model's failure: the job spent an attempt (here its only one,
    so it failed) and the worker claimed the next job, so one full disk could fail a whole queue.
    Now the job goes back to the queue, no attempt spent, the worker claims nothing until its storage
    takes a file again, and then runs it."""
    worker, log, big = await a_job_that_fills_the_disk(settings, manager, full_disk_worker, tmp_path)
    job = await until(manager, big, lambda j: j.state is not JobState.running and j.attempt == 1)
    assert (job.state, job.max_attempts, job.abnormal_runs) == (JobState.queued, 2, 0), job.error
    assert job.error is not None and "No space left on device" in job.error, job.error
    assert (await kinds(manager, big))[-1] == "released"
    await said(log, "storage_unusable")

    small = await enqueue(manager)  # fits beside the ballast, but the worker claims nothing now
    await asyncio.sleep(2)  # four poll intervals
    assert [(await manager.get(j)).state for j in (big, small)] == [JobState.queued] * 2

    seen_by(worker, settings.storage_dir / "ballast").unlink()
    await said(log, "storage_usable_again")
    for job_id in (big, small):
        job = await until(manager, job_id, lambda j: j.state.final)
        assert job.state is JobState.succeeded, job.error
    job = await manager.get(big)
    assert (job.attempt, job.max_attempts, job.abnormal_runs) == (2, 2, 0)


async def test_a_warm_model_that_fills_the_disk_spends_no_attempt(
    settings: Any, manager: JobManager, full_disk_worker: Any, tmp_path: Path
) -> None:
    """As a one-shot model's: a warm runner's job that fails writing its outputs to a full disk
    (its model's error: OSError, ENOSPC) goes back to the queue unspent, and runs once there is room."""
    fill = '[models.warm_fill.params.fill_kb]\ntype = "int"\ndefault = 0\n'
    settings.models_file.write_text(warm_model("warm_fill", tmp_path / "loads.txt") + fill)
    worker = full_disk_worker("full")
    job_id = await enqueue(manager, model="warm_fill", max_attempts=1, fill_kb=3072)
    job = await until(manager, job_id, lambda j: j.state is not JobState.running and j.attempt == 1)
    assert (job.state, job.max_attempts, job.abnormal_runs) == (JobState.queued, 2, 0), job.error
    assert job.error is not None and "No space left on device" in job.error, job.error
    seen_by(worker, settings.storage_dir / "ballast").unlink()
    job = await until(manager, job_id, lambda j: j.state.final)
    assert (job.state, job.attempt, job.max_attempts) == (JobState.succeeded, 2, 2), job.error


async def test_a_job_whose_outputs_never_fit_ends_after_a_few_returns(
    settings: Any, manager: JobManager, full_disk_worker: Any, tmp_path: Path
) -> None:
    """A job sent back for the host's storage is not sent back for ever: one whose outputs fill
    the disk by themselves would go round the workers, pausing each. After a few returns
    (verdict.STORAGE_RETURNS_MAX) its attempts are spent as any failure's."""
    from app.queue import verdict

    settings.models_file.write_text(
        script_model("huge", ["{python}", "-c", WRITES_3_MB.replace("3 <<", "5 <<"), "{output_dir}"])
    )
    full_disk_worker("full", ballast_kb=0, poll_interval_s=0.1)  # 5 MiB never fit in 4
    job_id: uuid.UUID = await enqueue(manager, model="huge", max_attempts=1)
    # Its lane emptied, the disk takes the probe's file again: the job comes back to this worker.
    job = await until(manager, job_id, lambda j: j.state.final, timeout_s=60)
    assert (job.state, job.abnormal_runs) == (JobState.failed, 0), job.error
    history = await kinds(manager, job_id)
    assert history.count("released") == verdict.STORAGE_RETURNS_MAX, history
    assert job.attempt == verdict.STORAGE_RETURNS_MAX + 1


# Prints 1 MiB on stderr (its log takes the disk's last room), then writes its output as many tools
# do, without checking that the bytes reached the disk, and exits 0.
LOG_FILLS_DISK = (
    "import sys; sys.stderr.write(('n' * 63 + chr(10)) * 16384); sys.stderr.flush()\n"
    "try:\n    f = open(sys.argv[1] + '/out.txt', 'wb'); f.write(b'mesh'); f.close()\n"
    "except OSError:\n    pass\n"
)


async def test_a_run_whose_log_fills_the_disk_is_not_charged_to_the_job(
    settings: Any, manager: JobManager, full_disk_worker: Any, tmp_path: Path
) -> None:
    """About 512 KiB free: the run's own log takes it (the worker logs `log_write_failed`, ENOSPC),
    and the model, exiting 0, leaves its output empty. The job ended `failed` for good ("bad output:
    output 'out.txt' is empty", not retryable): the host's full disk charged to the job. It goes
    back to the queue, `released`, no attempt spent, its error saying why."""
    settings.models_file.write_text(
        script_model("chatty", ["{python}", "-c", LOG_FILLS_DISK, "{output_dir}"], max_attempts=1)
    )
    full_disk_worker("full")
    job_id = await enqueue(manager, model="chatty", max_attempts=1)
    job = await until(manager, job_id, lambda j: j.state is not JobState.running and j.attempt == 1)
    await said(tmp_path / "worker-full.log", "log_write_failed")
    history = await kinds(manager, job_id)
    assert (job.state, history[-1]) == (JobState.queued, "released"), (job.error, history)
    assert "No space left on device" in (job.error or "") and "out.txt" in (job.error or ""), job.error


async def test_a_paused_worker_says_so_and_serves_nothing_until_its_storage_takes_a_file(
    settings: Any, manager: JobManager, full_disk_worker: Any, tmp_path: Path
) -> None:
    """While its storage folder took no file the worker claimed nothing, yet `GET /admin/workers`
    said it was running and live, `GET /models` counted it in `live_workers` (so `gpujobs submit`
    warned of nothing) and /metrics had no sign of it: only its log said so. Now its heartbeat
    reports why it claims nothing (`paused`), it serves no model meanwhile, and
    `gpujobs_worker_paused` is 1, from the moment its claims pause (a heartbeat at once, not at
    the interval's end: 30 s here); the probe that passes clears it as soon."""
    worker, log, big = await a_job_that_fills_the_disk(
        settings, manager, full_disk_worker, tmp_path, heartbeat_interval_s=30, lease_s=90
    )
    await said(log, "storage_unusable")

    paused = await _worker_until(settings, lambda w: w.get("paused") is not None)
    me = paused["id"]
    assert (paused["state"], paused["live"]) == ("running", True), paused
    assert "No space left on device" in paused["paused"], paused
    assert await _live_workers(settings, "toy") == 0
    async with api_client(settings) as admin:
        metrics = (await admin.get("/metrics")).text
    assert f'gpujobs_worker_paused{{worker="{me}"}} 1.0' in metrics, metrics

    seen_by(worker, settings.storage_dir / "ballast").unlink()
    await said(log, "storage_usable_again")
    claiming = await _worker_until(settings, lambda w: w.get("paused", "") is None)
    assert claiming["live"], claiming
    assert await _live_workers(settings, "toy") == 1
    async with api_client(settings) as admin:
        metrics = (await admin.get("/metrics")).text
    assert f'gpujobs_worker_paused{{worker="{me}"}} 0.0' in metrics, metrics
    assert (await until(manager, big, lambda j: j.state.final)).state is JobState.succeeded


async def _worker_until(settings: Any, check: Any, timeout_s: float = 10) -> dict[str, Any]:
    """The one worker's entry in `GET /admin/workers` once `check` passes on it."""
    deadline = time.monotonic() + timeout_s
    async with api_client(settings) as admin:
        while True:
            [found] = (await admin.get("/admin/workers")).json()
            if check(found):
                return found
            assert time.monotonic() < deadline, found
            await asyncio.sleep(0.1)


async def _live_workers(settings: Any, model: str) -> int:
    """`live_workers` of `model` in `GET /models`."""
    async with api_client(settings) as http:
        models = {m["name"]: m for m in (await http.get("/models")).json()["models"]}
    return int(models[model]["live_workers"])
