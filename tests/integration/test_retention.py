"""Retention: old finished jobs lose their files, logs and unused inputs; nothing else is touched."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from sqlalchemy import text

from app import retention
from app.queue import sql
from app.queue.jobs import JobState
from app.queue.manager import JobManager
from tests.conftest import api_client, png_bytes
from tests.integration.test_worker import enqueue

WEEK_S = 7 * 86_400


def image(shade: int) -> bytes:
    """A distinct small PNG per shade (inputs are stored once per content)."""
    return png_bytes(color=(shade, 10, 10))


async def age(engine: Any, *job_ids: uuid.UUID, days: float = 10) -> None:
    """Pretend the jobs were created, started and finished `days` ago."""
    async with engine.begin() as conn:
        await conn.execute(
            text(
                "UPDATE jobs SET created_at = created_at - make_interval(days => :d),"
                " started_at = started_at - make_interval(days => :d),"
                " finished_at = finished_at - make_interval(days => :d) WHERE id = ANY(:ids)"
            ),
            {"d": days, "ids": list(job_ids)},
        )


def folders(root: Any, job_id: uuid.UUID) -> list[str]:
    """Which of the job's files exist: its result folder, its logs, a scratch folder (or logs of
    earlier versions, in a folder of their own)."""
    logs = list((root / "logs" / job_id.hex[:2]).glob(f"{job_id}.attempt-*.log"))
    logs += list((root / "logs" / str(job_id)).glob("attempt-*.log"))
    found = {"results": (root / "results" / str(job_id)).exists(), "logs": bool(logs)}
    found["scratch"] = (root / "scratch" / str(job_id)).exists()
    return [part for part, there in found.items() if there]


async def scene(manager: JobManager, make_worker: Any, engine: Any) -> dict[str, uuid.UUID]:
    """Jobs in every situation retention must judge (see the test for what each must become)."""
    jobs = {
        "old_ok": await enqueue(manager, image=image(1)),
        "old_failed": await enqueue(manager, image=image(2), exit_code=65),
        "recent_ok": await enqueue(manager, image=image(2)),  # shares its input with old_failed
    }
    await make_worker().run()
    jobs["old_canceled"] = await enqueue(manager, image=image(3))
    await manager.cancel(jobs["old_canceled"], owner=None, by="test")
    jobs["old_running"] = await enqueue(manager, image=image(4))
    [claimed] = await manager.claim(worker_id="t:x", host="h", models=["toy"], budgets={0: 9000}, lease_s=600)
    assert claimed.job.id == jobs["old_running"]
    jobs["old_queued"] = await enqueue(manager, image=image(5))
    await age(engine, *(v for k, v in jobs.items() if k.startswith("old")))
    return jobs


async def test_prune_deletes_exactly_the_old_finished_jobs_files(
    settings, manager, make_worker, engine, store
):
    jobs = await scene(manager, make_worker, engine)
    old = {jobs["old_ok"], jobs["old_failed"], jobs["old_canceled"]}
    assert folders(store.root, jobs["old_ok"]) == ["results", "logs"]
    assert folders(store.root, jobs["old_failed"]) == ["logs"]
    async with api_client(settings) as http:
        link = (await http.get(f"/jobs/{jobs['old_ok']}")).json()["files"][0]["url"]
        assert (await http.get(link)).status_code == 200

        dry = (await http.post("/admin/prune", json={"older_than_s": WEEK_S, "dry_run": True})).json()
        assert set(map(uuid.UUID, dry["job_ids"])) == old and dry["files_bytes"] > 0
        assert dry["inputs_deleted"] is None and folders(store.root, jobs["old_ok"]) == ["results", "logs"]

        report = (await http.post("/admin/prune", json={"older_than_s": WEEK_S})).json()
        assert set(map(uuid.UUID, report["job_ids"])) == old and report["jobs"] == 3
        assert report["files_bytes"] == dry["files_bytes"]
        assert report["inputs_deleted"] == 2  # old_ok's and old_canceled's; old_failed's is still used
        assert report["inputs_bytes"] == len(image(1)) + len(image(3))

        for name in old:
            assert folders(store.root, name) == []
        assert folders(store.root, jobs["recent_ok"]) == ["results", "logs"]
        gone = await http.get(link)  # a link handed out before retention ran
        assert gone.status_code == 410 and "retention" in gone.json()["detail"]
        shown = (await http.get(f"/jobs/{jobs['old_ok']}")).json()
        assert shown["expired_at"] is not None and shown["files"] == [] and shown["links"]["log"] is None
        recent = (await http.get(f"/jobs/{jobs['recent_ok']}")).json()["files"][0]["url"]
        assert (await http.get(recent)).status_code == 200
        assert (await http.get(f"/jobs/{jobs['old_ok']}/input")).status_code == 410
        assert (await http.get(f"/jobs/{jobs['old_failed']}/input")).content == image(2)
        assert (await http.post(f"/admin/jobs/{jobs['old_failed']}/retry")).status_code == 410

        again = (await http.post("/admin/prune", json={"older_than_s": WEEK_S})).json()
        assert again["jobs"] == 0 and again["inputs_deleted"] == 0

    for name, job_id in jobs.items():
        job = await manager.get(job_id)
        assert (job.expired_at is not None) == (job_id in old), name
    assert (await manager.get(jobs["old_running"])).state is JobState.running
    assert (await manager.get(jobs["old_queued"])).state is JobState.queued
    assert (await manager.get(jobs["old_ok"])).input_id is None
    assert (await manager.get(jobs["old_failed"])).input_id is not None
    assert [e.kind for e in await manager.events(jobs["old_ok"])][-1] == "expired"


async def test_one_prune_at_a_time(settings, manager):
    async with api_client(settings) as http:
        async with manager.advisory_lock(sql.RETENTION_LOCK_KEY) as held:
            assert held
            busy = await http.post("/admin/prune", json={"older_than_s": WEEK_S})
            assert busy.status_code == 409 and "already running" in busy.json()["detail"]
        assert (await http.post("/admin/prune", json={"older_than_s": WEEK_S})).status_code == 200


async def test_a_prune_refused_for_one_of_the_same_process_says_so(settings, manager, engine):
    """Two prunes at once through one API process: the second was told a prune ran "in another
    process", and an operator with one `serve` looked for that process in vain."""
    async with api_client(settings) as http:
        async with engine.connect() as blocker:  # holds the first prune in its expiry, lock taken
            await blocker.execute(text("LOCK TABLE jobs IN ACCESS EXCLUSIVE MODE"))
            first = asyncio.create_task(http.post("/admin/prune", json={"older_than_s": WEEK_S}))
            await until_locked(engine)
            second = await http.post("/admin/prune", json={"older_than_s": WEEK_S})
            await blocker.rollback()
        assert (await first).status_code == 200
    assert second.status_code == 409, second.text
    assert second.json()["detail"] == "a prune is already running in this process; try again later"


