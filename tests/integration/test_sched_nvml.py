"""A worker on NVML whose readings fail for a while (a driver hiccup): it keeps its jobs' leases
and goes on claiming once the readings come back. One GPU that cannot be read takes no jobs while
the others go on."""

from __future__ import annotations

import asyncio
import logging

from app import gpu
from app.queue.jobs import JobState
from tests.conftest import api_client, worker_id
from tests.integration.test_durability import running, until
from tests.integration.test_observability import scrape, value
from tests.integration.test_worker import enqueue
from tests.unit.test_gpu import GIB, fake_pynvml


async def test_nvml_failing_for_a_while_stops_neither_the_worker_nor_its_jobs(
    manager, make_worker, settings, caplog
):
    """NVML raised while a job ran: the heartbeat's GPU reading raised with it, the heartbeat task
    died and the worker stopped (its running jobs' leases no longer renewed, nothing claimed
    again). Now the heartbeat renews the leases with the last reading it had, claims pause while
    the GPUs cannot be read, and both resume when NVML answers again. The log says so once each
    way, not at every claim."""
    caplog.set_level(logging.INFO, logger="gpujobs")
    nvml = fake_pynvml([("NVIDIA test", 24 * GIB, 24 * GIB)])
    worker = make_worker(burst=False, inventory=gpu.NvmlInventory(nvml))
    first = await enqueue(manager, sleep=settings.lease_s * 1.5, steps=6)
    async with running(worker) as serving:
        await until(manager, first, lambda j: j.pid is not None)
        nvml.state["failing"] = "Unknown Error"
        await asyncio.sleep(settings.lease_s)  # heartbeats and claims meet the error
        later = await enqueue(manager, sleep=0.1, steps=1)
        await asyncio.sleep(settings.poll_interval_s * 2)
        assert (await manager.get(later)).state is JobState.queued  # GPUs unread: nothing claimed
        nvml.state["failing"] = None
        done = await until(manager, later, lambda j: j.state.final)
        assert done.state is JobState.succeeded
        assert serving.claimed == 2
    job = await manager.get(first)
    assert (job.state, job.attempt, job.abnormal_runs) == (JobState.succeeded, 1, 0)
    actions = [getattr(r, "action", None) for r in caplog.records]
    assert (actions.count("gpu_read_failed"), actions.count("gpu_read_again")) == (1, 1)


async def test_a_runs_peak_memory_is_still_read_after_nvml_failed_for_a_while(manager, make_worker, settings):
    """The sampler of a run's GPU memory died with the first NVML error, unseen: the run's peak was
    never recorded after a driver hiccup (the learned VRAM estimate goes by these peaks)."""
    seen: list[tuple[int, int | None]] = []
    nvml = fake_pynvml([("NVIDIA test", 24 * GIB, 24 * GIB)], processes=[seen])
    worker = make_worker(burst=False, inventory=gpu.NvmlInventory(nvml))
    job_id = await enqueue(manager, sleep=4, steps=4)
    async with running(worker):
        pid = (await until(manager, job_id, lambda j: j.pid is not None)).pid
        nvml.state["failing"] = "Unknown Error"
        await asyncio.sleep(1.5)  # the sampler reads NVML every 0.5 s
        nvml.state["failing"] = None
        seen.append((pid, 2000 * 1024 * 1024))  # the model takes its memory once NVML answers again
        done = await until(manager, job_id, lambda j: j.state.final)
    assert done.state is JobState.succeeded
    assert done.vram_peak_mb == 2000


async def test_a_gpu_fallen_off_the_bus_takes_no_jobs_and_the_others_go_on(settings, manager, make_worker):
    """One unreadable GPU made every NVML reading raise: a worker with several GPUs stopped claiming
    for all of them until restarted. Now the lost GPU shows full, with NVML's error, in the workers
    view and the metrics, and jobs go to the others."""
    nvml = fake_pynvml([("NVIDIA test", 24 * GIB, 24 * GIB)] * 2)
    nvml.state["lost"] = {0: "GPU is lost"}
    labels = {"worker": worker_id("w1"), "name": "NVIDIA test"}
    worker = make_worker(burst=False, inventory=gpu.NvmlInventory(nvml))
    async with api_client(settings, metrics_cache_s=0) as http, running(worker):
        job_id = await enqueue(manager, sleep=0.1, steps=1)
        done = await until(manager, job_id, lambda j: j.state.final)
        assert (done.state, done.gpu) == (JobState.succeeded, 1)
        [w] = (await http.get("/admin/workers")).json()
        assert [(g["free_mb"], g["error"]) for g in w["gpus"]] == [
            (0, "NVML: reading memory of GPU 0 failed: GPU is lost"),
            (24_576, None),
        ]
        samples = await scrape(http)
        assert value(samples, "gpujobs_gpu_unreadable", gpu="0", **labels) == 1
        assert value(samples, "gpujobs_gpu_unreadable", gpu="1", **labels) == 0
