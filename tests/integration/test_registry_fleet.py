"""A registry that changes over time, and fleets whose workers do not all serve the same models."""

from __future__ import annotations

import logging

from app.queue.jobs import JobState
from app.queue.manager import JobManager
from tests.conftest import api_client, signed_in, toy_model
from tests.integration.test_worker import enqueue

GPUS = [{"index": 0, "name": "fake-0", "total_mb": 24_576, "free_mb": 24_576}]


async def serving(manager: JobManager, worker: str, models: list[str], *, live: bool = True) -> None:
    """Register a worker serving `models` as workers do at their start (stopped unless `live`)."""
    await manager.fleet.register_worker(worker_id=worker, host="h", pid=1, models=models, gpus=GPUS)
    if not live:
        await manager.fleet.set_worker_state(worker, "stopped")


async def test_a_queue_no_live_worker_serves_is_marked(settings, manager, make_key):
    """Jobs of a model dropped from the registry (or served only by workers that are down) wait
    for ever: the admin stats and page listed them as an ordinary queue, nothing said no worker
    would take them. Each queue row now says how many live workers serve its model."""
    await enqueue(manager, model="toy")
    await enqueue(manager, model="gone", priority=2)  # queued before `gone` left the registry
    await serving(manager, "old:worker", ["toy", "gone"], live=False)
    await serving(manager, "new:worker", ["toy"])
    async with api_client(settings) as http:
        stats = (await http.get("/admin/stats")).json()
        assert sorted((q["model"], q["live_workers"]) for q in stats["queue"]) == [("gone", 0), ("toy", 1)]
        await signed_in(http, await make_key("root", admin=True))
        page = (await http.get("/ui/admin")).text
    rows = page[page.index('id="admin-queue"') :].split("<tr>")
    [gone] = [row for row in rows if 'scope="row">gone' in row]
    [toy] = [row for row in rows if 'scope="row">toy' in row]
    assert "no live worker serves this model" in gone, gone
    assert "no live worker" not in toy, toy


async def test_a_worker_says_which_models_fit_none_of_its_gpus(manager, make_worker, models_file, caplog):
    """A model whose declared VRAM outgrew every GPU (a registry edit, or a worker on smaller
    cards) left its jobs queued with nothing said: the worker started, claimed the others, and
    never mentioned it. It now names such models at its start, with what they need."""
    big = toy_model("big").replace("base_mb = 1000", "base_mb = 30000")
    models_file.write_text(models_file.read_text() + big)
    job_id = await enqueue(manager, model="big", vram_mb=30_000)
    caplog.set_level(logging.WARNING, logger="gpujobs")
    await make_worker([24_576, 16_384]).run()
    assert (await manager.get(job_id)).state is JobState.queued
    [said] = [r for r in caplog.records if getattr(r, "action", None) == "models_too_large"]
    message = said.getMessage()
    assert "big (30000 MB)" in message and "24576 MB" in message, message
    assert "toy" not in message.replace("big", ""), message


async def test_the_model_list_says_how_many_live_workers_serve_each_model(settings, manager, make_key):
    """A user chose a model from GET /models, submitted, and waited for ever: nothing a caller
    without an admin key can read said that no worker serves it. Each model now says how many live
    workers serve it (0: its jobs wait until one starts)."""
    await serving(manager, "old:worker", ["toy", "relief"], live=False)
    await serving(manager, "new:worker", ["toy"])
    await serving(manager, "other:worker", ["toy"])
    async with api_client(settings, key=await make_key("user")) as http:
        models = {m["name"]: m for m in (await http.get("/models")).json()["models"]}
    assert models["toy"]["live_workers"] == 2
    assert models["relief"]["live_workers"] == 0