async def until_locked(engine) -> None:
    """Once a session holds the retention lock (pg_locks: an advisory lock on its key)."""
    for _ in range(200):
        async with engine.connect() as conn:
            held = await conn.scalar(
                text(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted"
                    " AND (classid::bigint << 32 | objid::bigint) = :key"
                ),
                {"key": sql.RETENTION_LOCK_KEY},
            )
        if held:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("no prune took the retention lock")


async def test_folders_left_by_a_crash_are_swept(settings, manager, make_worker, engine, store):
    job_id = await enqueue(manager)
    await make_worker().run()
    async with engine.begin() as conn:  # marked expired, then the process died before deleting
        await conn.execute(text("UPDATE jobs SET expired_at = now() WHERE id = :id"), {"id": job_id})
    assert folders(store.root, job_id) == ["results", "logs"]
    on_disk = sum(retention.tree_bytes(store.root / part) for part in ("results", "logs"))
    async with api_client(settings) as http:
        # A dry run said nothing of them (0 bytes, 0 leftovers), and the real run then freed them.
        dry = (await http.post("/admin/prune", json={"older_than_s": WEEK_S, "dry_run": True})).json()
        assert (dry["leftovers_removed"], dry["files_bytes"]) == (1, on_disk), dry
        assert folders(store.root, job_id) == ["results", "logs"]
        report = (await http.post("/admin/prune", json={"older_than_s": WEEK_S})).json()
    assert (report["jobs"], report["leftovers_removed"], report["files_bytes"]) == (0, 1, on_disk), report
    assert folders(store.root, job_id) == []


