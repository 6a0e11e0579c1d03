"""Review of several GPU hosts sharing one PostgreSQL: failing tests for the defects found.

Each test says what docs/operations.md or the README promise, and what the service does instead.
"""

from __future__ import annotations

import asyncio

import pytest

from app import errors, storage
from app.queue.jobs import JobState
from tests.conftest import api_client, toy_model
from tests.integration.test_durability import running, until
from tests.integration.test_worker import enqueue


async def test_live_workers_counts_no_worker_whose_gpus_cannot_take_the_model(
    settings, manager, make_worker, make_key, models_file
):
    """Two hosts: a 48 GB one and a 24 GB one. A model of 30,000 MB fits only the first. Once the
    48 GB host is down, `GET /models` and `GET /admin/stats` still say one live worker serves the
    model (the 24 GB host has it in its registry, though its own start logged `models_too_large`
    for it), so a user's job waits for ever while everything says a worker will take it. README:
    "`live_workers`: how many live workers serve each (0: its jobs wait until one starts)";
    docs/operations.md: "0: nothing takes these jobs now"."""
    mid = toy_model("mid").replace("base_mb = 1000", "base_mb = 30000")
    models_file.write_text(models_file.read_text() + mid)
    # Host B (48 GB) ran a mid job, then stopped (its host went away).
    first = await enqueue(manager, model="mid", vram_mb=30_000)
    await make_worker([49_152], name="hostb").run()
    assert (await manager.get(first)).state is JobState.succeeded
    # Host A (24 GB) is live; a new mid job (admitted: host B was seen within the day) waits.
    job_id = await enqueue(manager, model="mid", vram_mb=30_000)
    async with running(make_worker([24_576], name="hosta", burst=False)):
        await asyncio.sleep(2)  # several claim rounds and heartbeats of host A
        assert (await manager.get(job_id)).state is JobState.queued  # host A never takes it
        async with api_client(settings, key=await make_key("user")) as http:
            models = {m["name"]: m for m in (await http.get("/models")).json()["models"]}
        async with api_client(settings) as admin:
            stats = (await admin.get("/admin/stats")).json()
    assert models["toy"]["live_workers"] == 1
    queue = {(q["model"], q["state"]): q["live_workers"] for q in stats["queue"]}
    assert models["mid"]["live_workers"] == 0, models["mid"]
    assert queue[("mid", "queued")] == 0, stats["queue"]


async def test_a_second_host_under_a_live_workers_id_leaves_its_jobs_and_lanes_alone(
    manager, make_worker, store, monkeypatch
):
    """Two hosts with one storage folder (as docs/operations.md asks) and, by a copied config, one
    worker id. The one-id-per-host socket cannot see the other host (the docs say so), but the
    lanes' lock in the shared folder can: the second worker's start finds it held by a live
    process, logs `lanes_unlocked` ("if it is killed, what it leaves there stays"), and goes on:
    before that it requeued the first host's running job as a crashed past life's (an attempt and
    an abnormal death spent), and after it removes the first host's scratch lanes under its
    running model (`lanes.reset`), whose next attempt then fails with `exit code 1` (another
    attempt spent). Seen live: hostB:worker twice, storage shared, job 66c69d3e… attempts 3 and 4.
    Expected: a start that finds its id's lanes locked by a live worker refuses, as the same
    check on one host does (exit code 2), and touches neither its jobs nor its lanes."""
    from app.queue import leftovers

    job_id = await enqueue(manager, sleep=4, steps=8)
    first = make_worker(name="dup", burst=False)
    async with running(first):
        await until(manager, job_id, lambda j: j.state is JobState.running and j.pid is not None)
        monkeypatch.setattr(leftovers, "hold_identity", lambda worker_id: None)  # another host
        # Another host's process: a store of its own on the same folder (its own lock's fd).
        second = make_worker(name="dup", burst=False, store_=storage.ResultStore(store.root))
        with pytest.raises(errors.ConfigError, match=r"another worker with the id .* shares this storage"):
            await asyncio.wait_for(second.run(), timeout=30)  # before: it ran on, taking the job
        done = await until(manager, job_id, lambda j: j.state.final, timeout_s=60)
    history = [(e.kind, e.attempt, e.detail) for e in await manager.events(job_id) if e.kind != "progress"]
    assert (done.state, done.attempt) == (JobState.succeeded, 1), history