async def test_logs_in_the_layout_of_earlier_versions_are_served_and_pruned(
    settings, manager, make_worker, engine, store
):
    """Before logs/<xy>/<id>.attempt-<n>.log, each job had a folder logs/<id>/attempt-<n>.log."""
    job_id = await enqueue(manager)
    await make_worker().run()
    [log] = (store.root / "logs" / job_id.hex[:2]).glob(f"{job_id}.attempt-*.log")
    old = store.root / "logs" / str(job_id) / "attempt-1.log"
    old.parent.mkdir()
    log.rename(old)
    async with api_client(settings) as http:
        job = (await http.get(f"/jobs/{job_id}")).json()
        served = await http.get(job["links"]["log"])
        assert served.status_code == 200 and served.text == old.read_text() and "started pid" in served.text
        await age(engine, job_id)
        report = (await http.post("/admin/prune", json={"older_than_s": WEEK_S})).json()
    assert report["jobs"] == 1 and folders(store.root, job_id) == []


async def test_workers_prune_periodically(settings, manager, make_worker, engine, store, spawn_worker):
    keep = await enqueue(manager, image=image(1))
    drop = await enqueue(manager, image=image(2))
    await make_worker().run()
    await age(engine, drop)
    spawn_worker("pruner", retention_days=1, retention_interval_s=0.2)
    deadline = time.monotonic() + 30
    # The pruner marks a batch expired, then deletes its files: wait for both.
    while (await manager.get(drop)).expired_at is None or folders(store.root, drop):
        assert time.monotonic() < deadline, "the worker did not prune"
        await asyncio.sleep(0.1)
    assert folders(store.root, keep) == ["results", "logs"]
    assert (await manager.get(keep)).expired_at is None


async def test_retention_off_needs_an_explicit_age(settings):
    async with api_client(settings, retention_days=0) as http:
        refused = await http.post("/admin/prune", json={})
        assert refused.status_code == 422 and "older_than_s" in refused.json()["detail"]


async def test_a_worker_whose_clock_runs_ahead_keeps_recent_jobs(
    manager, make_worker, engine, store, monkeypatch
):
    """Ages are the database's: `finished_at` is its clock. The cutoff was taken from the pruning
    process's clock, so a host whose clock ran two hours fast deleted the results of jobs that had
    finished half an hour before, under a retention of one hour."""
    from datetime import datetime, timedelta

    from app import retention

    class Fast(datetime):
        @classmethod
        def now(cls, tz: Any = None) -> Any:
            return datetime.now(tz) + timedelta(hours=2)

    job_id = await enqueue(manager)
    await make_worker().run()
    await age(engine, job_id, days=1 / 48)  # finished half an hour ago
    monkeypatch.setattr(retention, "datetime", Fast)
    report = await retention.Pruner(manager, store.root).prune(older_than_s=3600)
    assert report.jobs == 0 and folders(store.root, job_id) == ["results", "logs"]
    assert (await manager.get(job_id)).expired_at is None


async def test_a_prune_age_that_is_not_a_number_says_so(settings):
    """`older_than_s: "nan"` was refused as "Input should be less than or equal to 3153600000",
    which a NaN is not; the message now says a finite number is wanted."""
    async with api_client(settings) as http:
        for value in ("nan", "NaN", "-inf"):
            refused = await http.post("/admin/prune", json={"older_than_s": value, "dry_run": True})
            assert refused.status_code == 422, refused.text
            assert "finite number" in refused.text, refused.text
